"""The main job end to end on the embedded default: what ``ktconvert demo`` runs and reports.

Makes the deterministic tiny qwen3_moe model, checks the shipped rule file against its module tree, converts it
to Q4_K_M, checks the rules against the converted weights, and verifies the injected model against the
shipped golden. Each step returns a few human lines; nothing here prints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ktconvert.families import DEFAULT_FAMILY
from ktconvert.convert import convert
from ktconvert.formats import open_checkpoint
from ktconvert.golden.paths import golden_root, load_tiny_hashes
from ktconvert.io.resources import rules_dir
from ktconvert.model.tiny import file_hashes, write_tiny_model
from ktconvert.rules import lint
from ktconvert.rules.catalog import load_catalog
from ktconvert.verify import run_verify


@dataclass
class Step:
    name: str
    ok: bool
    seconds: float
    lines: list[str] = field(default_factory=list)


@dataclass
class DemoResult:
    family: str
    workdir: Path
    steps: list[Step] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)


def run_demo(workdir: str | Path, family: str = DEFAULT_FAMILY, recipe: str = "Q4_K_M", on_step=None) -> DemoResult:
    """Run every step in ``workdir`` (created; the caller owns and removes it). A failed step stops the run."""
    workdir = Path(workdir)
    result = DemoResult(family, workdir)
    steps = (_make_model, _check_rules, _quantize, _check_weights, _verify)
    state: dict = {"family": family, "recipe": recipe, "workdir": workdir}
    for fn in steps:
        began = time.perf_counter()
        step = fn(state)
        step.seconds = time.perf_counter() - began
        result.steps.append(step)
        if on_step:
            on_step(step)
        if not step.ok:
            break
    return result


def _rules_file(family: str) -> Path:

    return rules_dir() / "optimize" / f"{family}.yaml"


def _make_model(state) -> Step:

    model = state["workdir"] / "model"
    write_tiny_model(state["family"], model)
    recorded = load_tiny_hashes()[state["family"]]
    actual = file_hashes(model, sorted(recorded))
    same = actual == recorded
    size = sum(p.stat().st_size for p in model.iterdir())
    state["model"] = model
    lines = [f"{len(recorded)} files, {size / 1e6:.1f} MB, frozen-stream RNG weights",
             "sha256 of every file matches golden/tiny-models.yaml" if same else
             "sha256 DIFFERS from golden/tiny-models.yaml: the weights depend on this environment"]
    return Step(f"make the tiny {state['family']} model", same, 0.0, lines)


def _check_rules(state) -> Step:

    rules = _rules_file(state["family"])
    report = lint.check_paths([rules], lint.Options(model=str(state["model"]), explain=True), load_catalog())
    errors, warnings = report.count("error"), report.count("warning")
    plan = report.files[0].plan or []
    experts = [r for r in plan if r["ops"].get("generate_op", "").startswith("KExperts")]
    ops = sorted({f"{r['operator']}" for r in plan if r["operator"] != "default"})
    state["rules"] = rules
    lines = [f"{rules.name}: {report.files[0].rules} rules, {errors} errors, {warnings} warnings ({len(plan)} modules)",
             f"experts of {len(experts)} layers run {experts[0]['ops']['generate_op']} on {experts[0]['generate_device']}" if experts else "no experts rule",
             "operators: " + ", ".join(ops)]
    return Step("check its optimize rules", errors == 0, 0.0, lines)


def _quantize(state) -> Step:

    out = state["workdir"] / "converted"
    run = convert(state["model"], out, state["recipe"])
    gguf = out / "model.gguf"
    state["weights"] = gguf

    ck = open_checkpoint(gguf)
    hist: dict[str, int] = {}
    for info in ck.values():
        hist[info.dtype] = hist.get(info.dtype, 0) + 1
    lines = [f"{gguf.name}: {len(ck)} tensors, {gguf.stat().st_size / 1e6:.1f} MB (from {run.in_bytes / 1e6:.1f} MB) in kernel order",
             "types: " + ", ".join(f"{k} x{v}" for k, v in sorted(hist.items(), key=lambda kv: -kv[1]))]
    return Step(f"quantize it to {state['recipe']}", True, 0.0, lines)


def _check_weights(state) -> Step:

    report = lint.check_paths([state["rules"]], lint.Options(model=str(state["model"]), weights=str(state["weights"])),
                              load_catalog())
    errors = [f for f in report.findings if f.severity == "error"]
    lines = ["every tensor the injected operators load is present, in a type they can run" if not errors else
             f"{errors[0].id} {errors[0].message}"]
    return Step("check the rules against the converted weights", not errors, 0.0, lines)


def _verify(state) -> Step:

    report = run_verify(state["model"], state["rules"], golden_root() / state["family"], weights=state["weights"],
                        profile=state["recipe"].lower())
    lines = []
    for phase in report.phases:
        s = phase.as_dict()["logits"]
        lines.append(f"{phase.name}: {s['positions']} positions, KL mean {s['kl_mean']:.2e}, max |diff| {s['max_abs_diff']:.3f}, "
                     f"top-1 agreement {s['top1_agreement']:.0%} of {s['top1_positions_judged']} positions clear of "
                     f"near-ties ({s['top1_agreement_raw']:.0%} of all)")
    lines.append(f"within tolerance profile {report.profile.name}" if report.passed else
                 "OUT of tolerance: " + "; ".join(b.line() for b in report.breaches[:3]))
    return Step("verify it against the Hugging Face golden", report.passed, 0.0, lines)
