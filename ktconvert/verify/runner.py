"""``run_verify``: the model as a rule file injects it, on converted weights, against golden outputs.

Two phases, each from an empty KV cache:

* **prefill**: the whole golden prompt in one forward. Layer-wise prefill (and so ``prefill_op``) runs when
  the rules' model operator would run it for a prompt this long; otherwise ``generate_op`` serves.
* **decode**: the same prompt one token per forward, each step attending to the cache the previous steps
  wrote, with ``generate_op`` (a one-token forward never exceeds a layer-wise threshold). Every position's
  logits must reproduce the golden's, so a fault only the decode path has shows at the position and layer
  where it enters.

Each phase compares logits per position and every layer's hidden state with the golden, and (when the
model directory holds the original weights) every module with the plain reference model, to name the first
layer and module where error jumps.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert.errors import InputError
from ktconvert.golden import read_golden
from ktconvert.io.datafile import read_json
from ktconvert.io.procstats import TreePeak
from ktconvert.io.sizes import format_size
from ktconvert.formats.release import open_release
from ktconvert.model import build_model, load_weights, module_type_resolver
from ktconvert.model.inject import EmulationOptions, inject
from ktconvert.model.ops.experts import torch_dtype
from ktconvert.model.ops.source import WeightSource, read_safetensors
from ktconvert.rules.apply import injection_plan, load_rules
from ktconvert.rules.catalog import load_catalog
from ktconvert.verify.experts import ExpertProbe
from ktconvert.verify.metrics import LogitStats, first_nonfinite, nmse
from ktconvert.verify.profile import (
    Breach,
    Profile,
    auto_profile,
    evaluate,
    load_profile,
)
from ktconvert.verify.tap import ModuleTap


@dataclass
class PhaseResult:
    name: str
    layerwise: bool  # prefill ops ran (layer-wise prefill)
    logits: LogitStats
    layers: list[tuple[str, float]]  # ("embed", nmse), ("layer 0", nmse), ...
    nonfinite: dict | None
    modules: list | None  # ModuleError rows, execution order; None when no reference ran
    localization: dict | None
    breaches: list[Breach] = field(default_factory=list)
    candidate_logits: np.ndarray | None = field(default=None, repr=False)  # [T, V], for verify --lora's base check
    # teacher-forced: ("embed", nmse), ("layer 0", nmse), ... each candidate layer on the reference's input against
    # the reference's output (the error that layer alone adds); None when no reference ran
    forced: list[tuple[str, float]] | None = None
    # per MoE layer ("layer 1": [{"expert", "tokens", "nmse"}, ...]): each candidate expert on the reference's own
    # expert input and routing against the reference expert (ktconvert.verify.experts); None when no reference ran
    experts: dict[str, list[dict]] | None = None

    def as_dict(self) -> dict:
        return {
            "ops": "prefill_op (layer-wise prefill)" if self.layerwise else "generate_op",
            "logits": _clean(self.logits.summary()),
            "positions": [_clean(p) for p in self.logits.per_position()],
            "layers": [{"layer": name, "nmse": _num(v)} for name, v in self.layers],
            "forced": None if self.forced is None else [{"layer": name, "nmse": _num(v)} for name, v in self.forced],
            "experts": self.experts,
            "nonfinite": self.nonfinite,
            "localization": self.localization,
            "modules": None if self.modules is None else [m.as_dict() for m in self.modules],
            "breaches": [b.as_dict() for b in self.breaches],
        }


def _num(v):
    return float(v) if v is not None and math.isfinite(float(v)) else None


def _clean(d: dict) -> dict:
    return {k: (_num(v) if isinstance(v, float) else v) for k, v in d.items()}


@contextmanager
def _threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_golden_matches(golden, release) -> list[str]:
    """Refuse a golden made from another model (config hash, weight hashes); return what was not checkable.
    ``release``: the model directory (a :class:`~ktconvert.formats.release.Release`, or a path opened here)."""
    release = open_release(release)
    model_dir = release.path
    manifest = golden.manifest
    cfg = release.config_file
    if not cfg.is_file():
        raise InputError("config.json not found", path=str(cfg), fix="--model takes the Hugging Face model directory")
    if release.config_sha256 != manifest["model"]["config_sha256"]:
        raise InputError(f"config.json differs from the one golden {manifest['name']!r} was made with "
                         f"(config sha256 {manifest['model']['config_sha256'][:12]}…)", path=str(cfg),
                         fix="pass the golden of this model, or the model this golden belongs to")
    unchecked = []
    for name, digest in manifest["model"]["files"].items():
        if not name.endswith(".safetensors"):
            continue
        f = model_dir / name
        if not f.is_file():
            unchecked.append(f"{name} (not in the model directory)")
            continue
        if release.file_sha256(name) != digest:
            raise InputError(f"weights differ from those golden {manifest['name']!r} was made with "
                             f"(sha256 {digest[:12]}…)", path=str(f),
                             fix="the golden belongs to other weights: regenerate it or pass the original model")
    sources = {n: r for n, r in manifest["model"].get("sources", {}).items() if n not in manifest["model"]["files"]}
    if sources:  # a streamed golden records each weight file's size and header hash, not a whole-file hash
        have = release.source_records()
        for name, rec in sources.items():
            if name not in have:
                unchecked.append(f"{name} (not in the model directory)")
            elif have[name] != rec:
                raise InputError(f"weights differ from those golden {manifest['name']!r} was made with (size "
                                 f"{rec['bytes']}, header sha256 {rec['header_sha256'][:12]}…)",
                                 path=str(model_dir / name),
                                 fix="the golden belongs to other weights: regenerate it or pass the original model")
    return unchecked


def _phases(specs: list[tuple[str, bool, int]], run: "_Run", golden, profile: Profile,
            progress=None) -> list[PhaseResult]:
    """The phases ``specs`` (``(name, layerwise prefill, tokens per step)``) through the layer-major executor. With
    the reference: every phase in one pass in lockstep with it (:func:`~ktconvert.model.executor.run_pairs`: each
    layer's weights read once for all the phases; module errors, and each layer's teacher-forced error), each phase
    with a module tap and an expert probe of its own, pointed at by the phase's guard, which also switches the
    candidate's operators to the phase's. The candidate alone: its phases in one pass as well."""
    import torch

    from ktconvert.model.executor import PairPhase, run_pairs

    ids = torch.from_numpy(np.ascontiguousarray(golden.input_ids)).to(torch.long)
    n_layers = len(run.candidate.model.model.layers)
    began = time.perf_counter()

    def on_layer_of(name: str | None, tap):
        """After each layer: ``name`` the pass's progress line (None: another phase of the pass reports it)."""
        def on_layer(index, *_):
            run.rebudget()  # a kernel child may hold more after the candidate's layer than the plan counted
            if tap is not None:
                tap.step()  # this layer's modules are compared: forget the reference's calls
            if progress is not None and name is not None:
                progress(name, index + 1, n_layers, time.perf_counter() - began)
        return on_layer

    together = "+".join(name for name, _, _ in specs)  # one progress line per layer of the one pass

    def switch_of(layerwise: bool):
        """A guard switching the candidate's operators to a phase's (layer-wise prefill or not) for its calls."""
        @contextmanager
        def guard():
            run.injected.set_layerwise(layerwise)
            try:
                yield
            finally:
                run.injected.set_layerwise(False)
        return guard

    if run.reference is None:  # the candidate alone: its phases in one pass too (LayerMajor.run_many)
        with torch.no_grad():
            outs = run.candidate.run_many(ids, [step for _, _, step in specs],
                                          [switch_of(layerwise) for _, layerwise, _ in specs],
                                          on_layer=on_layer_of(together, None))
        return [_phase_result(name, layerwise, step, out, None, None, None, golden, profile)
                for (name, layerwise, step), out in zip(specs, outs)]

    taps = [ModuleTap(run.reference.model, run.candidate.model) for _ in specs]
    probes = [ExpertProbe(guard=tap.paused, dtype=run.dtype) for tap in taps]

    def guard_of(k: int, layerwise: bool):
        """The phase's switch, with every other phase's module tap muted."""
        @contextmanager
        def guard():
            with ExitStack() as stack:
                for j, other in enumerate(taps):
                    if j != k:
                        stack.enter_context(other.muted())
                stack.enter_context(switch_of(layerwise)())
                yield
        return guard

    phases = [PairPhase(step, on_layer_of(together if k == len(specs) - 1 else None, taps[k]), taps[k].paused,
                        probes[k], guard_of(k, layerwise)) for k, (name, layerwise, step) in enumerate(specs)]
    try:
        with torch.no_grad():
            pairs = run_pairs(run.reference, run.candidate, ids, phases)
    finally:
        run.injected.set_layerwise(False)
        for tap in taps:
            tap.close()
    results = []
    for (name, layerwise, step), pair, tap, probe in zip(specs, pairs, taps, probes):
        forced = [(_layer_name(li), nmse(r[0].to(torch.float32).numpy(), f[0].to(torch.float32).numpy()))
                  for li, (r, f) in enumerate(zip(pair.reference.hidden_states, pair.forced))]
        results.append(_phase_result(name, layerwise, step, pair.candidate, forced, tap, probe, golden, profile))
    return results


