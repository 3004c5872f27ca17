"""kt-amx tensor names, ``blk.L.ffn_{gate,up,down}_exps.E.numa.N.{weight,scale}``, in one place.

Pure string code with no imports beyond ``re``: the kernel child process imports it next to kt_kernel, and
preflight parses headers with it. (The kt-amx reader in ``formats/`` has its own; the two are to be merged.)
"""

from __future__ import annotations

import re
from typing import NamedTuple

_NAME = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(\d+)\.numa\.(\d+)\.(weight|scale)$")


class KtAmxName(NamedTuple):
    layer: int
    proj: str  # gate | up | down
    expert: int
    part: int  # numa part, one per threadpool
    kind: str  # weight | scale


def parse_ktamx_name(name: str) -> KtAmxName | None:
    """The parts of a kt-amx expert tensor name, or None for any other name."""
    m = _NAME.match(name)
    if m is None:
        return None
    return KtAmxName(int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)), m.group(5))


def tensor_name(layer: int, proj: str, expert: int, part: int, kind: str) -> str:
    return f"blk.{layer}.ffn_{proj}_exps.{expert}.numa.{part}.{kind}"
