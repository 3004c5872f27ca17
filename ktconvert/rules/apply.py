"""Applying a rule file to a live model: the injection plan verify builds on, from the same engine as check-rules.

There is one implementation of the matching semantics (``engine.resolve``); this module only adapts a module
tree to it (the caller says what type each module is, so this package never imports the models) and refuses rule
files that check-rules finds errors in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ktconvert.errors import InputError
from ktconvert.families import find as find_family
from ktconvert.rules import engine, lint
from ktconvert.rules.catalog import Catalog, Operator, load_catalog
from ktconvert.rules.compile import compile_rules


@dataclass
class Injection:
    """What upstream's ``inject`` would do to one module."""

    path: str
    module: object  # the torch module (or any node) the rule applies to
    module_type: str
    rule_index: int | None  # None: no rule matched; the module stays default on cuda:0
    replace_class: str  # "default" or the operator class path
    operator: Operator | None  # catalog entry (None for default)
    kwargs: dict = field(default_factory=dict)

    def op(self, slot: str) -> str | None:
        """The op a wrapper runs in ``slot`` (``generate_op``/``prefill_op``), defaults applied; None if disabled."""
        if self.operator is None or slot not in self.operator.ops:
            return None
        value = self.kwargs.get(slot, self.operator.ops[slot].default)
        return None if value in (None, "None") else value


@dataclass
class _Node:
    path: str
    type: str
    module: object
    children: list = field(default_factory=list)


def load_rules(path: str | Path, catalog: Catalog | None = None, backend: str = "auto",
               family: str | None = None) -> list[engine.CompiledRule]:
    """Check a rule file and compile it from the same parse; a file with check-rules errors is refused with the
    first one, and so is a file whose match classes belong to other families than ``family`` (the model's): its
    rules would silently match nothing and the run would pass on the defaults."""
    catalog = catalog or load_catalog()
    report = lint.check_paths([path], lint.Options(backend=backend), catalog)
    (result,) = report.files
    if result.error:
        raise InputError(result.error)
    errors = [f for f in result.findings if f.severity == "error"]
    if errors:
        f = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise InputError(f"{f.id} {f.message}{more}", path=str(path), where=f"{f.line}:{f.col}",
                         fix=f"run ktconvert check-rules {path}")
    families = lint.rule_families(result.data, catalog)
    if family is not None and families and not _same_classes(family, families):
        other = ", ".join(sorted(families))
        first = next(iter(families.values()))
        raise InputError(f"the rules are written for {other} (their match classes), the model is {family}",
                         path=str(path), where=f"rule {first}",
                         fix=f"use a rule file for {family}, such as rules/optimize/{family}.yaml")
    return compile_rules(result.data or [], catalog)


def _same_classes(family: str, rule_families) -> bool:
    """The model's family is one the rules were written for, or shares its upstream classes with one (Kimi K2.5's
    language model is built from DeepSeek-V3's classes, so DeepSeek-V3's rule files match it as they match V3)."""
    own = find_family(family)
    return family in rule_families or (own is not None and any(
        find_family(f) is not None and find_family(f).prefix == own.prefix for f in rule_families))


def module_tree(model, type_of: Callable[[object], str]) -> _Node:
    """Wrap a module tree (anything with ``named_children()``) as the tree ``engine.resolve`` walks; ``type_of``
    gives each module's catalog type (the caller knows its classes; the rules engine does not)."""

    def build(path: str, module) -> _Node:
        node = _Node(path, type_of(module), module)
        for name, child in module.named_children():
            node.children.append(build(f"{path}.{name}" if path else name, child))
        return node

    return build("", model)


def injection_plan(model, rules: list[engine.CompiledRule], catalog: Catalog,
                   type_of: Callable[[object], str]) -> list[Injection]:
    """One ``Injection`` per module upstream would visit, in visiting order (root first)."""
    out = []
    for a in engine.resolve(module_tree(model, type_of), rules, catalog.is_instance):
        rule = a.rule
        rclass = rule.replace_class if rule else "default"
        out.append(Injection(a.path, a.node.module, a.module_type, rule.index if rule else None, rclass,
                             catalog.operators.get(rclass) if rclass != "default" else None,
                             dict(rule.kwargs) if rule else {"generate_device": "cuda:0", "prefill_device": "cuda:0"}))
    return out
