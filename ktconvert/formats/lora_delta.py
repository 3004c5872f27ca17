"""The one computation of a LoRA adapter's delta, ``alpha/r * B @ A`` in float32, from the adapter's own tensors.

It lives in ``formats`` because it only reads tensors: ``convert`` (quantize --lora's workers), ``model`` (verify
--lora's weight source) and ``verify`` (its reference state) all add the same delta, so there is one merge.
A ``lora`` tuple is ``(file of A, name of A, expert index in A or -1, file of B, name of B, index or -1, alpha/r)``
(fused adapters hold every expert in one tensor).
"""

from __future__ import annotations

import re

import numpy as np

from ktconvert.formats.checkpoint import open_checkpoint

#: an adapted routed-expert weight's HF name (layer, expert, projection): the deltas the expert slices carry
EXPERT_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def lora_delta(lora: tuple, rows: np.ndarray | None = None, open_ck=open_checkpoint) -> np.ndarray:
    """``alpha/r * B[rows] @ A`` in float32 (every row when ``rows`` is None); ``open_ck`` lets a worker reuse its
    open checkpoints."""
    fa, na, ia, fb, nb, ib, scale = lora
    a = open_ck(fa).read_float32(na, None if ia < 0 else ia)
    b = open_ck(fb).read_float32(nb, None if ib < 0 else ib)
    return np.float32(scale) * ((b if rows is None else b[rows]) @ a)