def _phase_result(name: str, layerwise: bool, tokens_per_step: int, out, forced, tap, probe, golden,
                  profile: Profile) -> PhaseResult:
    """One phase's :class:`PhaseResult` from the candidate's output (and the reference's taps, where it ran)."""
    import torch

    t = int(golden.input_ids.shape[1])
    cand_logits = out.logits[0].to(torch.float32).numpy()
    hidden = [h[0].to(torch.float32).numpy() for h in out.hidden_states]
    nonfinite = None
    for start in range(0, t, tokens_per_step):  # the first step with one, then execution order within it
        z = start + tokens_per_step
        for li, h in enumerate(hidden):
            bad = first_nonfinite(h[start:z])
            if bad is not None:
                nonfinite = {"where": "hidden_states", "layer": _layer_name(li), "position": start + bad[0],
                             "index": bad[1]}
                break
        if nonfinite is None and (bad := first_nonfinite(cand_logits[start:z])) is not None:
            nonfinite = {"where": "logits", "layer": None, "position": start + bad[0], "index": bad[1]}
        if nonfinite is not None:
            break
    stats = profile.compare(golden.logits[0], cand_logits)
    layers = [(_layer_name(li), nmse(golden.hidden_states[li, 0], got)) for li, got in enumerate(hidden)]
    experts = None if probe is None else {_layer_name(i + 1): [r.as_dict() for r in rows]
                                          for i, rows in probe.layers.items()}
    result = PhaseResult(name, layerwise, stats, layers, nonfinite, tap.results() if tap else None, None,
                         candidate_logits=cand_logits, forced=forced, experts=experts)
    result.breaches = evaluate(profile, name, stats.summary(), layers)
    if nonfinite is not None:
        result.breaches.insert(0, Breach(name, "nonfinite", None, None, "", _where_nonfinite(nonfinite)))
    result.localization = _localize(result, profile)
    return result


