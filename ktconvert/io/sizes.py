"""Byte sizes as people type them (``1GiB``, ``512MiB``, ``5GB``, ``0``), with the unit always explicit.

Binary (KiB, MiB, GiB, TiB) and decimal (KB, MB, GB, TB) units both parse and mean what they say; a bare
number is bytes. ``B`` alone is bytes too, never "billion" (a trap in other converters' flags).
"""

from __future__ import annotations

import re

from ktconvert.errors import UsageProblem

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_PATTERN = r"^\s*\d+(\.\d+)?\s*([kKmMgGtT]([iI]?[bB])?|[bB])?\s*$"


def parse_size(text: str | int, *, what: str = "size") -> int:
    """``"1GiB"`` -> 1073741824. Raises :class:`UsageProblem` naming ``what`` on anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise UsageProblem(f"{what} {text} is negative", fix="give a size such as 1GiB or 512MiB")
        return text
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UsageProblem(f"{what} {text!r} is not a size", fix="write it as a number with a unit: 1GiB, 512MiB, 5GB")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    """Binary units, three significant digits: 1.50 GiB."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"
