"""Hyper-connections (``ktconvert/arch/hyper_connections.py``): the Sinkhorn maths that mixes a layer's residual
streams around each block, shared by GLM-5-Next (parameters on the decoder layer) and DeepSeek-V4 (``attn_hc`` /
``ffn_hc`` modules and the ``hc_head``), and :class:`HyperStreams`, the residual stream the reference model and its
executor run with such a model (``ktconvert/model/mechanisms.py`` registers it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ktconvert.families.config import MoeConfig
from ktconvert.model.modules import Tagged


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)``, no weight: how the streams are normalised before their mixing weights (and DeepSeek-V4's q)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hyper_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, dims, norm_eps: float):
    """Manifold-constrained hyper-connections around one block (GLM-5-Next's ``hc_attn_*`` / ``hc_ffn_*``,
    DeepSeek-V4's ``attn_hc`` / ``ffn_hc``): ``(post [B, T, N], comb [B, T, N, N], block input [B, T, H])``.

    From the ``N = dims.mult`` residual streams ``x [B, T, N, H]`` (flattened, RMS-normalised without weight) one
    linear map ``fn`` gives, after ``* scale + base``: ``pre = sigmoid(.) + eps`` (the block's input is the
    ``pre``-weighted sum of the streams), ``post = 2 sigmoid(.)`` (how much of the block's output each stream gets) and
    ``comb`` (softmax rows + eps, then Sinkhorn-normalised so the streams mix without growing); float32 as
    transformers. :func:`hyper_residual` gives the new streams. One function for both families, whose parameters sit
    where each upstream module tree has them.
    """
    b, t = streams.shape[:2]
    n, eps = dims.mult, dims.eps
    flat = unweighted_rms_norm(streams.reshape(b, t, -1).float(), norm_eps)
    mixed = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    comb_w = comb_w.view(*comb_w.shape[:-1], n, n)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(dims.sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
    return post, comb, collapsed


def hyper_residual(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block: ``post`` spreads its output, ``comb`` (transposed) mixes the old streams."""
    dtype = block_out.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperConnection(Tagged, nn.Module):
    """DeepSeek-V4's ``attn_hc`` / ``ffn_hc``: the parameters of :func:`~ktconvert.model.hyper.hyper_mix` as a
    module of their own, where transformers' tree has one; returns ``post, comb, collapsed``."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.dims, self.norm_eps = cfg.residual, cfg.rms_norm_eps
        n = self.dims.mult
        size = (2 + n) * n
        self.fn = nn.Parameter(torch.zeros(size, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros(size))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hyper_mix(streams, self.fn, self.base, self.scale, self.dims, self.norm_eps)


class HyperHead(Tagged, nn.Module):
    """The final collapse of the streams before the model's norm (``hc_head``)."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        d = cfg.residual
        self.hc_eps, self.norm_eps = d.eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(d.mult, d.mult * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(d.mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


class HyperStreams:
    """The residual as ``hc_mult`` streams: the embedding widened to them, each block's input mixed from them and its
    output spread back (:func:`hyper_mix`, :func:`hyper_residual`), and one hidden state read from them for the
    records (their mean) and before the final norm (the mean, or DeepSeek-V4's learned ``hc_head``)."""

    def __init__(self, cfg: MoeConfig):
        self.cfg, self.dims, self.norm_eps = cfg, cfg.residual, cfg.rms_norm_eps

    def attach(self, layer: nn.Module) -> None:
        """The mixing weights on a decoder layer: modules of their own (``attn_hc`` / ``ffn_hc``) as transformers'
        tree has them, else parameters under the checkpoint's names (``hc_attn_fn``, ...)."""
        cfg = self.cfg
        if cfg.residual.modules:
            layer.attn_hc = HyperConnection(cfg)
            layer.ffn_hc = HyperConnection(cfg)
            return
        width = (2 + self.dims.mult) * self.dims.mult
        for part in ("attn", "ffn"):
            setattr(layer, f"hc_{part}_fn", nn.Parameter(torch.zeros(width, self.dims.mult * cfg.hidden_size)))
            setattr(layer, f"hc_{part}_base", nn.Parameter(torch.zeros(width)))
            setattr(layer, f"hc_{part}_scale", nn.Parameter(torch.ones(3)))

    def attach_model(self, model: nn.Module) -> None:
        """The learned head over the streams (``hc_head``) where the model has one."""
        if self.cfg.residual.modules:
            model.hc_head = HyperHead(self.cfg)

    def widen(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]`` -> ``[B, T, N, H]``: every stream starts as the embedding."""
        return hidden.unsqueeze(2).expand(-1, -1, self.dims.mult, -1).contiguous()

    def around(self, layer: nn.Module, part: str, streams: torch.Tensor, block) -> torch.Tensor:
        """The streams after ``block`` (the attention, ``attn``, or the MLP, ``ffn``) of ``layer``."""
        module = getattr(layer, f"{part}_hc", None)
        if module is not None:
            post, comb, x = module(streams)
        else:
            fn, base, scale = (getattr(layer, f"hc_{part}_{w}") for w in ("fn", "base", "scale"))
            post, comb, x = hyper_mix(streams, fn, base, scale, self.dims, self.norm_eps)
        return hyper_residual(streams, block(x), post, comb)

    def collapse(self, hidden: torch.Tensor) -> torch.Tensor:
        """A layer's output as recorded: the streams' mean (as the goldens record it)."""
        return hidden.mean(dim=2)

    def final(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """What the final norm reads: GLM-5-Next the streams' unweighted mean, DeepSeek-V4 its ``hc_head``."""
        return model.hc_head(hidden) if self.cfg.residual.modules else hidden.mean(dim=2)
