"""Style checks on ``match.name`` regexes: patterns that compile but match more than their author meant."""

from __future__ import annotations

import re

_DOT_BETWEEN_WORDS = re.compile(r"(?<=[A-Za-z0-9_])\.(?=[A-Za-z0-9_(\[.])")


def _strip_classes_and_escapes(pattern: str) -> str:
    """Blank out escapes and character classes so only live metacharacters remain (offsets preserved)."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            out.append("__")
            i += 2
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            out.append("_" * (min(j, n - 1) - i + 1))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)[:n]


def unescaped_dots(pattern: str) -> list[int]:
    """Offsets of ``.`` written between identifier characters (``model.layers``): meant literally, matches any char."""
    live = _strip_classes_and_escapes(pattern)
    hits = []
    for m in _DOT_BETWEEN_WORDS.finditer(live):
        nxt = live[m.end(): m.end() + 1]
        if nxt in ("*", "+", "?", "{"):
            continue
        hits.append(m.start())
    return hits


def top_level_alternatives(pattern: str) -> list[str]:
    live = _strip_classes_and_escapes(pattern)
    parts, depth, start = [], 0, 0
    for i, c in enumerate(live):
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
    parts.append(pattern[start:])
    return parts


def _unwrap(alt: str) -> str:
    alt = alt.strip()
    while alt.startswith("(") and alt.endswith(")") and _balanced_inner(alt):
        alt = alt[1:-1]
        if alt.startswith("?:"):
            alt = alt[2:]
    return alt


def _balanced_inner(alt: str) -> bool:
    depth = 0
    live = _strip_classes_and_escapes(alt)
    for i, c in enumerate(live):
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0 and i != len(live) - 1:
                return False
    return True


def unanchored_alternatives(pattern: str) -> list[str]:
    """Top-level alternatives with neither ``^`` at the start nor ``$`` at the end: re.search matches them anywhere."""
    bad = []
    for alt in top_level_alternatives(pattern):
        inner = _unwrap(alt)
        if len(top_level_alternatives(inner)) > 1:
            bad.extend(unanchored_alternatives(inner))
            continue
        if not (inner.startswith("^") or inner.startswith("\\A") or inner.endswith("$") or inner.endswith("\\Z")):
            bad.append(alt)
    return bad
