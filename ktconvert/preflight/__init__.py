"""``preflight``: a kt-kernel + SGLang launch checked against the model, the weights and the adapter, from
headers only, before minutes of model loading find the problem (or never do).

``preflight(launch, rules=None) -> PreflightReport``; build a :class:`Launch` from flags or with
:func:`parse_command` from a pasted command line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ktconvert.preflight.checks import ERROR, WARNING, Finding, run_checks
from ktconvert.preflight.launch import Launch, parse_command


@dataclass
class PreflightReport:
    launch: Launch
    findings: list[Finding]
    seconds: float

    @property
    def errors(self) -> list[Finding]:
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
                "findings": [f.as_dict() for f in self.findings], "seconds": round(self.seconds, 3)}


def preflight(launch: Launch, rules: str | None = None) -> PreflightReport:
    began = time.perf_counter()
    findings = run_checks(launch, rules)
    return PreflightReport(launch, findings, time.perf_counter() - began)


__all__ = ["Finding", "Launch", "PreflightReport", "parse_command", "preflight"]
