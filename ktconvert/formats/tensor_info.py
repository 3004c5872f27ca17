"""What is known about one stored tensor from the file header alone (no data read)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)  # one per tensor: 10^6 of them in the largest headers
class TensorInfo:
    """A tensor as its container describes it.

    ``shape`` is numpy order (slowest axis first, what ``array.shape`` prints); ``ne`` is ggml order (fastest axis
    first, what GGUF stores and llama.cpp prints). The two are reverses of each other; both are given so that no
    caller has to remember which way round a number was meant.

    ``dtype`` is the container's own type name: a safetensors dtype (``"BF16"``, ``"F8_E4M3"``) or a ggml type name
    (``"Q4_K"``, ``"F32"``); ``ggml_type`` is the ggml type id for GGUF tensors and ``None`` for safetensors ones.
    ``offset`` is the absolute byte offset of the data in ``file``; ``nbytes`` its length.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    ggml_type: int | None
    file: Path
    offset: int
    nbytes: int

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def container(self) -> str:
        return "safetensors" if self.ggml_type is None else "gguf"

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n