def _rank(v) -> float:
    """An error for ranking: a non-finite one (None in the report) ranks highest."""
    return math.inf if v is None else v


def _layer_name(index: int) -> str:
    return "embed" if index == 0 else f"layer {index - 1}"


def _where_nonfinite(nf: dict) -> str:
    at = f"position {nf['position']}, index {nf['index']}"
    return f"{nf['layer']} output, {at}" if nf["where"] == "hidden_states" else f"logits, {at}"


#: fewer routed experts than this in a layer make no median to stand out from
OUTLIER_PEERS = 4


def _outlier(experts: dict[str, list[dict]], factor: float) -> dict | None:
    """The routed expert whose NMSE is the most times its own layer's median (over the layer's experts with a
    finite error, at least :data:`OUTLIER_PEERS` of them), when that is at least ``factor``; None if none is.
    Each layer is its own baseline, so a quantization's error common to every expert (or one layer's larger share)
    does not stand out, and one broken expert does even where the run fails for other reasons. Ties: the lower
    layer, then the lower expert id."""
    import statistics

    best = None
    for order, (layer, rows) in enumerate(experts.items()):
        finite = [r["nmse"] for r in rows if r["nmse"] is not None and math.isfinite(r["nmse"])]
        if len(finite) < OUTLIER_PEERS:
            continue
        median = statistics.median(finite)
        for r in rows:
            v = _rank(r["nmse"])
            ratio = math.inf if median == 0 and v > 0 else (v / median if median > 0 else 0.0)
            if ratio >= factor and (best is None or (ratio, -order, -r["expert"]) > best[0]):
                best = ((ratio, -order, -r["expert"]),
                        {"layer": layer, "expert": r["expert"], "tokens": r["tokens"], "nmse": _num(r["nmse"]),
                         "median": float(median), "ratio": _num(ratio)})
    return None if best is None else best[1]


def _localize(result: PhaseResult, profile: Profile) -> dict | None:
    """First layer over the hidden-state limit (or the head, when only logits break), and the first module,
    in execution order up to it, that adds a significant share of the largest error any module adds."""
    limit = profile.hidden_nmse
    breach_layer: int | None = None  # index into result.layers
    for i, (_, v) in enumerate(result.layers):
        if limit is not None and not (v <= limit):
            breach_layer = i
            break
    breached = bool(result.breaches)
    if breach_layer is None and breached:
        breach_layer = len(result.layers)  # the head: final norm / lm_head
    out = {"breach": breached,
           "layer": None if breach_layer is None else
           (result.layers[breach_layer][0] if breach_layer < len(result.layers) else "head"),
           "layer_nmse": None if breach_layer is None or breach_layer >= len(result.layers) else
           _num(result.layers[breach_layer][1])}
    out["forced_layer"], out["forced_layer_nmse"] = None, None
    if result.forced is not None and limit is not None:  # the first layer that alone adds more than the limit
        hit = next(((n, v) for n, v in result.forced if not (v <= limit)), None)
        if hit is not None:
            out["forced_layer"], out["forced_layer_nmse"] = hit[0], _num(hit[1])
    out["expert"], out["expert_nmse"], out["expert_tokens"] = None, None, None
    named = out["forced_layer"] or out["layer"]
    if result.experts and named in result.experts:  # the localised layer's worst expert (routed experts only)
        worst = max(result.experts[named], key=lambda r: (_rank(r["nmse"]), -r["expert"]))
        out["expert"], out["expert_nmse"], out["expert_tokens"] = worst["expert"], worst["nmse"], worst["tokens"]
    out["outlier"] = _outlier(result.experts or {}, profile.expert_outlier)
    if not result.modules:
        out["module"] = None
        out["note"] = "module-level localisation needs the original weights in --model" if result.modules is None else ""
        return out

    def layer_index(m) -> int:  # position in result.layers terms: embed 0, layer i -> i + 1, head last
        return len(result.layers) if m.layer is None else m.layer + 1

    pool = [m for m in result.modules if breach_layer is None or layer_index(m) <= breach_layer]
    largest = max((m.added for m in pool), default=0.0)
    chosen = None
    if largest > 0:
        chosen = next(m for m in pool if m.added >= profile.min_share * largest)
    out["module"] = None if chosen is None else chosen.path
    if chosen is not None:
        out.update({"module_nmse_in": _num(chosen.nmse_in), "module_nmse_out": _num(chosen.nmse_out),
                    "operator": None})
    return out


