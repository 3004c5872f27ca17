"""Runs gate cases: make the tiny model, convert it, verify the conversion; one result per case. A case naming a
model directory and its candidate on disk (:mod:`ktconvert.gate.suite`) skips the first two steps.

Cases that share a family and a conversion share one converted checkpoint (converting is the slow part), so
work is grouped by (family, conversion) and ``jobs`` processes take whole groups. With ``executor="ray"`` each
group is a Ray task that makes its own tiny model and conversion in a temporary directory of the node it runs on
(no shared scratch space needed) and returns its case results; the driver orders them and writes the JUnit.
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ktconvert.cluster import check_executor, check_fits, connect, run_tasks
from ktconvert.convert import convert
from ktconvert.convert.worker import ignore_interrupts, interrupts_deferred, worker_context
from ktconvert.errors import KtError
from ktconvert.gate.suite import Case, Suite
from ktconvert.model.tiny import write_tiny_model
from ktconvert.model.tiny_lora import write_tiny_lora
from ktconvert.verify import EmulationOptions, run_verify

KT_AMX_PARTS = 2  # threadpool parts of a kt-amx case (the launch default, --kt-threadpool-count 2)

SUMMARY_METRICS = ("max_abs_diff", "nmse_max", "kl_mean", "kl_max", "top1_agreement", "top1_agreement_raw", "top1_near_ties")


@dataclass
class CaseResult:
    case: Case
    passed: bool
    seconds: float
    breaches: list = field(default_factory=list)  # Breach.as_dict() rows
    error: str | None = None  # the case could not run (bad input, missing dependency, internal error)
    summary: dict = field(default_factory=dict)  # {phase: {metric: value}} for the report table
    localization: dict | None = None
    profile: str = ""

    def as_dict(self) -> dict:
        return {"name": self.case.name, "family": self.case.family, "rules": self.case.rules.name,
                "conversion": self.case.conversion, "tolerance": self.profile or self.case.tolerance,
                "verdict": "error" if self.error else ("pass" if self.passed else "fail"), "seconds": round(self.seconds, 3),
                "breaches": self.breaches, "error": self.error, "summary": self.summary, "localization": self.localization}


@dataclass
class GateResult:
    suite: Path
    cases: list[CaseResult]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases)

    def as_dict(self) -> dict:
        return {"kind": "gate-report", "version": 1, "suite": str(self.suite), "verdict": "pass" if self.passed else "fail",
                "seconds": round(self.seconds, 3),
                "counts": {"cases": len(self.cases), "passed": sum(c.passed for c in self.cases),
                           "failed": sum(not c.passed and not c.error for c in self.cases),
                           "errors": sum(bool(c.error) for c in self.cases)},
                "cases": [c.as_dict() for c in self.cases]}


def run_suite(suite: Suite, select: str | None = None, jobs: int = 1, workdir: str | Path | None = None,
              progress: Callable[[CaseResult], None] | None = None, executor: str = "local",
              ray_address: str | None = None) -> GateResult:
    """Run the selected cases (``select`` as ``-k``); ``progress`` is called as each case finishes.

    ``executor="ray"``: each (family, conversion) group is a Ray task, ``jobs`` at a time, on the cluster at
    ``ray_address`` (:mod:`ktconvert.cluster`); the suite's rule files and goldens are read by path, so they (and
    ktconvert) must be at the same paths on every node."""
    check_executor(executor, ray_address)
    cases = suite.select(select)
    groups: dict[tuple, list[Case]] = {}
    for case in cases:
        groups.setdefault((case.tiny, case.conversion), []).append(case)
    began = time.perf_counter()
    results: dict[str, CaseResult] = {}
    if executor == "ray":
        ray = connect(ray_address)
        check_fits(ray, None, "a gate case")

        def done(group_results: list[CaseResult]) -> None:
            for r in group_results:
                results[r.case.name] = r
                if progress:
                    progress(r)

        run_tasks(ray, run_group_alone, groups.values(), limit=jobs, on_done=done, name="ktconvert-gate-case")
        return GateResult(suite.path, [results[c.name] for c in cases], time.perf_counter() - began)
    with tempfile.TemporaryDirectory(prefix="ktconvert-gate-", dir=workdir) as tmp:
        # The tiny models are made here, once, before any worker starts (workers would race on them); a model
        # that cannot be made fails its cases with the reason, and its groups never run.
        with_lora = {c.tiny for c in cases if c.lora}
        for case in {c.tiny: c for c in cases if c.model is None}.values():
            try:
                _tiny_model(case, tmp, lora=case.tiny in with_lora)
            except Exception as exc:
                for key in [k for k in groups if k[0] == case.tiny]:
                    for c in groups.pop(key):
                        results[c.name] = CaseResult(c, False, 0.0, error=_one_line(exc))
                        if progress:
                            progress(results[c.name])
        if jobs <= 1 or len(groups) <= 1:
            for group in groups.values():
                for r in run_group(group, tmp):
                    results[r.case.name] = r
                    if progress:
                        progress(r)
        else:
            with ProcessPoolExecutor(max_workers=jobs, mp_context=worker_context(), initializer=ignore_interrupts) as pool:
                with interrupts_deferred():  # not inside submit (see interrupts_deferred)
                    futures = [pool.submit(run_group, group, tmp) for group in groups.values()]
                for fut in as_completed(futures):
                    for r in fut.result():
                        results[r.case.name] = r
                        if progress:
                            progress(r)
    return GateResult(suite.path, [results[c.name] for c in cases], time.perf_counter() - began)


def run_group_alone(cases: list[Case]) -> list[CaseResult]:
    """:func:`run_group` with its own tiny model in a temporary directory of this host (a Ray task's body)."""
    with tempfile.TemporaryDirectory(prefix="ktconvert-gate-") as tmp:
        try:
            if cases[0].model is None:
                _tiny_model(cases[0], tmp, lora=any(c.lora for c in cases))
        except Exception as exc:
            return [CaseResult(c, False, 0.0, error=_one_line(exc)) for c in cases]
        return run_group(cases, tmp)


def run_group(cases: list[Case], workdir: str) -> list[CaseResult]:
    """Convert once for the group, then verify each case against it (in this process). A model case (a group of
    its own) verifies its candidate as it is on disk."""

    first = cases[0]
    if first.model is not None:
        return [verify_case(c, c.model, c.candidate) for c in cases]
    began = time.perf_counter()
    model_dir = _tiny_model_dir(first.tiny, workdir)
    try:
        weights = convert_case(first, model_dir, workdir)
    except Exception as exc:  # the whole group cannot run: every case in it reports why
        message = _one_line(exc)
        spent = time.perf_counter() - began
        return [CaseResult(c, False, spent / len(cases), error=message) for c in cases]
    convert_share = (time.perf_counter() - began) / len(cases)
    adapter = _adapter_dir(first.tiny, workdir)
    return [verify_case(c, model_dir, weights, convert_share, adapter if c.lora == "verify" else None) for c in cases]


def convert_case(case: Case, model_dir: Path, workdir: str | Path) -> Path:
    """The case's conversion of ``model_dir`` (under ``workdir``): the GGUF, or the kt-amx directory."""
    out = Path(workdir) / "converted" / f"{case.tiny}-{case.conversion.replace(':', '-').replace('/', '_')}"
    if case.to == "kt-amx":
        result = convert(model_dir, out, type=case.type, format="kt-amx", threadpool_count=KT_AMX_PARTS, force=True)
    else:  # the suite's tolerances were measured with llama.cpp's fallbacks (DeepSeek's MLA rows of 64 and 128)
        lora = _adapter_dir(case.tiny, workdir) if case.lora == "quantize" else None
        result = convert(model_dir, out, case.recipe, type=case.type, force=True, allow_fallback=True, lora=lora)
    return _weights_path(result.out)


def verify_run(case: Case, model_dir: Path, weights: Path, lora: Path | None = None, profile=None):
    """The case's verify report (``profile``: another profile than the case's, e.g. one that only measures)."""
    # a kt-amx directory holds the experts only: the rest comes from the model, as in a kt-kernel launch
    where = {"kt_weights": weights} if case.to == "kt-amx" else {"weights": weights}
    return run_verify(model_dir, case.rules, case.golden, profile=profile or case.tolerance,
                      options=EmulationOptions(kernel=case.kernel), lora=lora, max_memory=case.max_memory, **where)


def verify_case(case: Case, model_dir: Path, weights: Path, extra_seconds: float = 0.0,
                lora: Path | None = None) -> CaseResult:
    began = time.perf_counter()
    try:
        report = verify_run(case, model_dir, weights, lora)
    except Exception as exc:
        return CaseResult(case, False, time.perf_counter() - began + extra_seconds, error=_one_line(exc))
    summary = {}
    for phase in report.phases:
        stats = phase.as_dict()["logits"]
        summary[phase.name] = {k: stats.get(k) for k in SUMMARY_METRICS if k in stats}
    loc = next((p.localization for p in report.phases if p.localization and not report.passed), None)
    return CaseResult(case, report.passed, time.perf_counter() - began + extra_seconds,
                      breaches=[b.as_dict() for b in report.breaches], summary=summary, localization=loc,
                      profile=report.profile.name)


def _tiny_model_dir(tiny: str, workdir: str) -> Path:
    return Path(workdir) / "models" / tiny


def _adapter_dir(tiny: str, workdir: str) -> Path:
    return Path(workdir) / "adapters" / tiny


def _tiny_model(case: Case, workdir: str, lora: bool = False) -> None:
    """The case's tiny model, and with ``lora`` the family's tiny adapter beside it (lora cases read it)."""
    write_tiny_model(case.family, _tiny_model_dir(case.tiny, workdir), variant=case.variant)
    if lora:
        write_tiny_lora(case.family, _adapter_dir(case.tiny, workdir))


def _weights_path(out: Path) -> Path:
    gguf = out / "model.gguf"
    return gguf if gguf.is_file() else out


def _one_line(exc: Exception) -> str:
    if isinstance(exc, KtError):
        return exc.one_line()
    return f"internal error: {type(exc).__name__}: {exc}"
