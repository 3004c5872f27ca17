"""Hyper-connections (spec ``config.hyper_connections``): ``hc_mult`` residual streams mixed around each block by
Sinkhorn-normalised weights; GLM-5-Next keeps the weights on the decoder layer under the release's names
(``hc_attn_fn``, ...), DeepSeek-V4 in modules of their own (``attn_hc`` / ``ffn_hc``, and ``hc_head`` reading the
streams into the final norm). Its part of the config is ``MoeConfig.residual`` (:class:`HyperConnectionDims`,
parsed here by :func:`parse`). Torch: ``model/hyper.py`` (the maths), ``model/compressed.py`` (the modules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, MechanismBase, ParseContext, Parsed, ParseStep, layer_prefix
from ktconvert.errors import InputError

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


@dataclass(frozen=True)
class HyperConnectionDims:
    """Hyper-connection residual streams (``hc_mult``), their Sinkhorn normalisation and how the final norm reads
    them (spec ``config.hyper_connections``: ``mean_head`` GLM-5-Next, ``learned_head`` DeepSeek-V4's ``hc_head``)."""

    mult: int
    sinkhorn_iters: int
    eps: float
    head: str = "mean_head"

    @property
    def modules(self) -> bool:
        """Held in modules of their own (``attn_hc`` / ``ffn_hc`` per layer, ``hc_head``: spec ``learned_head``,
        DeepSeek-V4's tree); ``mean_head`` keeps the weights on the layer and has no head."""
        return self.head == "learned_head"


def parse(ctx: ParseContext) -> Parsed | None:
    """The residual streams of a hyper-connection family (spec ``config.hyper_connections``, how the final norm reads
    them; transformers' defaults: 4 streams, 20 iterations)."""
    head = ctx.config_spec.get("hyper_connections")
    if not head:
        return None
    g, path = ctx.g, ctx.path
    dims = HyperConnectionDims(mult=int(g.opt("hc_mult", 4)), sinkhorn_iters=int(g.opt("hc_sinkhorn_iters", 20)),
                               eps=float(g.opt("hc_eps", 1e-6)), head=head)
    if dims.mult < 1 or dims.sinkhorn_iters < 1:
        raise InputError(f"hc_mult ({dims.mult}) and hc_sinkhorn_iters ({dims.sinkhorn_iters}) must be positive",
                         path=path, where="hc_mult")
    if not dims.eps > 0:
        raise InputError(f"hc_eps must be above 0, got {dims.eps}", path=path, where="hc_eps",
                         fix="set hc_eps as the release does (1e-6)")
    return {"residual": dims}


class HyperConnections(MechanismBase):
    name = "hyper_connections"
    parsers = (ParseStep(50, parse),)
    count_limits = {"hc_mult": (1, 64), "hc_sinkhorn_iters": (1, 1024)}

    def before_attention(self, cfg: MoeConfig) -> bool:
        """The release's layer parameters come before the attention's tensors; transformers' modules after them."""
        return not cfg.residual.modules

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        hc, h, p = cfg.residual, cfg.hidden_size, layer_prefix(layer)
        size = (2 + hc.mult) * hc.mult
        if cfg.residual.modules:
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
        if cfg.residual.modules:
            hc, h = cfg.residual, cfg.hidden_size
            add("model.hc_head.hc_fn", (hc.mult, hc.mult * h), "linear")
            add("model.hc_head.hc_base", (hc.mult,), "bias")
            add("model.hc_head.hc_scale", (1,), "norm")

    def layer_modules(self, node, cfg: MoeConfig) -> None:
        if cfg.residual.modules:
            node.add("attn_hc", f"{cfg.spec.prefix}HyperConnection")
            node.add("ffn_hc", f"{cfg.spec.prefix}HyperConnection")

    def model_modules(self, node, cfg: MoeConfig) -> None:
        if cfg.residual.modules:
            node.add("hc_head", f"{cfg.spec.prefix}HyperHead", layer=None, dense=False)

    gguf_keys = {
        "hyper_connections": lambda w, c, n: (
            w.add_uint32(f"{w.arch}.hyper_connection.count", c.residual.mult),
            w.add_uint32(f"{w.arch}.hyper_connection.sinkhorn_iterations", c.residual.sinkhorn_iters),
            w.add_float32(f"{w.arch}.hyper_connection.epsilon", c.residual.eps)),
        # the width of the hyper-connection streams a DeepSeek-V4 head reads (hidden_size * hc_mult)
        "embedding_length_out": lambda w, c, n: w.add_embedding_length_out(c.hidden_size * c.residual.mult),
    }


MECHANISM = HyperConnections()
