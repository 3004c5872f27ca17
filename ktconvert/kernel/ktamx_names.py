"""kt-amx tensor names, ``blk.L.ffn_{gate,up,down}_exps.E.numa.N.{weight,scale}``, in one place.

Pure string code with no imports beyond ``re``: the kernel child process imports it next to kt_kernel, and
preflight parses headers with it. (The kt-amx reader in ``formats/`` has its own; the two are to be merged.)
"""

from __future__ import annotations

import re
from typing import NamedTuple

NAME_PATTERN = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(\d+)\.numa\.(\d+)\.(weight|scale)$")


class KtAmxName(NamedTuple):
    layer: int
    proj: str  # gate | up | down
    expert: int
    part: int  # numa part, one per threadpool
    kind: str  # weight | scale


def _num(s: str) -> bool:
    return s.isascii() and s.isdigit()


def parse_ktamx_name(name: str) -> KtAmxName | None:
    """The parts of a kt-amx expert tensor name, or None for any other name. (Split, not a regex: a
    DeepSeek-V3-sized directory has 180k names and preflight must stay fast; a test holds it to the regex.)"""
    p = name.split(".")
    if len(p) != 7 or p[0] != "blk" or p[4] != "numa" or p[6] not in ("weight", "scale"):
        return None
    proj = p[2][4:-5] if p[2].startswith("ffn_") and p[2].endswith("_exps") else ""
    if proj not in ("gate", "up", "down") or not (_num(p[1]) and _num(p[3]) and _num(p[5])):
        return None
    return KtAmxName(int(p[1]), proj, int(p[3]), int(p[5]), p[6])


def tensor_name(layer: int, proj: str, expert: int, part: int, kind: str) -> str:
    return f"blk.{layer}.ffn_{proj}_exps.{expert}.numa.{part}.{kind}"
