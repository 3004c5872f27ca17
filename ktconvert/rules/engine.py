"""Rule matching with upstream's exact semantics, shared by check-rules and the injection in verify.

Reproduces ktransformers' ``gen_optimize_config``: every module is visited from the root (path ``""``);
the first rule whose ``class`` (isinstance) and ``name`` (``re.search`` on the dotted path) both hold wins;
``recursive: false`` on the winning rule stops the descent; unmatched modules stay ``default``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class CompiledRule:
    index: int
    name: re.Pattern | None
    class_type: str | None  # resolved module type; None when the rule has no class
    class_known: bool  # False: the class names nothing a module can be (never matches)
    replace_class: str
    kwargs: dict
    recursive: bool


@dataclass
class Assignment:
    path: str
    module_type: str
    rule: CompiledRule | None  # None: no rule matched, the module stays default
    node: object = field(repr=False, default=None)

    @property
    def replace_class(self) -> str:
        return self.rule.replace_class if self.rule else "default"


def class_ok(rule: CompiledRule, module_type: str, is_instance: Callable[[str, str], bool]) -> bool:
    """The rule's class test alone (``match.class`` as isinstance of the module's type)."""
    if not rule.class_known:
        return False
    return rule.class_type is None or is_instance(module_type, rule.class_type)


def _searcher(pattern: re.Pattern | None, cache: dict | None):
    if pattern is None:
        return None
    if cache is None:
        return lambda path, s=pattern.search: s(path) is not None
    seen = cache.setdefault(pattern.pattern, {})

    def search(path: str, s=pattern.search, seen=seen) -> bool:
        hit = seen.get(path)
        if hit is None:
            hit = seen[path] = s(path) is not None
        return hit

    return search


def resolve(root, rules: list[CompiledRule], is_instance: Callable[[str, str], bool],
            search_cache: dict | None = None) -> list[Assignment]:
    """One ``Assignment`` per visited module, in visiting order. ``root`` needs ``path``, ``type``, ``children``.

    ``search_cache`` (pattern -> {path: matched}) may be shared by calls over the same tree: rule files
    repeat the same few regexes, so checking many files against one tree reuses most searches.
    """
    out: list[Assignment] = []
    append = out.append
    by_type: dict[str, list] = {}  # the class test depends on the type only: do it once per type
    stack = [root]
    pop, extend = stack.pop, stack.extend
    while stack:
        node = pop()
        path = node.path
        candidates = by_type.get(node.type)
        if candidates is None:
            candidates = by_type[node.type] = [
                (r, _searcher(r.name, search_cache)) for r in rules if class_ok(r, node.type, is_instance)
            ]
        winner = None
        for rule, search in candidates:
            if search is None or search(path):
                winner = rule
                break
        append(Assignment(path, node.type, winner, node))
        if (winner is None or winner.recursive) and node.children:
            extend(node.children[::-1])
    return out
