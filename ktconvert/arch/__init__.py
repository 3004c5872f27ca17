"""Model architecture as mechanisms: one module per mechanism (``gqa``, ``mla``, ``compressed_mqa``,
``gated_deltanet``, ``kda``, ``dense_mlp``, ``moe``, ``hash_routing``, ``hyper_connections``), each holding its part
of the config and the parser that reads it from config.json, and listing its tensors, its module-tree nodes and its
GGUF keys behind one protocol (``base.py``); ``registry.py`` finds them (a
module here with a ``MECHANISM`` is one), holds them by name and picks each layer's (the spec names the kind as
data); ``tensors.py`` walks the layers for the checkpoint's tensor list. The torch computation of each is registered under the same name in ``ktconvert/model/mechanisms.py``.
Below ``families`` (whose ``config.py`` runs the mechanisms' parse steps, ``parse_steps``, and whose ``limits.py``
gathers their ``count_limits``; a mechanism names ``MoeConfig`` for its annotations only), above ``errors`` and
``io``; torch-free."""

from ktconvert.arch.base import Mechanism
from ktconvert.arch.registry import (
    MECHANISMS,
    attention,
    attention_for,
    count_limits,
    feed_forward_for,
    gguf_keys,
    kind_mechanism,
    mechanism,
    parse_steps,
    residual_for,
    role_fills,
)

__all__ = ["MECHANISMS", "Mechanism", "attention", "attention_for", "count_limits", "feed_forward_for", "gguf_keys",
           "kind_mechanism", "mechanism", "parse_steps", "residual_for",
           "role_fills"]
