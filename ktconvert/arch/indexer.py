"""The sparse-attention indexers' sizes (not a mechanism of their own: each rides on the attention mechanism that
runs it): DeepSeek Sparse Attention on ``mla`` (``mla.py`` parses it), DeepSeek-V4's lightning indexer on
``compressed_mqa`` and MiniMax Sparse Attention on ``gqa``. ``MoeConfig.attention.indexer`` holds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ktconvert.arch.base import Getter
from ktconvert.errors import InputError


#: config.json's indexer sizes (every indexer's ``index_*`` spelling), bounded as ``ktconvert/families/limits.py``
#: bounds counts: gathered with MLA's (``mla.py``), whose DSA indexer reads them first
COUNT_LIMITS = {"index_n_heads": (1, 4096), "index_head_dim": (1, 1 << 14), "index_topk": (1, 1 << 28)}


@dataclass(frozen=True)
class IndexerDims:
    """Sparse-attention indexer sizes (config ``index_*``): DeepSeek Sparse Attention keeps ``topk`` keys; MiniMax
    Sparse Attention keeps ``topk`` blocks of ``block_size`` keys, the ``local_blocks`` ending at the query's own
    among them."""

    n_heads: int
    head_dim: int
    topk: int
    block_size: int | None = None
    local_blocks: int | None = None
    kpool: int | None = None  # DSA over pools of kpool keys (GLM-5-Next); topk counts keys, a multiple of kpool
    kpool_tail: bool = True  # the query's incomplete pool is always attended
    # DSA: each layer's indexer mode as config.json gives it (indexer_types or index_topk_pattern; None: every
    # topk_freq-th layer from skip_offset runs its own), and whether config.json writes indexer_types
    types: tuple | None = None
    topk_freq: int = 1
    skip_offset: int = 2
    types_written: bool = False
    shared_layers: tuple[int, ...] = ()  # DSA: attention layers reusing the previous layer's selection
    sparse_layers: tuple[int, ...] = ()  # MSA: the layers running MiniMax Sparse Attention (the others attend fully)

    def full_layers(self, layers: int) -> list[bool]:
        """Whether each of ``layers`` layers runs its own DSA indexer (transformers 5.23's reading)."""
        return [t == "full" for t in indexer_schedule(self.types, self.topk_freq, self.skip_offset, layers)]


def indexer_dims(g: Getter, rope_dim: int, path: str | None, **extra) -> IndexerDims:
    """``index_n_heads`` / ``index_head_dim`` / ``index_topk``, checked against the rotated size the indexer keys hold
    (a DSA indexer's and DeepSeek-V4's lightning indexer alike)."""
    dims = IndexerDims(n_heads=g.int("index_n_heads"), head_dim=g.int("index_head_dim"), topk=g.int("index_topk"),
                       **extra)
    if dims.head_dim < rope_dim or min(dims.n_heads, dims.topk) < 1:
        raise InputError(f"index_head_dim={dims.head_dim} must hold qk_rope_head_dim={rope_dim}; index_n_heads and "
                         "index_topk must be positive", path=path, where="index_head_dim")
    return dims


def indexer_source(raw: dict) -> tuple[Any, int, int]:
    """``(types, topk_freq, skip_offset)`` of a DSA config: ``indexer_types``, else the releases'
    ``index_topk_pattern`` (``F``/``S`` per layer) as types, else None and the ``index_topk_freq`` /
    ``index_skip_topk_offset`` schedule (defaults 1 and 2: all full)."""
    types = raw.get("indexer_types")
    if types is None:
        pattern = raw.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is not None:
        return types, 1, 2
    return None, max(int(raw.get("index_topk_freq") or 1), 1), int(raw.get("index_skip_topk_offset", 2))


def indexer_schedule(types: Any, freq: int, offset: int, layers: int) -> list:
    """Each layer's DSA indexer mode as transformers 5.23 reads it: the given types, else every ``freq``-th layer
    from ``offset`` runs its own indexer."""
    if types is not None:
        return list(types) if isinstance(types, tuple) else types
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(layers)]


def indexer_types(raw: dict, layers: int) -> list:
    """Each layer's DSA indexer mode (``full`` / ``shared``) as transformers 5.23 reads it."""
    return indexer_schedule(*indexer_source(raw), layers)