@dataclass
class _Run:
    """What a verify runs: the injected candidate and (for localisation) the plain reference, each a
    :class:`~ktconvert.model.executor.LayerMajor` whose weights are resident or streamed within ``budget``."""

    injected: object
    candidate: object  # LayerMajor
    reference: object | None  # LayerMajor, None without the original weights
    budget: int
    default_budget: bool
    streamed: bool
    dtype: object = None  # the candidate's compute dtype (torch)
    kernel: object = None  # the real kernel's runtime when its children keep memory between layers (kt-amx slots)
    floor: int = 0  # the least the streamed reference runs in (its minimum)
    squeezed: tuple = (0, 0)  # the most the reference ran above what the kernel child left it, and what it held then

    def rebudget(self) -> None:
        """The streamed reference's budget less what the kernel children hold now, measured: the plan counted the
        packed experts kt-kernel keeps between layers, the children also keep working buffers sized by the layer
        (never below the reference's minimum, checked up front with the plan's count)."""
        from ktconvert.model.executor import weights_budget

        if self.kernel is None or self.reference is None or not self.streamed:
            return
        held = self.kernel.held_now()
        want = weights_budget(self.budget - held)
        if want < self.floor:  # the reference cannot run in less: the run goes over, and the report says so
            self.squeezed = max(self.squeezed, (self.floor - want, held))
        self.reference.weights.budget = max(self.floor, want)

    def summary(self, peaks: TreePeak) -> dict:
        """How the run held its weights, what it read, and the peak RSS of this process and of its whole process
        tree (kernel children included; :class:`ktconvert.io.procstats.TreePeak` says how each is measured)."""
        providers = [r.weights for r in (self.candidate, self.reference) if r is not None and self.streamed]
        return {"mode": "stream" if self.streamed else "resident", "max_memory": int(self.budget),
                "max_memory_default": self.default_budget,
                "bytes_read": sum(p.stats.bytes_read for p in providers) if providers else None,
                "peak_resident_weights": max(p.stats.peak for p in providers) if providers else None,
                "experts_loaded": sum(p.stats.experts for p in providers) if providers else None,
                **peaks.as_dict()}


def _resident_bytes(release, localize: bool) -> int | None:
    """What the in-memory run holds in float32: the candidate, and the reference when localisation runs (None
    where the release cannot be measured: then the run stays in memory, as it always did)."""
    try:
        return release.float32_bytes() * (2 if localize else 1)
    except InputError:
        return None


def _build_run(release, cfg, compiled, catalog, source, pre_source, options, loaded, prompt_len: int,
               localize: bool, budget: int | None, notes: list[str]) -> _Run:
    """The models of the run. ``budget`` None: half the available memory (as ``golden``), everything resident
    when both float32 models fit it, else streamed within it; a budget given: streamed within it."""
    from ktconvert.golden.stream import DEFAULT_SHARE, default_budget
    from ktconvert.model.executor import CheckpointWeights, InjectedWeights, LayerMajor, max_memory_for
    from ktconvert.model.reference import build_skeleton

    default = budget is None
    if default:
        budget = default_budget()
        need = _resident_bytes(release, localize)
        streamed = need is not None and need > budget
        if streamed:
            notes.append(f"the float32 models need {format_size(need)}, more than the default budget "
                         f"{format_size(budget)} ({DEFAULT_SHARE:.0%} of the available memory): streamed layer by layer")
    else:
        streamed = True
    if options.kernel_runtime is not None:  # streamed: the kernel child loads and frees one layer per part
        options.kernel_runtime.streamed = streamed
    dtype = torch_dtype(options.compute_dtype)
    reference, kept, floor = None, 0, 0
    if localize:
        try:
            if streamed:
                skeleton = build_skeleton(cfg)
                # the kernel child's slot stays allocated between the candidate's layers: the reference's parts
                # run beside it, so they get what the budget leaves
                kept = options.kernel_runtime.kept_between_layers(cfg) if options.kernel_runtime is not None else 0
                provider = CheckpointWeights(release, cfg, budget=budget - kept)
                provider.lora = loaded.deltas if loaded is not None else {}
                if not kept:
                    provider.check_budget(skeleton)
                elif provider.budget < (floor := (need := provider.minimum(skeleton))[0]):
                    from ktconvert.errors import UsageProblem

                    least, where = max_memory_for(need[0]) + kept, need[1]
                    raise UsageProblem(
                        f"--max-memory {format_size(budget)} is below the minimum {format_size(least)} ({least} "
                        f"bytes): the kt-kernel child keeps {format_size(kept)} of packed experts between layers "
                        f"(kt-kernel frees no layer's buffers) and the reference's {where} needs "
                        f"{format_size(need[0])} beside it", fix=f"pass --max-memory {least} or more")
                reference = LayerMajor(skeleton, provider)
            else:
                original = read_safetensors(release)  # the one opened release (the candidate's too, when its own)
                model = build_model(cfg)
                load_weights(model, original)
                if loaded is not None:
                    _add_lora(model, loaded.deltas)
                reference = LayerMajor(model)
        except InputError as exc:
            reference = None
            notes.append(f"module-level localisation skipped: the original weights in --model are unusable ({exc.message})")
    model = build_skeleton(cfg, dtype=dtype) if streamed else build_model(cfg, dtype=dtype)
    if loaded is not None:
        _check_lora_fits(loaded, model.state_dict(), cfg)
        for src in (source, pre_source):
            if src is not None:
                src.apply_lora(loaded.deltas)
    plan = injection_plan(model, compiled, catalog, module_type_resolver(catalog))
    injected = inject(model, plan, source, prefill_weights=pre_source, options=options, catalog=catalog,
                      prompt_len=prompt_len, lazy=streamed)
    provider = None
    if streamed:
        provider = InjectedWeights(source, cfg, injected.switches, budget=budget)
        provider.check_budget(model)
    kernel = options.kernel_runtime if streamed and reference is not None and kept else None
    return _Run(injected, LayerMajor(model, provider), reference, budget, default, streamed, dtype, kernel, floor)


