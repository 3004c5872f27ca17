"""'Did you mean' for every check that names a misspelt key, class or value."""

from __future__ import annotations

import difflib


def suggest(word: str, candidates) -> str | None:
    hits = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return hits[0] if hits else None
