"""Apply an optimize-rule file to a reference model, with operators that reproduce upstream's numerics.

The plan comes from :func:`ktconvert.rules.apply.injection_plan`, the engine check-rules uses (the caller builds
it with :func:`ktconvert.model.reference.module_type_resolver`), so a module is
replaced here exactly when upstream's ``inject`` would replace it. What each operator computes is decided by
its ``emulation`` in the operator catalog (see :mod:`ktconvert.model.ops`):

* wrapper operators (``KTransformersExperts``, ``KTransformersLinear``) become a :class:`PhaseSwitch` holding
  the reference op of their ``generate_op`` and, when layer-wise prefill can run, of their ``prefill_op``;
* operators whose numerics are the original module's (attention, rope, norms, MoE blocks, gates, the model
  itself) keep the module;
* everything else a rule leaves ``default`` keeps the module, its parameters dequantized from the weights to
  the compute dtype, as upstream's loader does.

Prefill vs decode follows upstream: ``prefill_op`` runs only when the model operator does layer-wise prefill
(``per_layer_prefill_intput_threshold`` > 0 and the prompt longer than it), and then only for the modules its
``load_layer_to`` switches; otherwise ``generate_op`` serves both phases. The prefill ops may read another
checkpoint than the generate ops (``prefill_weights``): a deployment can run its GPU prefill from the original
checkpoint while the CPU experts read the converted file, and that is where decode-only faults come from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ktconvert.errors import InputError
from ktconvert.model.ops import EXPERT_OPS, FALLBACK, KEEP, LINEAR_OPS, WRAPPERS
from ktconvert.model.ops.experts import (
    CpuExpertsGGML,
    CpuKernelNumerics,
    ExpertsDequant,
    torch_dtype,
)
from ktconvert.model.modules import VOCAB_CHUNK, VocabHead
from ktconvert.model.ops.linear import LinearDequant, VocabLinearDequant
from ktconvert.model.executor import VOCAB_NAMES
from ktconvert.model.ops.source import MissingTensor, WeightSource
from ktconvert.model.ops.switch import PhaseSwitch
from ktconvert.rules.catalog import load_catalog

# upstream constructor default of the K*Model operators' per_layer_prefill_intput_threshold
UPSTREAM_THRESHOLD_DEFAULT = 30000

# which modules of a decoder layer each model operator's load_layer_to switches to prefill mode (the others
# keep their generate op during layer-wise prefill); read from upstream's models.py
LAYERWISE_SWITCHED: dict[str, tuple[str, ...]] = {
    "ktransformers.operators.models.KQwen2MoeModel": (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate", "mlp.experts", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
        "mlp.shared_expert.down_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    ),
    "ktransformers.operators.models.KDeepseekV2Model": (
        "mlp.experts", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
        "mlp.shared_experts.down_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    ),
}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass
class EmulationOptions:
    """Numerics knobs: the compute dtype of GPU-side ops and the model, and the CPU kernel's rounding."""

    compute_dtype: str = "float32"
    cpu_hidden_dtype: str = "bfloat16"  # upstream passes hidden_type = BF16 to the llamafile kernel
    cpu_act_quant: bool = True  # activations converted to the weight type's vec_dot_type, as the kernel does
    kernel: str = "emulate"  # emulate | kt-kernel | both: who computes the CPU experts (ktconvert.kernel)
    kernel_runtime: object = field(default=None, repr=False, compare=False)  # a KernelRuntime when not emulate

    def as_dict(self) -> dict:
        return {"compute_dtype": self.compute_dtype, "cpu_hidden_dtype": self.cpu_hidden_dtype,
                "cpu_act_quant": self.cpu_act_quant} | ({"kernel": self.kernel} if self.kernel != "emulate" else {})


@dataclass
class OperatorUse:
    """One row of what ran: an operator (and op slot) over some modules, emulated or with a stated fallback."""

    operator: str
    slot: str | None
    op: str | None
    emulation: str | None  # the reference numerics that ran
    emulated: bool
    detail: str
    modules: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"operator": self.operator, "slot": self.slot, "op": self.op, "emulation": self.emulation,
                "emulated": self.emulated, "detail": self.detail, "modules": list(self.modules)}


@dataclass
class Injected:
    """The injected model and what the injection decided."""

    model: nn.Module
    plan: list
    model_operator: str | None
    layerwise_threshold: int | None  # None or 0: no layer-wise prefill
    switches: dict[str, PhaseSwitch]
    prefill_paths: frozenset
    uses: list[OperatorUse]

    def layerwise(self, seq_len: int) -> bool:
        """Whether a forward over ``seq_len`` tokens runs layer-wise prefill (upstream's condition)."""
        return bool(self.layerwise_threshold) and self.layerwise_threshold < seq_len

    def set_layerwise(self, on: bool) -> None:
        for path, switch in self.switches.items():
            switch.mode = "prefill" if on and path in self.prefill_paths else "generate"

    @property
    def not_emulated(self) -> list[OperatorUse]:
        return [u for u in self.uses if not u.emulated]


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, module)