@dataclass
class VerifyReport:
    """Everything a run found; ``passed`` is the verdict, ``breaches`` say which limit broke where."""

    model: dict
    rules: str
    weights: dict
    golden: dict
    profile: Profile
    options: dict
    injection: dict
    phases: list[PhaseResult]
    notes: list[str]
    seconds: float
    policy_breaches: list[Breach] = field(default_factory=list)
    kernel: dict | None = None  # verify --kernel: kernel, method, variant (and agreement) per layer
    run: dict | None = None  # _Run.summary(): resident or streamed, the budget, bytes read, peak RSS
    lora: dict | None = None  # verify --lora: the adapter and how far it moves the logits from the base golden

    @property
    def breaches(self) -> list[Breach]:
        return [b for p in self.phases for b in p.breaches] + self.policy_breaches

    @property
    def passed(self) -> bool:
        return not self.breaches

    def phase(self, name: str) -> PhaseResult:
        return next(p for p in self.phases if p.name == name)

    def as_dict(self) -> dict:
        return {
            "kind": "verify-report",
            "version": 1,
            "verdict": "pass" if self.passed else "fail",
            "model": self.model,
            "rules": self.rules,
            "weights": self.weights,
            "golden": self.golden,
            "profile": self.profile.as_dict(),
            "options": self.options,
            "injection": self.injection,
            "phases": {p.name: p.as_dict() for p in self.phases},
            "breaches": [b.as_dict() for b in self.breaches],
            "notes": list(self.notes),
            "seconds": round(self.seconds, 3),
        } | ({"run": self.run} if self.run is not None else {}) | ({"kernel": self.kernel} if self.kernel is not None else {}) | (
            {"lora": self.lora} if self.lora is not None else {})


