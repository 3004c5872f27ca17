"""The KT checks of check-rules, one function each, registered by ID.

A check is ``fn(ctx, ...)`` decorated with :func:`check`: its IDs (whose severity, title and bad/fixed examples
live in ``rules/lint-checks.yaml``) and the stage it runs at. ``ctx`` (:class:`ktconvert.rules.lint.LintContext`)
only carries data and collects findings. Stages, in order:

* ``load`` ``fn(ctx)``: what the YAML loader found (a syntax error, duplicate keys); nothing else runs after a
  syntax error.
* ``data-file`` ``fn(ctx, data)``: a ktconvert data file (a mapping with ``kind:``) instead of a rule list.
* ``document`` ``fn(ctx, data)``: the loaded rule list as a whole (schema, backend comment).
* ``rule`` ``fn(ctx, view, op)``: each rule (:class:`~ktconvert.rules.compile.RuleView`) with its catalog
  operator (None when the class is unknown or not a string). Rules whose regex does not compile get only the
  regex check: upstream fails on them before anything else.
* ``tree`` ``fn(ctx, data, rules, tree, assigned)``: with a module tree (``--model`` or a probe tree).
* ``static`` ``fn(ctx, data)``: without a tree.
* ``weights`` ``fn(ctx, rules, tree, checkpoint)``: with ``--weights``.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Callable

STAGES = ("load", "data-file", "document", "rule", "tree", "static", "weights")


@dataclass(frozen=True)
class Registered:
    ids: tuple[str, ...]
    stage: str
    fn: Callable


_REGISTRY: list[Registered] = []


def check(*ids: str, stage: str):
    """Register the decorated function as the check emitting ``ids`` at ``stage``."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")

    def register(fn):
        _REGISTRY.append(Registered(tuple(ids), stage, fn))
        return fn

    return register


def checks(stage: str) -> list[Registered]:
    if stage == "weights":  # numpy and the checkpoint readers load only when a run checks weights
        import_module("ktconvert.rules.checks.weights")
    return [c for c in _REGISTRY if c.stage == stage]


def implemented_ids() -> dict[str, str]:
    """``{check ID: function name}`` over every registered check."""
    checks("weights")
    return {i: c.fn.__name__ for c in _REGISTRY for i in c.ids}


# the check modules register themselves with ``check`` above
from ktconvert.rules.checks import document, rule, tree  # noqa: E402,F401
