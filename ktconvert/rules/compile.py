"""Rule file data -> compiled rules, the one pure step that check-rules, ``--explain`` and verify's injection share.

Compiling never reports: the checks in :mod:`ktconvert.rules.checks` say what is wrong with a rule; here a rule
too broken to match anything (not a mapping, a regex that does not compile or could backtrack without end) is
left out, as upstream would fail
on it before matching.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ktconvert.io.userregex import backtracking_risk
from ktconvert.rules.catalog import Catalog, Operator
from ktconvert.rules.engine import CompiledRule


@dataclass(frozen=True)
class RuleView:
    """One rule of a file as the checks read it: the raw mapping's parts, defaults applied, nothing judged."""

    index: int
    raw: object
    match: dict
    replace: dict
    name: object  # match.name as written (a regex string when valid)
    name_re: re.Pattern | None
    regex_error: re.error | None
    cls: object  # match.class as written
    replace_class: object
    kwargs: dict
    has_kwargs: bool
    recursive: bool
    regex_risk: str | None = None  # why match.name could backtrack catastrophically (then name_re is None)

    @property
    def path(self) -> tuple:
        return (str(self.index),)


def view_rule(index: int, rule) -> RuleView | None:
    """The parts of ``rule`` (None when it is not a mapping: the schema check reports that)."""
    if not isinstance(rule, dict):
        return None
    match = rule.get("match") if isinstance(rule.get("match"), dict) else {}
    replace = rule.get("replace") if isinstance(rule.get("replace"), dict) else {}
    name = match.get("name")
    name_re, error, risk = None, None, None
    if isinstance(name, str):
        try:
            name_re = re.compile(name)
        except re.error as exc:
            error = exc
        if name_re is not None and (risk := backtracking_risk(name)) is not None:
            name_re = None  # never matched: it could hang check-rules, --explain and verify
    kwargs = replace.get("kwargs")
    return RuleView(index, rule, match, replace, name, name_re, error, match.get("class"),
                    replace.get("class", "default"), kwargs if isinstance(kwargs, dict) else {}, "kwargs" in replace,
                    bool(rule["recursive"]) if "recursive" in rule else True, risk)


def operator_of(view: RuleView, catalog: Catalog) -> Operator | None:
    return catalog.operators.get(view.replace_class) if isinstance(view.replace_class, str) else None


def compile_view(view: RuleView, catalog: Catalog) -> CompiledRule | None:
    if view.regex_error is not None or view.regex_risk is not None:
        return None
    class_type, class_known = None, True
    if isinstance(view.cls, str):
        class_type = catalog.type_of_class(view.cls)
        class_known = class_type is not None
    rclass = view.replace_class if isinstance(view.replace_class, str) else "default"
    compiled = CompiledRule(view.index, view.name_re, class_type, class_known, rclass, view.kwargs, view.recursive)
    compiled.operator = operator_of(view, catalog)  # type: ignore[attr-defined]
    return compiled


def view_rules(rules_data: list) -> list[RuleView]:
    """The views of a file's rules (entries that are not mappings are left out: the schema check reports them)."""
    return [v for v in (view_rule(i, r) for i, r in enumerate(rules_data or [])) if v is not None]


def compile_views(views: list[RuleView], catalog: Catalog) -> list[CompiledRule]:
    """Views compiled for ``engine.resolve`` (rules too broken to compile are left out)."""
    return [c for c in (compile_view(v, catalog) for v in views) if c is not None]


def compile_rules(rules_data: list, catalog: Catalog) -> list[CompiledRule]:
    """The rules of a file's data, compiled for ``engine.resolve`` (rules too broken to compile are left out)."""
    return compile_views(view_rules(rules_data), catalog)