def run_verify(model_dir, rules, golden, *, weights=None, prefill_weights=None, profile="auto", options=None,
               catalog=None, backend: str = "auto", localize: bool = True, threads: int | None = None,
               kt_weights=None, lora=None, lora_alpha: float | None = None, max_memory: int | None = None,
               progress=None) -> VerifyReport:
    """Verify ``model_dir`` injected by ``rules`` (a rule file) on ``weights`` against the ``golden`` directory.

    ``weights``: the converted checkpoint (.gguf, safetensors file or directory; default: ``model_dir``'s own
    weights). ``prefill_weights``: what prefill ops read during layer-wise prefill (default: ``weights``).
    ``profile``: a :class:`Profile`, a shipped profile's name, a profile file, or ``"auto"`` (the shipped
    profile listing the experts' ggml type). ``options``: :class:`ktconvert.model.inject.EmulationOptions`.
    ``threads``: torch threads for the run (default: the golden's producer threads, results differ at 1e-7
    between thread counts). ``kt_weights``: a kt-amx directory the kernel's CPU experts read under
    ``options.kernel`` kt-kernel/both (AMXINT8/AMXINT4). ``lora``: a MoE LoRA adapter (any form convert-lora
    reads) applied as ``W + alpha/r * B @ A`` to every weight it adapts, checked against a golden made with
    ``golden --lora`` of the same adapter; the report says how far it moves the logits from the base golden.
    ``max_memory``: bytes the weights may take resident; both models then stream layer by layer from disk
    (:mod:`ktconvert.model.executor`), with the same numbers as in memory. None: half the available memory, the
    whole run in memory when both float32 models fit it. ``progress(phase, layers done, layers, seconds)`` is
    called after each layer.
    Raises :class:`~ktconvert.errors.InputError` for unusable inputs; a numeric
    regression is no error but a report with ``passed == False``.
    """

    began = time.perf_counter()
    options = options or EmulationOptions()
    if kt_weights is not None and options.kernel == "emulate":
        from ktconvert.errors import UsageProblem

        raise UsageProblem("--kt-weights is read by the real kernel only", fix="add --kernel kt-kernel or both")
    if lora is None and lora_alpha is not None:
        from ktconvert.errors import UsageProblem

        raise UsageProblem("--lora-alpha without --lora", fix="add --lora ADAPTER or drop --lora-alpha")
    if options.kernel != "emulate" and options.kernel_runtime is None:  # the real kernel: children per method
        from ktconvert.kernel.verify_op import KernelRuntime

        options.kernel_runtime = KernelRuntime(options.kernel, kt_weights=kt_weights)
        try:
            return run_verify(model_dir, rules, golden, weights=weights, prefill_weights=prefill_weights,
                              profile=profile, options=options, catalog=catalog, backend=backend, localize=localize,
                              threads=threads, lora=lora, lora_alpha=lora_alpha, max_memory=max_memory,
                              progress=progress)
        finally:
            options.kernel_runtime.close()
            options.kernel_runtime = None
    release = open_release(model_dir)  # opened once: config, family, weights and their decoding, handed down
    model_dir = release.path
    if not model_dir.is_dir():
        raise InputError("model directory not found", path=str(model_dir),
                         fix="--model takes the Hugging Face model directory (config.json and its weights)")
    if Path(golden).is_file():  # not a golden directory: a llama.cpp KL-divergence base file
        return _verify_kl_base(release, rules, golden, weights=weights, prefill_weights=prefill_weights,
                               profile=profile, options=options, catalog=catalog, backend=backend, threads=threads,
                               lora=lora, max_memory=max_memory, progress=progress)
    gold = read_golden(golden)
    notes = [f"weights not hashed against the golden: {u}" for u in check_golden_matches(gold, release)]
    # every torch op of the run at the golden's thread count: one thread is also the fastest on these small
    # tensors (a contended machine makes each multi-threaded op wait for its workers)
    threads = threads or int(gold.manifest["producer"].get("threads", 1))
    peaks = TreePeak()  # this process and its kernel children, sampled while the models run
    with peaks, _threads(threads):
        if isinstance(profile, str) and profile != "auto":
            profile = load_profile(profile)
        cfg = release.config
        loaded = check_golden_lora(gold, lora, lora_alpha, cfg, release, weights)
        if loaded is not None:
            notes += [f"LoRA: {w}" for w in loaded.warnings]
            if options.kernel_runtime is not None:  # the kernel runs the expert LoRA itself (its SFT class)
                options.kernel_runtime.lora = loaded
        catalog = catalog or load_catalog()
        compiled = load_rules(rules, catalog, backend, family=cfg.family)
        weights_path = weights if weights is not None else model_dir
        own = weights is None or Path(weights).resolve() == model_dir.resolve()  # the model's own weights
        source = WeightSource(release if own else weights, cfg)
        pre_source = WeightSource(prefill_weights, cfg) if prefill_weights is not None else None
        profile = choose_profile(profile, options, source, cfg)
        prompt_len = int(gold.input_ids.shape[1])
        run = _build_run(release, cfg, compiled, catalog, source, pre_source, options, loaded,
                         prompt_len, localize, max_memory, notes)
        injected = run.injected
        phases = _phases([("prefill", injected.layerwise(prompt_len), prompt_len), ("decode", False, 1)], run, gold,
                         profile, progress)
    report = VerifyReport(
        model={"dir": str(model_dir), "family": cfg.family, "config_sha256": gold.manifest["model"]["config_sha256"]},
        rules=str(rules),
        weights={"path": str(weights_path), "container": source.container,
                 "prefill_path": None if pre_source is None else str(prefill_weights),
                 "expert_types": {str(k): v for k, v in source.expert_types().items()}},
        golden={"dir": str(gold.path), "name": gold.manifest["name"], "positions": prompt_len},
        profile=profile,
        options=options.as_dict() | {"threads": threads},
        injection=injection_summary(injected, prompt_len),
        phases=phases,
        notes=notes,
        seconds=0.0,
    )
    for p in phases:
        loc = p.localization
        if loc and loc.get("module"):
            loc["operator"] = _operator_of(injected, loc["module"])
    finish_report(report, run, options, peaks)
    if loaded is not None:
        report.lora = _lora_effect(loaded, lora, gold, phases, profile)
        if report.lora["finding"]:
            report.notes.append(f"LoRA: {report.lora['finding']}")
    report.seconds = time.perf_counter() - began
    return report


