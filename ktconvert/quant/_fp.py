"""float helpers the numpy dequantizers share."""

from __future__ import annotations

import numpy as np

F32 = np.float32


def fp16_to_f32(h: np.ndarray) -> np.ndarray:
    """fp16 bits -> float32 (exact)."""
    return h.view(np.float16).astype(F32)
