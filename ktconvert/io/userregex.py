"""A user's regular expression (a rule's ``match.name``, a recipe's ``match``, ``inspect --tensors``) checked,
before it is ever matched, for the shapes that make Python's backtracking ``re`` take exponential time: a
repetition whose body can hand the same characters from one iteration to the next in more than one way.

Static detection on the parse tree of ``re`` itself (so the pattern is read exactly as ``re.compile`` reads it),
not a time limit: a pattern is refused the same way on every machine, before any work, and the matching that
follows keeps plain ``re.search`` semantics (upstream's). Three shapes are refused:

* **nested quantifier** — inside an unbounded (or 16+) repetition, a variable repetition ``C+`` / ``C*`` /
  ``C{1,5}`` whose characters can also be consumed by the path that leaves it and comes back to it in the next
  iteration: ``(a+)+``, ``(a*)*``, ``(.*)*``, ``(.*a)*``, ``(\\w+\\.?)+``. ``(\\d+\\.)+`` is fine: the ``\\.``
  that separates the iterations is no digit.
* **overlapping alternation** — inside such a repetition, two alternatives that can start with the same character
  and continue alike: ``(a|a)*``, ``(a|aa)*``, ``(a|b|ab)*``. ``(a|ab)*`` is fine, and so is ``(\\w|\\d)+``,
  which ``re`` itself turns into one character class.
* **many adjacent wildcards** — four or more unbounded repetitions over a common character (``.*.*.*.*x``): not
  exponential, but n^4 and more on a failing name.

Atomic groups and possessive quantifiers (Python 3.11+) never backtrack, so what they hold is not counted.
"""

from __future__ import annotations

import re
from functools import lru_cache

try:  # Python 3.11+
    import re._parser as _p
except ImportError:  # Python 3.10
    import sre_parse as _p  # type: ignore[no-redef]

_LOOP_MIN = 16  # a bounded repetition of at least this many iterations counts as a loop
_ADJACENT = 4
_ALL = frozenset(range(256))
_DIGIT = frozenset(range(48, 58))
_WORD = frozenset([*range(48, 58), *range(65, 91), *range(97, 123), 95])
_SPACE = frozenset(b" \t\n\r\f\v")

FIX = ("rewrite it so each character can be matched one way only: (a+)+ -> a+, (.*\\.)* -> (?:[^.]*\\.)*, "
       "(a|a)* -> a*; or make the inner repetition possessive (a++) or atomic ((?>...))")


class _Set:
    """The characters one position may match: codes 0..255 exactly, and whether any above 255."""

    __slots__ = ("low", "high")

    def __init__(self, low=frozenset(), high: bool = False):
        self.low, self.high = frozenset(low), high

    def __or__(self, other: "_Set") -> "_Set":
        return _Set(self.low | other.low, self.high or other.high)

    def overlaps(self, other: "_Set") -> bool:
        return bool(self.low & other.low) or (self.high and other.high)

    def __bool__(self) -> bool:
        return bool(self.low) or self.high


_NONE = _Set()
_ANY = _Set(_ALL, True)
_CATEGORIES = {
    _p.CATEGORY_DIGIT: _Set(_DIGIT), _p.CATEGORY_NOT_DIGIT: _Set(_ALL - _DIGIT, True),
    _p.CATEGORY_WORD: _Set(_WORD), _p.CATEGORY_NOT_WORD: _Set(_ALL - _WORD, True),
    _p.CATEGORY_SPACE: _Set(_SPACE), _p.CATEGORY_NOT_SPACE: _Set(_ALL - _SPACE, True),
}
_REPEATS = (_p.MAX_REPEAT, _p.MIN_REPEAT)
_ATOMIC = tuple(getattr(_p, n) for n in ("ATOMIC_GROUP", "POSSESSIVE_REPEAT") if hasattr(_p, n))


def _fold(s: _Set) -> _Set:
    return _Set(s.low | {c ^ 32 for c in s.low if 65 <= c <= 90 or 97 <= c <= 122}, s.high)