def _verify_kl_base(release, rules, base_path, *, weights, prefill_weights, profile, options, catalog, backend,
                    threads, lora, max_memory, progress) -> VerifyReport:
    """:func:`run_verify` against a llama.cpp KL-divergence base file (:mod:`ktconvert.verify.klbase`): each chunk
    from a fresh cache, prefill and decode, KL and top-1/top-k at its scored positions; no hidden states, so no
    per-layer NMSE or localisation (a note says so)."""
    from ktconvert.verify import klbase

    began = time.perf_counter()
    model_dir, cfg = release.path, release.config
    base, bos = klbase.load_base(model_dir, base_path, int(cfg.vocab_size), lora)
    extra = float(klbase.allowance(base).max())
    notes = klbase.notes(base, extra)
    threads = threads or 1
    peaks = TreePeak()
    with peaks, _threads(threads):
        if isinstance(profile, str) and profile != "auto":
            profile = load_profile(profile)
        catalog = catalog or load_catalog()
        compiled = load_rules(rules, catalog, backend, family=cfg.family)
        source = WeightSource(weights if weights is not None else release, cfg)
        pre_source = WeightSource(prefill_weights, cfg) if prefill_weights is not None else None
        profile = choose_profile(profile, options, source, cfg)
        judged = klbase.judged_profile(profile, extra)
        run = _build_run(release, cfg, compiled, catalog, source, pre_source, options, None, base.n_ctx,
                         False, max_memory, notes)
        phases = []
        for name, layerwise, step in (("prefill", run.injected.layerwise(base.n_ctx), None), ("decode", False, 1)):
            stats, nonfinite = klbase.phase_stats(name, run, base, bos, layerwise, step, profile, progress)
            phases.append(PhaseResult(name, layerwise, stats, [], nonfinite, None, None,
                                      klbase.judge(name, base, stats, nonfinite, judged)))
    report = VerifyReport(
        model={"dir": str(model_dir), "family": cfg.family, "config_sha256": release.config_sha256},
        rules=str(rules),
        weights={"path": str(weights if weights is not None else model_dir), "container": source.container,
                 "prefill_path": None if pre_source is None else str(prefill_weights),
                 "expert_types": {str(k): v for k, v in source.expert_types().items()}},
        golden=klbase.golden_record(base, bos, extra), profile=judged, options=options.as_dict() | {"threads": threads},
        injection=injection_summary(run.injected, base.n_ctx), phases=phases, notes=notes, seconds=0.0)
    finish_report(report, run, options, peaks)
    report.seconds = time.perf_counter() - began
    return report


def choose_profile(profile, options, source, cfg) -> Profile:
    """The profile a run is held to: ``profile`` (a :class:`Profile`, or ``"auto"``: a kt-amx directory's method's,
    else the one for the experts' least precise ggml type) with ``cfg``'s family overrides applied."""
    if profile == "auto" and options.kernel_runtime is not None and options.kernel_runtime.auto_profile(cfg):
        profile = load_profile(options.kernel_runtime.auto_profile(cfg))  # a kt-amx dir: its method's profile
    if profile == "auto":
        profile = auto_profile({t for layer in source.expert_types().values() for t in layer.values()})
    return profile.for_family(cfg.family)


def finish_report(report: VerifyReport, run: _Run, options, peaks: TreePeak) -> None:
    """What every report adds after its phases: operators the profile refuses unemulated (its policy ``fail``), the
    kernel's summary, how the run held its weights, and a note when their peak went over the budget."""
    if report.profile.not_emulated_policy == "fail":
        for u in run.injected.uses:
            if not u.emulated:
                report.policy_breaches.append(Breach("injection", "not_emulated", None, None, "", f"{u.operator} "
                                                     f"{u.op or ''} on {len(u.modules)} module(s)".strip()))
    if options.kernel_runtime is not None:
        report.kernel = options.kernel_runtime.summary()
    report.run = run.summary(peaks)
    over, held = run.squeezed
    if over:
        report.notes.append(f"the kt-kernel child held {format_size(held)}, more than the plan counted: the reference "
                            f"ran at its minimum, {format_size(over)} beyond what --max-memory {format_size(run.budget)} "
                            f"left it (see the run's peak_rss_tree)")
    peak = report.run["peak_resident_weights"]
    if peak is not None and peak > run.budget:
        report.notes.append(f"peak {format_size(peak)} of weights resident is over the budget "
                            f"{format_size(run.budget)}")


def injection_summary(injected, prompt_len: int) -> dict:
    """The report's ``injection``: the model operator, layer-wise prefill for a prompt this long, each operator use."""
    return {"model_operator": injected.model_operator,
            "layerwise_prefill_threshold": injected.layerwise_threshold,
            "layerwise_prefill": injected.layerwise(prompt_len),
            "operators": [u.as_dict() for u in injected.uses],
            "not_emulated": [u.as_dict() for u in injected.uses if not u.emulated]}


def _describe(rec: dict | None) -> str:
    if rec is None:
        return "no adapter"
    return f"adapter sha256 {rec['sha256'][:12]}… ({rec['form']}, r {rec['rank']}, alpha {rec['alpha']:g})"


def merged_lora(weights) -> dict | None:
    """The adapter ``quantize --lora`` merged into ``weights``, as its ``manifest.json`` records it, else None."""
    if weights is None:
        return None
    p = Path(weights)
    m = (p if p.is_dir() else p.parent) / "manifest.json"
    if not m.exists():
        return None
    try:
        data = read_json(m, "manifest.json")
    except InputError:  # not ktconvert's readable manifest: nothing says an adapter was merged
        return None
    return data.get("lora") if data.get("kind") == "ktconvert-manifest" else None


