"""Reference operators that reproduce the numerics of ktransformers' operators, for ``ktconvert verify``.

Which operator reproduces which upstream op is data: the ``emulation`` of each op and operator in the
catalog (``rules/catalog/ktransformers.yaml``). The names this package implements are below; a catalog
entry naming anything else, or nothing, runs a stated fallback and is reported as not emulated.
"""

from __future__ import annotations

# emulation name -> what implements it (kinds: experts op, linear op, wrapper by op slot, keep the module)
EXPERT_OPS = ("cpu-experts-ggml", "experts-dequant")
LINEAR_OPS = ("linear-dequant",)
WRAPPERS = {"experts-by-op": "experts", "linear-by-op": "linear"}
KEEP = ("identity", "moe-block")
IMPLEMENTED = frozenset((*EXPERT_OPS, *LINEAR_OPS, *WRAPPERS, *KEEP))

# the fallback numerics of an op that is not emulated (reported as such)
FALLBACK = {"experts": "experts-dequant", "linear": "linear-dequant"}
