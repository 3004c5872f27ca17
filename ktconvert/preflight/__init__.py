"""``preflight``: a kt-kernel + SGLang launch checked against the model, the weights and the adapter, from
headers only, before minutes of model loading find the problem (or never do).

``preflight(launch, rules=None) -> PreflightReport``; build a :class:`Launch` from flags or with
:func:`parse_command` from a pasted command line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ktconvert.diagnostics import ERROR, WARNING, Diagnostic
from ktconvert.preflight.checks import run_checks
from ktconvert.preflight.launch import Launch, parse_command


@dataclass
class PreflightReport:
    launch: Launch
    findings: list[Diagnostic]
    seconds: float

    @property
    def errors(self) -> list[Diagnostic]:
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def passed(self) -> bool:
        return not self.errors

    def as_dict(self) -> dict:
        lc = self.launch
        return {"kind": "preflight-report", "version": 1, "verdict": "pass" if self.passed else "fail",
                "launch": {k: v for k, v in vars(lc).items() if v not in (None, [], False)},
                "flag_set": "seed-era" if lc.seed_flags else "sglang-kt 0.7.2",
                "counts": {"error": len(self.errors),
                           "warning": sum(f.severity == WARNING for f in self.findings)},
                "findings": [finding_dict(f) for f in self.findings], "seconds": round(self.seconds, 3)}


def finding_line(f: Diagnostic) -> str:
    """A finding as preflight prints it: ``error PF124 --kt-method: MESSAGE (fix: FIX)``."""
    at = f"{f.where}: " if f.where else ""
    return f"{f.severity} {f.id} {at}{f.message} (fix: {f.fix})"


def finding_dict(f: Diagnostic) -> dict:
    """A finding in preflight's ``-o json`` (``findings``)."""
    return {"id": f.id, "severity": f.severity, "where": f.where, "message": f.message, "fix": f.fix}


def preflight(launch: Launch, rules: str | None = None) -> PreflightReport:
    began = time.perf_counter()
    findings = run_checks(launch, rules)
    return PreflightReport(launch, findings, time.perf_counter() - began)


__all__ = ["Launch", "PreflightReport", "finding_line", "parse_command", "preflight"]