def check_golden_lora(golden, lora, lora_alpha, cfg, model_dir, weights=None):
    """The adapter (loaded and checked) when it is the one the golden was made with, else :class:`InputError` naming
    both: a golden with an adapter used without it, or the reverse, or another adapter (sha256 of its values) or
    alpha, would compare the wrong models. Weights that ``quantize --lora`` merged the golden's adapter files into
    (their manifest.json says so) pass without ``--lora``; with ``--lora`` they are refused (applied twice)."""
    from ktconvert.convert.lora_merge import load_lora
    from ktconvert.formats.release import open_release

    want = golden.manifest.get("lora")
    name = golden.manifest["name"]
    baked = merged_lora(weights)
    if baked is not None and lora is not None:
        raise InputError(f"--weights already have an adapter merged (quantize --lora {baked.get('path')}); --lora "
                         "would apply one again", path=str(weights), fix="drop --lora, or pass the base conversion")
    if lora is None:
        if want is None:
            if baked is not None:
                raise InputError(f"--weights have an adapter merged (quantize --lora {baked.get('path')}) but golden "
                                 f"{name!r} was made without one", path=str(weights),
                                 fix="make the golden with ktconvert golden MODEL OUT --lora ADAPTER")
            return None
        if baked is not None:
            same = ({f["sha256"] for f in baked.get("files", {}).values()} == set(want["files"].values())
                    and float(baked.get("scale", 0)) == float(want["scale"]))
            if same:
                return None
            raise InputError(f"--weights have adapter files {sorted(baked.get('files', {}))} (scale "
                             f"{baked.get('scale')}) merged, not the golden {name!r}'s {_describe(want)}",
                             path=str(weights), fix="pass the golden made with the adapter these weights merged")
        raise InputError(f"golden {name!r} was made with LoRA {_describe(want)}; verify ran without --lora",
                         path=str(golden.path), fix="pass --lora ADAPTER, or a golden made without an adapter")
    loaded = load_lora(lora, lora_alpha=lora_alpha, dims=open_release(model_dir).dims, model_type=cfg.family)
    got = loaded.record
    if want is None:
        raise InputError(f"--lora {_describe(got)} but golden {name!r} was made without an adapter",
                         path=str(golden.path), fix="make the golden with ktconvert golden MODEL OUT --lora ADAPTER")
    if got["sha256"] != want["sha256"] or float(got["scale"]) != float(want["scale"]):
        raise InputError(f"--lora {_describe(got)} is not the golden's {_describe(want)}", path=str(lora),
                         fix="pass the adapter the golden was made with, or make a golden with this one")
    return loaded


def _check_lora_fits(loaded, state: dict, cfg) -> None:
    """Every weight the adapter adapts exists in the model with B @ A's shape (else the adapter is another model's)."""
    from ktconvert.convert.lora_merge import delta_shapes

    where = str(loaded.adapter.src)
    for n, shape in sorted(delta_shapes(loaded.adapter, loaded.deltas).items()):
        if n not in state:
            raise InputError(f"the adapter adapts {n}, which the {cfg.family} model has not", path=where, where=n,
                             fix="is this the adapter of this model?")
        if tuple(shape) != tuple(state[n].shape):
            raise InputError(f"B @ A is {list(shape)} but {n} is {list(state[n].shape)}", path=where, where=n,
                             fix="this adapter was trained for another model")


def _add_lora(model, deltas: dict[str, tuple]) -> None:
    """The localisation reference with the adapter merged, so modules are compared with what they should compute."""
    import torch

    from ktconvert.formats.lora_delta import lora_delta

    state = model.state_dict()
    with torch.no_grad():
        for n, d in deltas.items():
            state[n].add_(torch.from_numpy(lora_delta(d)).to(state[n].dtype))


def _lora_effect(loaded, lora, gold, phases: list[PhaseResult], profile: Profile) -> dict:
    """How far the adapter moves the logits: the golden's own (merged vs base transformers run) and the candidate's
    against the base golden under the same profile. If that comparison passes, the profile cannot tell the adapter
    from none: "no effect"."""
    rec = loaded.record
    out = {"path": str(lora), **{k: rec[k] for k in ("sha256", "form", "rank", "alpha", "scale")},
           "golden_effect": gold.manifest["lora"]["effect"], "against_base": {}}
    base = gold.tensors.get("base_logits")
    if base is None:
        raise InputError("the golden's manifest records an adapter but it has no base_logits", path=str(gold.path),
                         fix="regenerate it with ktconvert golden MODEL OUT --lora ADAPTER")
    passes = []
    for p in phases:
        stats = profile.compare(base[0], p.candidate_logits).summary()
        broken = evaluate(profile, p.name, stats, [])
        passes.append(not broken)
        out["against_base"][p.name] = {"verdict": "pass" if not broken else "fail",
                                       **{k: _num(stats[k]) for k in ("max_abs_diff", "nmse_max", "kl_mean", "kl_max",
                                                                       "top1_agreement")}}
    eff = out["golden_effect"]["logits_max_abs_diff"]
    out["finding"] = None if not all(passes) else (
        "no effect: the adapter leaves the logits unchanged (max |diff| 0 between the merged and the base golden)"
        if eff == 0 else
        f"no effect: with the adapter the logits stay within profile {profile.name}'s limits of the base golden "
        f"(the adapter moves them by max |diff| {eff:.3g}); this verify cannot tell it from no adapter")
    return out


def _operator_of(injected, path: str) -> str | None:
    for inj in injected.plan:
        if inj.path == path:
            return inj.replace_class
    return None

