"""Findings and the registry of checks (IDs, severities and documented examples live in YAML data)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

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


@dataclass
class Finding:
    id: str
    severity: str
    file: str
    line: int
    col: int
    message: str
    fix: str = ""
    rule_index: int | None = None
    path: str = "$"

    def as_dict(self) -> dict:
        return asdict(self)


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