def _layer_of(path: str) -> int | None:
    m = _LAYER.match(path)
    return int(m.group(1)) if m else None


class _Uses:
    def __init__(self):
        self.rows: dict[tuple, OperatorUse] = {}

    def add(self, path: str, operator: str, slot, op, emulation, emulated: bool, detail: str) -> None:
        key = (operator, slot, op, emulation, emulated, detail)
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = OperatorUse(operator, slot, op, emulation, emulated, detail)
        row.modules.append(path)


def inject(model: nn.Module, plan: list, weights: WeightSource, *, prefill_weights: WeightSource | None = None,
           options: EmulationOptions | None = None, catalog=None, prompt_len: int | None = None,
           lazy: bool = False) -> Injected:
    """Replace ``model``'s modules as ``plan`` (:func:`ktconvert.rules.apply.injection_plan` of the compiled rules
    over this model) says and load every weight from the sources.

    ``prompt_len``: the longest forward that will run; prefill ops are only built when layer-wise prefill
    can happen for it (upstream loads them only then), so a checkpoint lacking what an unused op would read
    is no error. Missing tensors of used ops are, before anything runs.

    ``lazy``: ``model`` is a skeleton (:func:`~ktconvert.model.reference.build_skeleton`) whose weights a streaming
    provider (:class:`~ktconvert.model.executor.InjectedWeights`) puts in part by part; the wrapper operators are
    built once here (checked and described) and then dropped, and :meth:`PhaseSwitch.load` builds them again when
    their part runs. Nothing else is loaded here.
    """
    options = options or EmulationOptions()
    catalog = catalog or load_catalog()
    torch_dtype(options.compute_dtype)  # an unknown name fails before any work

    model_inj = next((i for i in plan if i.path == "model" and i.operator is not None and i.operator.role == "model"), None)
    model_operator = model_inj.replace_class if model_inj else None
    threshold = None
    if model_inj is not None:
        threshold = int(model_inj.kwargs.get("per_layer_prefill_intput_threshold", UPSTREAM_THRESHOLD_DEFAULT) or 0)
    layerwise_possible = bool(threshold) and (prompt_len is None or threshold < prompt_len)
    switched = LAYERWISE_SWITCHED.get(model_operator or "")

    def switched_in_prefill(path: str) -> bool:
        m = _LAYER.match(path)
        return bool(m) and (switched is None or m.group(2) in switched)

    uses = _Uses()
    switches: dict[str, PhaseSwitch] = {}
    prefill_paths = set()
    replaced: list[str] = []
    built: dict[tuple, nn.Module] = {}

    def build_op(inj, kind: str, slot: str, op_name: str | None, source: WeightSource):
        if op_name is None:
            return None
        spec = catalog.ops.get(op_name, {})
        emulation = spec.get("emulation")
        detail = ""
        emulated = emulation in (EXPERT_OPS if kind == "experts" else LINEAR_OPS)
        if kind == "experts" and emulation == "cpu-experts-ggml":
            backend = inj.kwargs.get("backend", "llamafile")
            if backend != "llamafile":
                emulated, detail = False, f"backend {backend} (AMX kernels round differently); ran the llamafile numerics"
        if not emulated and not detail:
            detail = (f"emulation {emulation} is not implemented" if emulation else "the catalog names no emulation for this op")
            detail += f"; ran {FALLBACK[kind]} ({options.compute_dtype})"
        run = emulation if (emulated or detail.startswith("backend")) else FALLBACK[kind]
        key = (inj.path, run, id(source))
        op = built.get(key)
        if op is None:
            build = _op_builder(inj, kind, run, source, options, lazy)
            op = build()
            if lazy:  # built once to check and describe it, then per part (InjectedWeights)
                op = _Described(op, build)
                # the source keeps nothing this build decoded (a release's FP8 attention and dense MLP of every
                # layer, 3 GB of float32 for a DeepSeek-V3-shaped model) until the part runs and reads it again
                layer = _layer_of(inj.path)
                part = layer if layer is not None else VOCAB_NAMES.get(f"{inj.path}.weight")
                if part is not None:
                    source.forget(part)
            built[key] = op
        if getattr(op, "emulation", None) == "kt-kernel":
            run, emulated, detail = "kt-kernel", True, ""
        unknown = sorted(set(getattr(op, "unknown_act", ())))
        if unknown and emulated:
            emulated = False
            detail = f"the kernel's activation type for {', '.join(unknown)} weights is not known here; ran unrounded"
        desc = op.describe()
        if source is not weights:
            desc += f"; reads {source.path}"
        uses.add(inj.path, inj.replace_class, slot, op_name, run, emulated, f"{desc}{'; ' + detail if detail else ''}")
        return op

    for inj in plan:
        if inj.operator is None or inj.path == "":
            continue
        emulation = inj.operator.emulation
        if emulation in WRAPPERS:
            kind = WRAPPERS[emulation]
            gen = build_op(inj, kind, "generate_op", inj.op("generate_op"), weights)
            pre = None
            prefill_name = inj.op("prefill_op")
            if layerwise_possible and switched_in_prefill(inj.path):
                pre = build_op(inj, kind, "prefill_op", prefill_name, prefill_weights or weights)
                prefill_paths.add(inj.path)
            switch = PhaseSwitch(inj.path, {"generate": gen, "prefill": pre},
                                 {"generate": inj.op("generate_op"), "prefill": prefill_name})
            if lazy:
                switch.builders = {mode: None if op is None else op.build for mode, op in (("generate", gen),
                                                                                             ("prefill", pre))}
                switch.described = {"generate": gen, "prefill": pre}
                switch.release()
            _set_module(model, inj.path, switch)
            switches[inj.path] = switch
            replaced.append(inj.path)
        elif emulation in KEEP:
            uses.add(inj.path, inj.replace_class, None, None, emulation, True, "the reference module's numerics")
        else:
            why = (f"emulation {emulation} is not implemented" if emulation
                   else "the catalog names no emulation for this operator")
            uses.add(inj.path, inj.replace_class, None, None, None, False, f"{why}; ran the reference module")

    if not lazy:
        _load_defaults(model, weights)
    return Injected(model, plan, model_operator, threshold, switches, frozenset(prefill_paths), list(uses.rows.values()))


