"""Linear-attention layers of the hybrid families: Gated DeltaNet (Qwen3-Next, Qwen3.5-MoE) and Kimi Delta Attention
(GLM-5-Next), each with its gated output norm. A module of their own: they share only the recurrence's shape with
each other and nothing with softmax attention in ``modules``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ktconvert.families.config import MoeConfig
from ktconvert.model.modules import KVCache, Tagged


class KimiDeltaAttention(Tagged, nn.Module):
    """Kimi Delta Attention (GLM-5-Next's ``linear_attention`` layers, held in ``self_attn``), as its per-token
    recurrence (transformers runs prefill chunk-wise; the two agree to float32 rounding).

    ``q/k/v_proj`` -> per projection a causal depthwise conv (``q/k/v_conv1d``, kernel ``short_conv_kernel_size``) +
    SiLU -> heads; q and k L2-normalised (q also by 1/sqrt(d)). A per-channel decay ``g = lower_bound *
    sigmoid(exp(A_log) * (f_b_proj(f_a_proj(x)) + dt_bias))`` (without a lower bound ``-exp(A_log) * softplus(.)``),
    a step ``beta = sigmoid(b_proj(x))``; per head the state ``S [d, d]`` runs ``S <- S * exp(g)`` (row-wise),
    ``S <- S + k (beta (v - S^T k))^T``, ``o = S^T q``; then ``o_norm(o, g_b_proj(g_a_proj(x)))`` and ``o_proj``.
    Parameters carry the releases' flat names. The cache holds each conv's last ``kernel - 1`` inputs and ``S``.
    """

    def __init__(self, cfg: MoeConfig, layer_idx: int):
        super().__init__()
        d = cfg.attention.kda
        self.layer_idx = layer_idx
        self.nh, self.dh, self.kernel, self.lower_bound = d.num_heads, d.head_dim, d.conv_kernel, d.lower_bound
        h, dim = cfg.hidden_size, d.num_heads * d.head_dim
        self.q_proj = nn.Linear(h, dim, bias=False)
        self.k_proj = nn.Linear(h, dim, bias=False)
        self.v_proj = nn.Linear(h, dim, bias=False)
        self.q_conv1d = nn.Conv1d(dim, dim, self.kernel, groups=dim, bias=False)
        self.k_conv1d = nn.Conv1d(dim, dim, self.kernel, groups=dim, bias=False)
        self.v_conv1d = nn.Conv1d(dim, dim, self.kernel, groups=dim, bias=False)
        self.f_a_proj = nn.Linear(h, d.head_dim, bias=False)
        self.f_b_proj = nn.Linear(d.head_dim, dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(dim))
        self.A_log = nn.Parameter(torch.zeros(d.num_heads))
        self.b_proj = nn.Linear(h, d.num_heads, bias=False)
        self.g_a_proj = nn.Linear(h, d.head_dim, bias=False)
        self.g_b_proj = nn.Linear(d.head_dim, dim, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(d.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(dim, h, bias=False)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = hidden.shape
        dtype = hidden.dtype
        state = cache.layers.get(self.layer_idx) if cache is not None else None
        windows, convs = [], []
        for i, (proj, conv) in enumerate(((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d),
                                          (self.v_proj, self.v_conv1d))):
            x = proj(hidden).transpose(1, 2)  # [B, C, T]
            window = state[i] if state else x.new_zeros(b, x.shape[1], self.kernel - 1)
            padded = torch.cat([window, x], dim=-1)
            windows.append(padded[..., padded.shape[-1] - (self.kernel - 1):])
            convs.append(F.silu(F.conv1d(padded, conv.weight, groups=x.shape[1])).transpose(1, 2))
        q, k, v = (c.reshape(b, t, self.nh, self.dh).float() for c in convs)
        q = _l2norm_div(q) * self.dh**-0.5
        k = _l2norm_div(k)
        f = (self.f_b_proj(self.f_a_proj(hidden)).float() + self.dt_bias.float()).view(b, t, self.nh, self.dh)
        rate = self.A_log.float().exp().view(1, 1, self.nh, 1)
        if self.lower_bound is not None:
            g = self.lower_bound * torch.sigmoid(rate * f)
        else:
            g = -rate * torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))
        beta = torch.sigmoid(self.b_proj(hidden)).float()
        s = state[3] if state else q.new_zeros(b, self.nh, self.dh, self.dh)
        outs = []
        for i in range(t):
            s = s * g[:, i].exp()[..., None]
            k_i = k[:, i]
            delta = (v[:, i] - (s * k_i[..., None]).sum(-2)) * beta[:, i, :, None]
            s = s + k_i[..., None] * delta[..., None, :]
            outs.append((s * q[:, i][..., None]).sum(-2))
        if cache is not None:
            cache.replace(self.layer_idx, *windows, s)
        o = torch.stack(outs, dim=1).to(dtype)  # [B, T, nh, dh]
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(b, t, self.nh, self.dh)
        return self.o_proj(self.o_norm(o, gate).reshape(b, t, -1))


def _l2norm_div(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` (transformers' KDA l2norm: a division, matching FLA's kernel)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedRMSNorm(Tagged, nn.Module):
    """Gated DeltaNet's output norm: ``weight * x / rms(x) * silu(gate)`` (plain weight, not zero-centred)."""

    hf_role = "gated_rmsnorm"  # either gate (silu or sigmoid)

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def _normalised(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        return (self.weight * self._normalised(x).to(dtype) * F.silu(gate.to(torch.float32))).to(dtype)


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """Kimi Delta Attention's output norm: ``weight * x / rms(x) * sigmoid(gate)``, all in float32 (transformers'
    ``Glm5NextTextRMSNormGated``, which unlike Gated DeltaNet's keeps the weight in float32 and gates by sigmoid)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self._normalised(x) * torch.sigmoid(gate.to(torch.float32))).to(x.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(Tagged, nn.Module):
    """Gated DeltaNet linear attention (Qwen3.5's and Qwen3-Next's ``linear_attn``), written as its per-token recurrence.

    q, k, v rows (``[q heads, k heads, v heads]``) -> causal depthwise conv (kernel ``linear_conv_kernel_dim``) + SiLU
    -> q, k, v heads; q and k L2-normalised (q also by 1/sqrt(d_k)) and repeated over the value heads of their group;
    per value head a decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and a step ``beta = sigmoid(b)``; the state
    ``S [d_k, d_v]`` runs ``S <- S * exp(g); S <- S + k (beta (v - S^T k))^T; o = S^T q``; then ``norm(o, z)`` and
    ``out_proj``. transformers computes the same recurrence chunk-wise for prefill; the two agree to float32 rounding.
    The cache holds the last ``kernel - 1`` conv inputs and ``S``.

    The spec's ``attention.linear_packing`` says how the input projections are stored: ``split`` (Qwen3.5:
    ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) or ``grouped`` (Qwen3-Next: ``in_proj_qkvz`` holding
    per key head its q, k, value-head and z rows, ``in_proj_ba`` per key head its b then a rows), unpacked as
    transformers' ``fix_query_key_value_ordering`` does; the maths after the projections is the same.
    """

    def __init__(self, cfg: MoeConfig, layer_idx: int):
        super().__init__()
        d = cfg.attention.linear
        self.layer_idx = layer_idx
        self.nk, self.nv, self.dk, self.dv = d.num_key_heads, d.num_value_heads, d.key_head_dim, d.value_head_dim
        self.kernel = d.conv_kernel
        h = cfg.hidden_size
        key_dim, value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        self.grouped = cfg.spec.linear_packing == "grouped"
        if self.grouped:
            self.in_proj_qkvz = nn.Linear(h, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * self.nv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(h, value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, self.nv, bias=False)
            self.in_proj_a = nn.Linear(h, self.nv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, h, bias=False)

    def projections(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(qkv [B, T, conv_dim], z [B, T, nv * dv], b [B, T, nv], a [B, T, nv])``, value heads grouped by key head."""
        if not self.grouped:
            return self.in_proj_qkv(hidden), self.in_proj_z(hidden), self.in_proj_b(hidden), self.in_proj_a(hidden)
        bsz, t, _ = hidden.shape
        per = self.nv // self.nk
        qkvz = self.in_proj_qkvz(hidden).view(bsz, t, self.nk, 2 * self.dk + 2 * per * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, per * self.dv, per * self.dv], dim=-1)
        ba = self.in_proj_ba(hidden).view(bsz, t, self.nk, 2 * per)
        beta, alpha = torch.split(ba, [per, per], dim=-1)
        qkv = torch.cat([x.reshape(bsz, t, -1) for x in (q, k, v)], dim=-1)
        return qkv, z.reshape(bsz, t, -1), beta.reshape(bsz, t, self.nv), alpha.reshape(bsz, t, self.nv)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = hidden.shape
        dtype = hidden.dtype
        state = cache.layers.get(self.layer_idx) if cache is not None else None
        qkv, z, b_in, a_in = self.projections(hidden)
        x = qkv.transpose(1, 2)  # [B, C, T]
        window = state[0] if state else x.new_zeros(b, self.conv_dim, self.kernel - 1)
        padded = torch.cat([window, x], dim=-1)
        mixed = F.silu(F.conv1d(padded, self.conv1d.weight, groups=self.conv_dim)).transpose(1, 2)
        key_dim = self.nk * self.dk
        q, k, v = torch.split(mixed, [key_dim, key_dim, self.nv * self.dv], dim=-1)
        rep = self.nv // self.nk
        q = q.reshape(b, t, self.nk, self.dk).repeat_interleave(rep, dim=2).float()
        k = k.reshape(b, t, self.nk, self.dk).repeat_interleave(rep, dim=2).float()
        v = v.reshape(b, t, self.nv, self.dv).float()
        q = _l2norm(q) * self.dk**-0.5
        k = _l2norm(k)
        beta = torch.sigmoid(b_in).float()
        g = -self.A_log.float().exp() * F.softplus(a_in.float() + self.dt_bias)
        s = state[1] if state else q.new_zeros(b, self.nv, self.dk, self.dv)
        outs = []
        for i in range(t):
            s = s * g[:, i].exp()[..., None, None]
            k_i = k[:, i]
            delta = (v[:, i] - (s * k_i[..., None]).sum(-2)) * beta[:, i, :, None]
            s = s + k_i[..., None] * delta[..., None, :]
            outs.append((s * q[:, i][..., None]).sum(-2))
        if cache is not None:
            cache.replace(self.layer_idx, padded[..., padded.shape[-1] - (self.kernel - 1):], s)
        o = torch.stack(outs, dim=1).to(dtype)  # [B, T, nv, dv]
        z = z.reshape(b, t, self.nv, self.dv)
        o = self.norm(o.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(b, t, -1)
        return self.out_proj(o)
