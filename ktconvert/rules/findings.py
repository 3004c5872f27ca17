"""The registry of checks (IDs, severities and documented examples live in YAML data) and a finding's JSON shape."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ktconvert.diagnostics import Diagnostic
from ktconvert.io.datafile import load_data_file
from ktconvert.io.resources import rules_dir


@dataclass(frozen=True)
class Check:
    id: str
    severity: str
    title: str
    needs: str  # "" (always), "tree" (model or probe tree), "model" (--model only)
    bad: str
    fixed: str
    backend: str = "ktransformers"
    model: str | None = None
    weights: dict | None = None


def finding_dict(f: Diagnostic) -> dict:
    """A finding in check-rules' ``-o json`` (``schemas/check-rules-report.schema.json``): ``where`` is its ``file``;
    ``extra`` holds the ``rule_index`` and the JSON ``path``."""
    return {"id": f.id, "severity": f.severity, "file": f.where, "line": f.line, "col": f.col, "message": f.message,
            "fix": f.fix, "rule_index": f.extra["rule_index"], "path": f.extra["path"]}


@lru_cache(maxsize=1)
def registry() -> dict[str, Check]:
    """All checks by ID, from ``rules/lint-checks.yaml``."""
    data = load_data_file(rules_dir() / "lint-checks.yaml", "lint-checks", "lint-check list").data
    return {
        c["id"]: Check(id=c["id"], severity=c["severity"], title=c["title"], needs=c.get("needs", ""),
                       bad=c["bad"], fixed=c["fixed"], backend=c.get("backend", "ktransformers"), model=c.get("model"),
                       weights=c.get("weights"))
        for c in data["checks"]
    }


def selected(check_id: str, select: tuple = (), ignore: tuple = ()) -> bool:
    """``--select``/``--ignore`` take IDs or prefixes (``KT3`` means every regex check)."""
    if select and not any(check_id.startswith(s) for s in select):
        return False
    return not any(check_id.startswith(s) for s in ignore)
