"""Hash routing (DeepSeek-V4's first layers, spec ``routing.hash_layers``): an MoE block whose experts are looked up
by token id in a ``tid2eid`` table instead of scored; the rest of the block is the MoE block of ``moe.py``.
Torch: ``model/compressed.py`` ``HashRoutedMoE``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ktconvert.arch.base import Add
from ktconvert.arch.moe import Moe

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


class HashRouting(Moe):
    name = "hash_routing"

    def router_tensors(self, cfg: MoeConfig, m: str, add: Add) -> None:
        """Each token's experts: the table instead of a score bias."""
        add(f"{m}.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "tid2eid")

    def router_type(self, cfg: MoeConfig) -> str:
        return f"{cfg.spec.prefix}HashRouter"

    gguf_keys = {
        "hash_layers": lambda w, c, n: w.add_uint32(f"{w.arch}.hash_layer_count", len(c.hash_layers)),
    }


MECHANISM = HashRouting()
