"""What a golden engine computes (transformers in :mod:`ktconvert.golden.generate`, ktconvert's reference modules
streamed in :mod:`ktconvert.golden.stream`) before :mod:`~ktconvert.golden.generate` writes it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class GoldenRun:
    tensors: dict[str, np.ndarray]
    producer: dict
    decode_max_abs_diff: float
    stream: dict | None = None  # engine stream: budget, peak resident weights, bytes read, seconds
