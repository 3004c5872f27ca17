"""Hyper-connections: the Sinkhorn maths that mixes a layer's residual streams around each block, shared by
GLM-5-Next (parameters on the decoder layer) and DeepSeek-V4 (``attn_hc`` / ``ffn_hc`` modules)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
