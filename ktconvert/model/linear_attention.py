"""Gated DeltaNet linear attention (Qwen3-Next's ``linear_attention`` layers), in plain torch.

Per token ``t`` and value head: queries and keys are L2-normalised (queries also scaled by ``1/sqrt(d_k)``), the
head's state ``S [d_k, d_v]`` decays by ``exp(g_t)`` with ``g_t = -exp(A_log) * softplus(a_t + dt_bias)``, then
takes the delta-rule write ``S += k_t (beta_t (v_t - S^T k_t))^T`` with ``beta_t = sigmoid(b_t)``; the output is
``S^T q_t``. Before that, q/k/v pass a depthwise causal convolution (kernel ``conv_kernel``) and SiLU; after it,
a gated RMSNorm (``norm(o) * silu(z)``) and ``out_proj``. Projections are grouped per key head as transformers
lays them out (``in_proj_qkvz``: per key head q, k, then its value heads' v and z; ``in_proj_ba`` likewise).

This computes the recurrence token by token for prefill and decode alike, so one code path holds the maths;
transformers' CPU fallback computes prefill in chunks of 64 (the same sums, reassociated) and decode with the
same recurrence. The parameter names are transformers', so its state dict loads as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last axis, then times ``silu(gate)`` (gate in float32), back to the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.to(torch.float32))).to(dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; ``forward(hidden [B, T, H], state)`` where ``state`` is a dict this module
    fills (``conv``: the last ``conv_kernel - 1`` convolution inputs, ``recurrent``: ``S [B, v_heads, d_k, d_v]``)
    and continues from, or ``None`` for a stateless pass."""

    def __init__(self, hidden: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, conv_kernel: int, eps: float):
        super().__init__()
        if v_heads % k_heads:
            raise ValueError(f"linear_num_value_heads={v_heads} is not a multiple of linear_num_key_heads={k_heads}")
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = k_heads, v_heads, k_dim, v_dim
        self.conv_kernel = conv_kernel
        self.key_size, self.value_size = k_heads * k_dim, v_heads * v_dim
        conv_dim = 2 * self.key_size + self.value_size
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_size + 2 * self.value_size, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=False, padding=conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(v_heads))
        self.A_log = nn.Parameter(torch.zeros(v_heads))
        self.norm = GatedRMSNorm(v_dim, eps)
        self.out_proj = nn.Linear(self.value_size, hidden, bias=False)

    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """Undo the per-key-head grouping: q, k ``[B, T, k_heads*d_k]``, v, z ``[B, T, v_heads, d_v]``, b, a
        ``[B, T, v_heads]``."""
        b_, t = qkvz.shape[:2]
        per = self.v_heads // self.k_heads
        g = qkvz.view(b_, t, self.k_heads, -1)
        q, k, v, z = torch.split(g, [self.k_dim, self.k_dim, per * self.v_dim, per * self.v_dim], dim=-1)
        bb, aa = torch.split(ba.view(b_, t, self.k_heads, 2 * per), [per, per], dim=-1)
        return (q.reshape(b_, t, -1), k.reshape(b_, t, -1), v.reshape(b_, t, self.v_heads, self.v_dim),
                z.reshape(b_, t, self.v_heads, self.v_dim), bb.reshape(b_, t, self.v_heads), aa.reshape(b_, t, self.v_heads))

    def _conv(self, x: torch.Tensor, state: dict | None) -> torch.Tensor:
        """Depthwise causal convolution + SiLU of ``x [B, C, T]``, continuing from ``state['conv']``."""
        keep = self.conv_kernel - 1
        past = state.get("conv") if state is not None else None
        if past is None:
            past = x.new_zeros(x.shape[0], x.shape[1], keep)
        full = torch.cat([past, x], dim=-1)
        if state is not None:
            state["conv"] = full[:, :, -keep:]
        y = F.conv1d(full, self.conv1d.weight, None, groups=full.shape[1])
        return F.silu(y[:, :, -x.shape[-1]:])

    def forward(self, hidden: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        dtype = hidden.dtype
        q, k, v, z, b, a = self._split(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))
        b_, t = hidden.shape[:2]
        mixed = self._conv(torch.cat([q, k, v.reshape(b_, t, -1)], dim=-1).transpose(1, 2), state).transpose(1, 2)
        q, k, v = torch.split(mixed, [self.key_size, self.key_size, self.value_size], dim=-1)
        per = self.v_heads // self.k_heads
        # [B, v_heads, T, d]: each key head serves its `per` consecutive value heads
        q = q.reshape(b_, t, self.k_heads, self.k_dim).repeat_interleave(per, dim=2).transpose(1, 2).float()
        k = k.reshape(b_, t, self.k_heads, self.k_dim).repeat_interleave(per, dim=2).transpose(1, 2).float()
        v = v.reshape(b_, t, self.v_heads, self.v_dim).transpose(1, 2).float()
        q = _l2norm(q) / (self.k_dim ** 0.5)
        k = _l2norm(k)
        beta = b.sigmoid().float().transpose(1, 2)  # [B, v_heads, T]
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)).transpose(1, 2)
        s = state.get("recurrent") if state is not None else None
        if s is None:
            s = v.new_zeros(b_, self.v_heads, self.k_dim, self.v_dim)
        out = torch.empty_like(v)
        for i in range(t):
            s = s * g[:, :, i].exp()[..., None, None]
            kt = k[:, :, i]
            delta = (v[:, :, i] - (s * kt[..., None]).sum(dim=-2)) * beta[:, :, i, None]
            s = s + kt[..., None] * delta[..., None, :]
            out[:, :, i] = (s * q[:, :, i, :, None]).sum(dim=-2)
        if state is not None:
            state["recurrent"] = s
        out = out.transpose(1, 2).to(dtype)  # [B, T, v_heads, d_v]
        out = self.norm(out.reshape(-1, self.v_dim), z.reshape(-1, self.v_dim)).reshape(b_, t, -1)
        return self.out_proj(out)
