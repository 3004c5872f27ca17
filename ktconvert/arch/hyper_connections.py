"""Hyper-connections (spec ``config.hyper_connections``): ``hc_mult`` residual streams mixed around each block by
Sinkhorn-normalised weights; GLM-5-Next keeps the weights on the decoder layer under the release's names
(``hc_attn_fn``, ...), DeepSeek-V4 in modules of their own (``attn_hc`` / ``ffn_hc``, and ``hc_head`` reading the
streams into the final norm). Torch: ``model/hyper.py`` (the maths), ``model/compressed.py`` (the modules)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, layer_prefix

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


class HyperConnections:
    name = "hyper_connections"

    def before_attention(self, cfg: MoeConfig) -> bool:
        """The release's layer parameters come before the attention's tensors; transformers' modules after them."""
        return not cfg.hc_modules

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        hc, h, p = cfg.hyper_connections, cfg.hidden_size, layer_prefix(layer)
        size = (2 + hc.mult) * hc.mult
        if cfg.hc_modules:
            for module in ("attn_hc", "ffn_hc"):
                add(f"{p}.{module}.fn", (size, hc.mult * h), "linear")
                add(f"{p}.{module}.base", (size,), "bias")
                add(f"{p}.{module}.scale", (3,), "norm")
            return
        for part in ("attn", "ffn"):  # the releases' names (transformers renames them attn_hc.fn, ...)
            add(f"{p}.hc_{part}_fn", (size, hc.mult * h), "linear")
            add(f"{p}.hc_{part}_base", (size,), "bias")
            add(f"{p}.hc_{part}_scale", (3,), "norm")

    def model_tensors(self, cfg: MoeConfig, add: Add) -> None:
        """After the final norm: the learned head that reads the streams (none for the streams' mean)."""
        if cfg.hc_modules:
            hc, h = cfg.hyper_connections, cfg.hidden_size
            add("model.hc_head.hc_fn", (hc.mult, hc.mult * h), "linear")
            add("model.hc_head.hc_base", (hc.mult,), "bias")
            add("model.hc_head.hc_scale", (1,), "norm")

    def layer_modules(self, node, cfg: MoeConfig) -> None:
        if cfg.hc_modules:
            node.add("attn_hc", f"{cfg.spec.prefix}HyperConnection")
            node.add("ffn_hc", f"{cfg.spec.prefix}HyperConnection")

    def model_modules(self, node, cfg: MoeConfig) -> None:
        if cfg.hc_modules:
            node.add("hc_head", f"{cfg.spec.prefix}HyperHead", layer=None, dense=False)

    gguf_keys = {
        "hyper_connections": lambda w, c, n: (
            w.add_uint32(f"{w.arch}.hyper_connection.count", c.hyper_connections.mult),
            w.add_uint32(f"{w.arch}.hyper_connection.sinkhorn_iterations", c.hyper_connections.sinkhorn_iters),
            w.add_float32(f"{w.arch}.hyper_connection.epsilon", c.hyper_connections.eps)),
        # the width of the hyper-connection streams a DeepSeek-V4 head reads (hidden_size * hc_mult)
        "embedding_length_out": lambda w, c, n: w.add_embedding_length_out(c.hidden_size * c.hyper_connections.mult),
    }


MECHANISM = HyperConnections()
