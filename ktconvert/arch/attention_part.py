"""``MoeConfig.attention``: what the attention mechanisms of a model read of its config, as one typed part. Each
field is parsed by the mechanism that owns it (``gqa.py``'s window and MSA indexer, ``mla.py``, ``gated_deltanet.py``,
``kda.py``, ``compressed_mqa.py``); ``ktconvert/families/config.py`` gathers them here. Machinery, not a mechanism."""

from __future__ import annotations

from dataclasses import dataclass

from ktconvert.arch.compressed_mqa import CompressedDims
from ktconvert.arch.gated_deltanet import LinearAttentionDims
from ktconvert.arch.indexer import IndexerDims
from ktconvert.arch.kda import KdaDims
from ktconvert.arch.mla import MlaDims


@dataclass(frozen=True)
class AttentionPart:
    """The attention of every layer: the shared flags, and the part of each mechanism the spec names (None where
    the model has not that mechanism)."""

    qk_norm: bool = False  # per-head q/k RMSNorm (the spec's qk_norm, or its qk_norm_key config switch)
    # sliding-window attention where a spec models it: the window and the layers that use it
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    mla: MlaDims | None = None  # multi-head latent attention (spec attention.kind mla)
    q_lora_rank: int | None = None  # the query latent (MLA, the DSA indexer, compressed MQA)
    qk_rope_head_dim: int | None = None  # the rotated part of each head (MLA, compressed MQA)
    # each layer's kind where config.json lists it (a Gated DeltaNet hybrid, Kimi Delta Attention)
    layer_types: tuple[str, ...] = ()
    linear: LinearAttentionDims | None = None  # Gated DeltaNet (spec attention.kind gated_deltanet_hybrid)
    kda: KdaDims | None = None  # Kimi Delta Attention on the linear_attention layers (attention.linear_attention)
    indexer: IndexerDims | None = None  # DSA (attention.dsa_indexer), MSA (attention.msa_indexer) or lightning
    compressed: CompressedDims | None = None  # compressed sparse MQA (spec attention.kind compressed_mqa)