class _Analysis:
    def __init__(self, ignorecase: bool):
        self.ignorecase = ignorecase

    # --- single positions ----------------------------------------------------------------------------------
    def char(self, op, av) -> _Set | None:
        """The characters of a one-character node, or None when ``op`` is not one."""
        if op is _p.LITERAL:
            s = _Set({av} if av < 256 else (), av >= 256)
        elif op is _p.NOT_LITERAL:
            s = _Set(_ALL - {av}, True)
        elif op is _p.ANY:
            s = _ANY
        elif op is _p.IN:
            s, negate = _NONE, False
            for iop, iav in av:
                if iop is _p.NEGATE:
                    negate = True
                elif iop is _p.LITERAL:
                    s = s | _Set({iav} if iav < 256 else (), iav >= 256)
                elif iop is _p.RANGE:
                    lo, hi = iav
                    s = s | _Set(range(lo, min(hi, 255) + 1), hi > 255)
                elif iop is _p.CATEGORY:
                    s = s | _CATEGORIES.get(iav, _ANY)
                else:
                    s = _ANY
            if negate:
                s = _Set(_ALL - s.low, True)
        else:
            return None
        return _fold(s) if self.ignorecase else s

    # --- sequences -----------------------------------------------------------------------------------------
    def nullable(self, seq) -> bool:
        return all(self.node_nullable(op, av) for op, av in seq)

    def node_nullable(self, op, av) -> bool:
        if self.char(op, av) is not None:
            return False
        if op is _p.SUBPATTERN:
            return self.nullable(av[-1])
        if op is _p.BRANCH:
            return any(self.nullable(alt) for alt in av[1])
        if op in _REPEATS or op is getattr(_p, "POSSESSIVE_REPEAT", None):
            return av[0] == 0 or self.nullable(av[2])
        if op is getattr(_p, "ATOMIC_GROUP", None):
            return self.nullable(av)
        if op is _p.GROUPREF_EXISTS:
            return self.nullable(av[1]) or av[2] is None or self.nullable(av[2])
        return True  # anchors, lookarounds, back-references (may be empty)

    def first(self, seq) -> _Set:
        out = _NONE
        for op, av in seq:
            out = out | self.node_first(op, av)
            if not self.node_nullable(op, av):
                break
        return out

    def node_first(self, op, av) -> _Set:
        c = self.char(op, av)
        if c is not None:
            return c
        if op is _p.SUBPATTERN:
            return self.first(av[-1])
        if op is _p.BRANCH:
            out = _NONE
            for alt in av[1]:
                out = out | self.first(alt)
            return out
        if op in _REPEATS or op is getattr(_p, "POSSESSIVE_REPEAT", None):
            return self.first(av[2])
        if op is getattr(_p, "ATOMIC_GROUP", None):
            return self.first(av)
        if op is _p.GROUPREF:
            return _ANY
        if op is _p.GROUPREF_EXISTS:
            return self.first(av[1]) | (self.first(av[2]) if av[2] is not None else _NONE)
        return _NONE

    def compatible(self, op, av, chars: _Set) -> bool:
        """Whether the node can consume nothing, or only characters of ``chars`` (over-approximated)."""
        if self.node_nullable(op, av):
            return True
        c = self.char(op, av)
        if c is not None:
            return c.overlaps(chars)
        if op is _p.SUBPATTERN:
            return all(self.compatible(o, a, chars) for o, a in av[-1])
        if op is _p.BRANCH:
            return any(all(self.compatible(o, a, chars) for o, a in alt) for alt in av[1])
        if op in _REPEATS:
            return all(self.compatible(o, a, chars) for o, a in av[2])
        return False

    # --- the shapes ----------------------------------------------------------------------------------------
    def find(self, seq, loops: list) -> str | None:
        """Walk ``seq``; ``loops`` holds one trail per enclosing loop: the (sequence, index) steps from that loop's
        body down to ``seq``."""
        for i, (op, av) in enumerate(seq):
            if op in _ATOMIC:
                continue
            here = [[*trail, (seq, i)] for trail in loops]
            children = []
            if op in _REPEATS:
                lo, hi, body = av
                if hi > lo and hi >= 2 and (why := self._nested(body, here)):
                    return why
                if hi == _p.MAXREPEAT or hi >= _LOOP_MIN:
                    if (why := self._alternation(body)) is not None:
                        return why
                    here = [*here, []]  # its body starts a loop of its own
                children = [body]
            elif op is _p.SUBPATTERN:
                children = [av[-1]]
            elif op is _p.BRANCH:
                children = list(av[1])
            elif op in (_p.ASSERT, _p.ASSERT_NOT):
                children = [av[1]]
            elif op is _p.GROUPREF_EXISTS:
                children = [part for part in av[1:] if part is not None]
            for child in children:
                if (why := self.find(child, here)) is not None:
                    return why
        return None

    def _nested(self, body, loops: list) -> str | None:
        """A variable repetition of ``body`` inside a loop: refused when the way from its end around the loop back
        to it can consume nothing but characters it could consume itself."""
        chars = self.first(body)
        if not chars:
            return None
        for trail in loops:
            # trail: [(seq, i), ...] from the loop's body down to the repetition; after it to each sequence's
            # end, then from each sequence's start down to it again (the next iteration)
            after = [node for seq, i in reversed(trail) for node in list(seq)[i + 1:]]
            before = [node for seq, i in trail for node in list(seq)[:i]]
            if all(self.compatible(o, a, chars) for o, a in [*after, *before]):
                return "a nested quantifier: a repetition inside a repetition can split the same characters " \
                       "between its iterations in exponentially many ways"
        return None

    def _alternation(self, seq, after: _Set | None = None) -> str | None:
        """An alternation in a loop body ``seq`` (``after``: what can follow ``seq``; for the body itself, the
        loop's next iteration) whose alternatives can match the same characters and go on alike."""
        if after is None:
            after = self.first(seq)
        items = list(seq)
        for k, (op, av) in enumerate(items):
            rest = items[k + 1:]
            cont = self.first(rest) | (after if self.nullable(rest) else _NONE)
            if op is _p.SUBPATTERN and (why := self._alternation(av[-1], cont)) is not None:
                return why
            if op is not _p.BRANCH:
                continue
            alts = av[1]
            for a in range(len(alts)):
                for b in range(a + 1, len(alts)):
                    if self._alike(list(alts[a]), list(alts[b]), cont):
                        return "a repeated alternation whose alternatives can match the same characters " \
                               "(exponentially many ways)"
        return None

    def _alike(self, x: list, y: list, cont: _Set) -> bool:
        if self.nullable(x) and self.nullable(y):
            return True
        if self.nullable(x) or self.nullable(y):  # one may match nothing: the other's start against what follows
            other = y if self.nullable(x) else x
            return self.first(other).overlaps(cont)
        if not self.first(x).overlaps(self.first(y)):
            return False
        return self._next(x, cont).overlaps(self._next(y, cont))

    def _next(self, alt: list, cont: _Set) -> _Set:
        rest = alt[1:]
        return self.first(rest) | (cont if self.nullable(rest) else _NONE)

    def adjacent(self, seq) -> str | None:
        stars = []

        def walk(s):
            for op, av in s:
                if op in _REPEATS and av[1] == _p.MAXREPEAT and len(av[2]) == 1 and \
                        (c := self.char(*list(av[2])[0])) is not None:
                    stars.append(c)
                elif op is _p.SUBPATTERN:
                    walk(av[-1])
                elif op is _p.BRANCH:
                    for alt in av[1]:
                        walk(alt)
                elif op in _REPEATS:
                    walk(av[2])

        walk(seq)
        for c in stars:
            if sum(1 for d in stars if c.overlaps(d)) >= _ADJACENT:
                return f"{_ADJACENT} or more unbounded repetitions over the same characters (n^{_ADJACENT} time " \
                       "and more on a name that does not match)"
        return None


@lru_cache(maxsize=4096)  # rule files repeat the same few patterns, a generated one thousands of times
def backtracking_risk(pattern: str) -> str | None:
    """Why ``pattern`` can make ``re.search`` backtrack catastrophically, or ``None``. A pattern that does not
    compile is ``None`` here (``re.compile`` reports it)."""
    try:
        tree = _p.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return None
    state = getattr(tree, "state", None) or getattr(tree, "pattern", None)
    a = _Analysis(bool(getattr(state, "flags", 0) & re.IGNORECASE))
    try:
        return a.find(list(tree), []) or a.adjacent(list(tree))
    except RecursionError:
        return "nesting too deep to check"