def _op_builder(inj, kind: str, run: str, source: WeightSource, options: EmulationOptions, lazy: bool = False):
    """A function building ``inj``'s op that runs ``run`` on ``source`` (called once, or per part when lazy)."""
    def build():
        if kind == "experts":
            layer = _layer_of(inj.path)
            if layer is None:
                raise InputError(f"an experts operator on {inj.path}, which is not in a decoder layer",
                                 where=inj.path, fix="match experts modules only (…\\.mlp\\.experts$)")
            rt = options.kernel_runtime
            own = run == "cpu-experts-ggml" and rt is not None and rt.reads_own_files
            blocks = source.expert_shapes(layer) if own else source.expert_blocks(layer)
            if run == "cpu-experts-ggml":
                op = CpuExpertsGGML(blocks, CpuKernelNumerics(options.cpu_hidden_dtype, options.cpu_act_quant))
                if options.kernel_runtime is not None:  # the real kernel, in its child process
                    op = options.kernel_runtime.wrap(op, source, blocks, source.cfg, inj.path)
                return op
            return ExpertsDequant(blocks, options.compute_dtype)
        lin = inj.module
        w_name = f"{inj.path}.weight"
        bias = None
        if getattr(lin, "bias", None) is not None:
            bias = torch.from_numpy(source.tensor(f"{inj.path}.bias", tuple(lin.bias.shape)))
        if isinstance(lin, VocabHead):  # lm_head: computed over vocabulary chunks, streamed by rows
            shape = tuple(lin.weight.shape)
            by_rows = lazy and source.vocab_name(w_name) is not None
            weight = None if by_rows else torch.from_numpy(source.tensor(w_name, shape))
            rows = (lambda a, z: source.rows(w_name, None, (a, z))) if by_rows else None
            return VocabLinearDequant(weight, bias, options.compute_dtype, source.stored_type(w_name),
                                      chunk=VOCAB_CHUNK, shape=shape, rows=rows)
        weight = source.tensor(w_name, tuple(lin.weight.shape))
        return LinearDequant(torch.from_numpy(weight), bias, options.compute_dtype, source.stored_type(w_name))
    return build


class _Described:
    """What a lazy injection keeps of an op it built once: its description, activation types and its builder."""

    def __init__(self, op, build):
        self.build = build
        self.emulation = getattr(op, "emulation", None)
        self.unknown_act = tuple(getattr(op, "unknown_act", ()))
        self.text = op.describe()
        self.resident_bytes = op.resident_bytes() if hasattr(op, "resident_bytes") else 0

    def describe(self) -> str:
        return self.text


def _load_defaults(model: nn.Module, weights: WeightSource) -> None:
    """Every parameter and buffer left in the tree, dequantized from ``weights`` (upstream's generic loader)."""
    state = model.state_dict()
    missing: list[str] = []
    loaded: dict[str, torch.Tensor] = {}
    for name, ref in state.items():
        try:
            loaded[name] = torch.from_numpy(weights.tensor(name, tuple(ref.shape)))
        except MissingTensor as exc:
            stored = exc.names[0]
            missing.append(name if stored == name else f"{stored} ({name})")
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise InputError(f"{len(missing)} tensor(s) the model needs are missing: {', '.join(missing[:3])}{more}",
                         path=weights.path, fix="convert the whole model, or pass the weights it was converted to")
    with torch.no_grad():
        for name, ref in state.items():
            ref.copy_(loaded[name])  # casts to the parameter's dtype (the compute dtype; buffers keep theirs)
