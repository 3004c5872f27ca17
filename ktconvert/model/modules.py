"""Plain-torch building blocks of the reference MoE models.

Numerics follow transformers 5 (the goldens' producer) operation by operation where the order of float
operations matters at 1e-5; where upstream implementations disagree the choice is said in the docstring.
Router, shared experts and routed experts are separate modules with narrow contracts, so an injected
operator can replace one of them without touching the others:

* a Qwen/Mixtral ``gate`` is an ``nn.Linear`` (router logits); the block turns logits into top-k;
* a DeepSeek ``gate`` (``MoEGate``) maps hidden states to ``(topk_ids, topk_weights)``;
* ``experts`` maps ``(hidden [N, H], topk_ids [N, K], topk_weights [N, K])`` to ``[N, H]``.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from ktconvert.families.config import MoeConfig, RopeSpec


class Tagged:
    """Mixin: the upstream class names a module stands for (see :mod:`ktconvert.model.hfnames`)."""

    hf_class: str | None = None
    hf_class_paths: tuple[str, ...] = ()
    #: the role ``hfnames.class_names`` names a module of this class by, wherever it sits inside a mechanism (None:
    #: its place gives the role, see ``ktconvert/model/reference.py``)
    hf_role: str | None = None


class RMSNorm(Tagged, nn.Module):
    """``weight * x / rms(x)``; ``zero_centered`` (spec ``config.rms_norm``): ``(1 + weight) * ...`` in float32, the
    weight stored around 0 (Qwen3-Next / Qwen3.5)."""

    hf_role = "rmsnorm"

    def __init__(self, size: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(size) if zero_centered else torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


def rms_norm(cfg: MoeConfig, size: int) -> RMSNorm:
    """The family's RMSNorm of ``size`` (plain or zero-centred, per its spec)."""
    return RMSNorm(size, cfg.rms_norm_eps, cfg.spec.zero_centered_norm)


def rope_frequencies(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (YaRN's attention factor) for ``spec``."""
    dim, base = spec.dim, spec.theta
    if spec.kind in ("default", "linear"):
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        return (inv / spec.factor if spec.kind == "linear" else inv), 1.0
    if spec.kind != "yarn":
        raise ValueError(f"rope kind {spec.kind!r}")
    factor = spec.factor

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = spec.attention_factor
    if attention_factor is None:
        if spec.mscale and spec.mscale_all_dim:
            attention_factor = float(get_mscale(factor, spec.mscale) / get_mscale(factor, spec.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    omax = spec.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(omax / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def softmax_scale(head_dim: int, spec: RopeSpec) -> float:
    """DeepSeek's attention scale: YaRN multiplies 1/sqrt(d) by mscale(factor, mscale_all_dim) squared."""
    scale = head_dim**-0.5
    if spec.kind != "default" and spec.mscale_all_dim:
        m = 1.0 if spec.factor <= 1 else 0.1 * spec.mscale_all_dim * math.log(spec.factor) + 1.0
        scale = scale * m * m
    return scale


class RotaryEmbedding(Tagged, nn.Module):
    """cos/sin tables for the given positions; one per attention module, as in ktransformers' model trees."""

    def __init__(self, spec: RopeSpec):
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(spec)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def freqs_cis(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The same table as unit complex numbers ``[B, T, dim / 2]`` (DeepSeek-V2's formulation)."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=position_ids.device, dtype=torch.float)
        return torch.polar(torch.ones_like(freqs), freqs) * self.attention_scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q, k, cos, sin):
    """Rotate-half rope; a table narrower than the head rotates its leading dims only (partial_rotary_factor)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r < q.shape[-1]:
        (q, q_pass), (k, k_pass) = q.split([r, q.shape[-1] - r], -1), k.split([r, k.shape[-1] - r], -1)
        return (torch.cat([q * cos + _rotate_half(q) * sin, q_pass], -1),
                torch.cat([k * cos + _rotate_half(k) * sin, k_pass], -1))
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def apply_rope_interleaved(q, k, cos, sin):
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's rope layout); output de-interleaved
    (evens, then odds), as transformers 5's DeepSeek-V3 path. Queries and keys share the layout."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    return (
        torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
        torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1),
    )


def apply_rope_complex(q, k, freqs_cis):
    """The same rotation as a complex product with the output left in pairs: transformers 5's DeepSeek-V2
    path, reproduced operation for operation (``torch.polar`` tables included, whose last bit can differ
    from ``cos``/``sin``) so the two agree to the bit rather than to rounding."""
    freqs = freqs_cis.unsqueeze(1)

    def rotate(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)

    return rotate(q), rotate(k)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, *, window: int | None = None,
           sinks: torch.Tensor | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Eager causal attention. ``q [B, h, T, d]`` are the last T positions of keys ``[B, kv, S, d]``.

    ``window``: a query sees only the last ``window`` positions (itself included), as transformers' sliding
    mask and llama.cpp's standard SWA. ``sinks [h]``: one extra logit per head joins the softmax and is dropped
    after it, so the weights of the real keys sum to less than one (gpt-oss; max-subtracted as transformers).
    ``allowed [B, T, S]`` (a sparse-attention selection) masks every other key as well; ``allowed [B, kv, T, S]``
    selects per KV group (every query head of a group sees its group's selection).
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    t, s = q.shape[2], k.shape[2]
    qpos = torch.arange(t, device=q.device) + (s - t)
    kpos = torch.arange(s, device=q.device)[None, :]
    hidden = kpos > qpos[:, None]
    if window is not None:
        hidden = hidden | (qpos[:, None] - kpos >= window)
    if hidden.any():
        w = w.masked_fill(hidden, float("-inf"))
    if allowed is not None:
        allowed = allowed[:, None] if allowed.dim() == 3 else allowed.repeat_interleave(groups, dim=1)
        w = w.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        w = torch.cat([w, sinks.reshape(1, -1, 1, 1).expand(w.shape[0], -1, t, 1).to(w.dtype)], dim=-1)
        w = w - w.max(dim=-1, keepdim=True).values
        w = F.softmax(w, dim=-1, dtype=w.dtype)[..., :-1].to(q.dtype)
    else:
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(w, v).transpose(1, 2).contiguous()
    return out.reshape(out.shape[0], out.shape[1], -1)


class KVCache:
    """Per-layer cached tensors, concatenated along the sequence axis (dim 2).

    Standard attention caches rotated keys and values; MLA caches its compressed latent and the shared
    rotated key, as transformers does, so decode recomputes ``kv_b_proj`` over the whole history.
    """

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, ...]] = {}
        self.seq_len = 0

    def replace(self, layer_idx: int, *state: torch.Tensor) -> None:
        """Recurrent layers keep a fixed-size state (conv window, DeltaNet matrix) replaced each step."""
        self.layers[layer_idx] = state

    def drop(self, layer_idx: int) -> None:
        """Forget layer ``layer_idx``'s entries (its own and its indexer's, ``("dsa", L)`` ...): a layer-major run
        drops a layer's cache once every position has gone through the layer."""
        for key in [k for k in self.layers if k == layer_idx or (isinstance(k, tuple) and k[-1] == layer_idx)]:
            del self.layers[key]

    def update(self, layer_idx: int, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        old = self.layers.get(layer_idx)
        merged = new if old is None else tuple(torch.cat((a, b), dim=2) for a, b in zip(old, new))
        self.layers[layer_idx] = merged
        return merged


class Attention(Tagged, nn.Module):
    """Grouped-query attention (Qwen2-MoE, Qwen3-MoE with per-head q/k norms, Mixtral; Qwen3.5's output gate); with
    partial rotary (GLM-4.5: ``partial_rotary_factor``) rope turns the first ``rope.dim`` dims of each head."""

    def __init__(self, cfg: MoeConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias_on
        self.output_gate = cfg.spec.attention.output_gate
        self.q_proj = nn.Linear(h, nh * hd * (2 if self.output_gate else 1), bias="q_proj" in bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias="k_proj" in bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias="v_proj" in bias)
        self.o_proj = nn.Linear(nh * hd, h, bias="o_proj" in bias)
        # head scope: one norm of head_dim shared by the heads; projection scope (MiniMax-M2): one norm over the
        # whole q / k projection, applied before the split into heads
        self.qk_norm_whole = cfg.spec.attention.qk_norm_whole
        if cfg.attention.qk_norm:
            self.q_norm = rms_norm(cfg, nh * hd if self.qk_norm_whole else hd)
            self.k_norm = rms_norm(cfg, nkv * hd if self.qk_norm_whole else hd)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = RotaryEmbedding(cfg.rope)
        self.rope_dim = cfg.rope.dim
        self.scaling = hd**-0.5
        self.window = cfg.attention.sliding_window if layer_idx in cfg.attention.sliding_layers else None
        if cfg.spec.attention.sinks:
            self.sinks = nn.Parameter(torch.zeros(nh))
        else:
            self.sinks = None
        self.msa = cfg.attention.indexer is not None and layer_idx in cfg.attention.indexer.sparse_layers
        if self.msa:  # MiniMax Sparse Attention's lightning indexer, flat in self_attn as the releases store it
            d = cfg.attention.indexer
            self.index_q_proj = nn.Linear(h, d.n_heads * d.head_dim, bias=False)
            self.index_k_proj = nn.Linear(h, d.head_dim, bias=False)
            self.index_q_norm = rms_norm(cfg, d.head_dim)
            self.index_k_norm = rms_norm(cfg, d.head_dim)
            self.index_dims = d

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = hidden.shape
        shape = (b, t, -1, self.head_dim)
        gate = None
        if self.output_gate:  # per head: its query, then its gate
            q, gate = self.q_proj(hidden).view(b, t, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, t, -1)
            q = q.reshape(b, t, -1)
        else:
            q = self.q_proj(hidden)
        k = self.k_proj(hidden)
        if self.q_norm is not None and self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.reshape(shape), k.view(shape)
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(hidden).view(shape).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        if self.rope_dim < self.head_dim:
            r = self.rope_dim
            q_rot, k_rot = apply_rope(q[..., :r], k[..., :r], cos, sin)
            q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        else:
            q, k = apply_rope(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        allowed = self.msa_blocks(hidden, cos, sin, k.shape[2] - t, cache) if self.msa else None
        out = attend(q, k, v, self.scaling, window=self.window, sinks=self.sinks, allowed=allowed)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


    def msa_blocks(self, hidden, cos, sin, past: int, cache: KVCache | None) -> torch.Tensor:
        """MiniMax Sparse Attention's selection ``allowed [B, kv, T, S]``: per indexer head (one per KV group),
        unscaled ``q . k`` over the visible keys, max-pooled into blocks of ``block_size`` keys; the
        ``local_blocks`` ending at the query's block are forced in, then the ``topk`` best blocks are kept (blocks
        with no visible key never). float32, in transformers' operation order, so ties break the same way."""
        d = self.index_dims
        b, t, _ = hidden.shape
        q = self.index_q_norm(self.index_q_proj(hidden).view(b, t, d.n_heads, d.head_dim)).transpose(1, 2)
        k = self.index_k_norm(self.index_k_proj(hidden).view(b, t, 1, d.head_dim)).transpose(1, 2)
        r = min(self.rope_dim, d.head_dim)
        q_rot, k_rot = apply_rope(q[..., :r], k[..., :r], cos[..., :r], sin[..., :r])
        q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        if cache is not None:
            k = cache.update(("msa", self.layer_idx), k)[0]
        s = k.shape[2]
        blocks = -(-s // d.block_size)
        qpos = torch.arange(t, device=hidden.device) + past
        future = torch.arange(s, device=hidden.device)[None, :] > qpos[:, None]  # [T, S]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).masked_fill(future, float("-inf"))
        scores = F.pad(scores, (0, blocks * d.block_size - s), value=float("-inf"))
        block_scores = scores.view(b, d.n_heads, t, blocks, d.block_size).amax(dim=-1)
        if d.local_blocks > 0:
            local = (qpos // d.block_size)[:, None] - torch.arange(d.local_blocks, device=hidden.device)[None, :]
            local = local.clamp(min=0).expand(b, d.n_heads, -1, -1)
            block_scores = block_scores.scatter(-1, local, float("inf"))
        top, ids = block_scores.topk(min(d.topk, blocks), dim=-1)
        keep = torch.zeros(b, d.n_heads, t, blocks + 1, dtype=torch.bool, device=hidden.device)
        keep = keep.scatter(-1, ids.masked_fill(top == float("-inf"), blocks), True)[..., :blocks]
        return keep.repeat_interleave(d.block_size, dim=-1)[..., :s] & ~future


class DsaKPoolIndexer(Tagged, nn.Module):
    """GLM-5-Next's DSA indexer over pools of ``kpool`` keys (transformers' ``Glm5NextTextIndexer``, no rope: NoPE).

    Keys ``k = LayerNorm(wk(x))`` are grouped into consecutive pools of ``kpool`` positions from the first; a complete
    pool's key is, per channel, the softmax over its positions of ``index_kpool_compress_gate(x) +
    index_kpool_compress_ape`` weighting their keys. Per query, ``relu(q_h . pool / sqrt(d))`` summed over heads with
    weights ``weights_proj(x) / sqrt(heads)`` scores the complete pools whose last key is visible; the
    ``topk / kpool`` best are attended, and (``kpool_tail``) the visible keys of the query's incomplete pool too.
    float32, in transformers' operation order, so score ties break the same way. The cache holds keys and gate
    scores; pools are rebuilt from them at every step, as transformers does.
    """

    hf_role = "indexer"

    def __init__(self, cfg: MoeConfig, layer_idx: int):
        super().__init__()
        d = cfg.attention.indexer
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim, self.topk, self.kpool, self.tail = d.n_heads, d.head_dim, d.topk, d.kpool, d.kpool_tail
        self.wq_b = nn.Linear(cfg.attention.q_lora_rank, d.n_heads * d.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, d.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(d.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, d.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(d.kpool, d.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(d.head_dim, cfg.hidden_size))

    def forward(self, hidden, q_resid, cos_sin, past: int, cache: KVCache | None = None) -> torch.Tensor:
        """``allowed [B, T, S]``: the keys each of the T queries (positions ``past ..``) keeps."""
        b, t, _ = hidden.shape
        dev = hidden.device
        q = self.wq_b(q_resid).view(b, t, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden))  # [B, T, D]
        gate = F.linear(hidden, self.index_kpool_compress_gate)
        if cache is not None:
            k, gate = (x.squeeze(1) for x in cache.update(("dsa", self.layer_idx), k.unsqueeze(1), gate.unsqueeze(1)))
        s, p = k.shape[1], self.kpool
        pools = s // p  # complete pools only
        qpos = torch.arange(t, device=dev) + past
        allowed = torch.zeros(b, t, s, dtype=torch.bool, device=dev)
        if pools:
            logits = gate[:, : pools * p].view(b, pools, p, -1).float() + self.index_kpool_compress_ape.float()
            pool_keys = (logits.softmax(dim=2).to(k.dtype) * k[:, : pools * p].view(b, pools, p, -1)).sum(dim=2)
            scores = F.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * self.head_dim**-0.5)
            weights = self.weights_proj(hidden).float() * self.n_heads**-0.5
            index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, T, pools]
            ends = torch.arange(pools, device=dev) * p + p - 1
            visible = ends[None, :] <= qpos[:, None]  # [T, pools]
            index = index.masked_fill(~visible, torch.finfo(index.dtype).min)
            ids = index.topk(min(self.topk // p, pools), dim=-1).indices
            chosen = torch.zeros(b, t, pools, dtype=torch.bool, device=dev).scatter(-1, ids, True) & visible
            allowed[..., : pools * p] = chosen.repeat_interleave(p, dim=-1)
        if self.tail:
            kpos = torch.arange(s, device=dev)
            start = (qpos + 1) - (qpos + 1) % p
            allowed |= (kpos[None, :] >= start[:, None]) & (kpos[None, :] <= qpos[:, None])
        return allowed


class MLAttention(Tagged, nn.Module):
    """DeepSeek multi-head latent attention (no weight absorption: the plain form transformers runs).

    ``latent_probe``: ``None``, or ``fn(q_nope [B, h, T, nope], latent_out [B, T, h * kv_lora_rank])`` called each
    forward with what llama.cpp's absorbed form multiplies by ``attn_k_b`` and ``attn_v_b`` (each head's query
    without rope; the attention output in the latent space, before ``kv_b_proj``'s value rows): ``ktconvert
    imatrix`` collects their squares there."""

    latent_probe = None

    def __init__(self, cfg: MoeConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = nh
        self.q_lora_rank = cfg.attention.q_lora_rank
        mla = cfg.attention.mla
        self.kv_lora_rank = mla.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, cfg.attention.qk_rope_head_dim, mla.v_head_dim
        self.qk_head_dim = self.nope + self.rope_dim
        bias = cfg.attention_bias_on
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias="q_a_proj" in bias)
            # DeepSeek's modeling code builds both latent norms with the default eps (1e-6), GLM-5-Next with
            # rms_norm_eps (the spec's attention.latent_norm_eps)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, mla.latent_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, nh * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope_dim, bias="kv_a_proj_with_mqa" in bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, mla.latent_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, h, bias="o_proj" in bias)
        # NoPE MLA (GLM-5-Next: qk_rope_head_dim 0) has no rotary module upstream
        self.rotary_emb = RotaryEmbedding(cfg.rope) if self.rope_dim else None
        self.interleave = mla.rope_interleave
        self.complex_rope = cfg.spec.attention.complex_rope  # transformers 5 V2 ignores rope_interleave
        self.scaling = softmax_scale(self.qk_head_dim, cfg.rope)
        indexer = DsaKPoolIndexer if cfg.attention.indexer is not None and cfg.attention.indexer.kpool else DsaIndexer
        own = cfg.attention.indexer is not None and layer_idx not in cfg.attention.indexer.shared_layers
        self.indexer = indexer(cfg, layer_idx) if own else None
        # a shared layer (GLM-5-Next) attends where the previous layer's indexer chose: link() points at that
        # layer's attention here (not a submodule) and it keeps its last selection for this one
        self.shares_selection = cfg.attention.indexer is not None and not own
        self.selection_source: MLAttention | None = None
        self.last_selection: torch.Tensor | None = None

    def link(self, layers: nn.ModuleList, index: int) -> None:
        """Called once the model's layers exist (``DecoderModel``): a shared layer's selection source is the previous
        layer's attention, held as a plain attribute so that it stays a module of its own layer only."""
        if self.shares_selection:
            object.__setattr__(self, "selection_source", layers[index - 1].mixer)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = hidden.shape
        q_resid = None
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
        q = q.view(b, t, -1, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [self.nope, self.rope_dim], dim=-1)
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden), [self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(b, 1, t, self.kv_lora_rank)
        k_rot = k_rot.view(b, 1, t, self.rope_dim)
        if self.rotary_emb is None:
            pass
        elif self.complex_rope:
            q_rot, k_rot = apply_rope_complex(q_rot, k_rot, self.rotary_emb.freqs_cis(position_ids))
        else:
            cos, sin = self.rotary_emb(hidden, position_ids)
            rope = apply_rope_interleaved if self.interleave else apply_rope
            q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
        if cache is not None:
            latent, k_rot = cache.update(self.layer_idx, latent, k_rot)
        s = latent.shape[2]
        kv = self.kv_b_proj(latent).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, value = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        key = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        query = torch.cat((q_nope, q_rot), dim=-1)
        allowed = None
        if self.indexer is not None:
            cos_sin = self.rotary_emb(hidden, position_ids) if self.rotary_emb is not None else None
            allowed = self.last_selection = self.indexer(hidden, q_resid, cos_sin, s - t, cache)
        elif self.selection_source is not None:
            allowed = self.selection_source.last_selection
        if self.latent_probe is not None:  # the inputs of llama.cpp's absorbed products attn_k_b and attn_v_b
            heads = latent.expand(-1, q_nope.shape[1], -1, -1)
            self.latent_probe(q_nope, attend(query, key, heads, self.scaling, allowed=allowed))
        return self.o_proj(attend(query, key, value, self.scaling, allowed=allowed))


class DsaIndexer(Tagged, nn.Module):
    """DeepSeek Sparse Attention's indexer (GLM-5, DeepSeek-V3.2): which ``index_topk`` keys each query may attend to.

    Per head ``h``: ``relu(q_h . k / sqrt(d))`` with ``q = wq_b(q_resid)`` and one shared key
    ``k = LayerNorm(wk(x))``, their first ``qk_rope_head_dim`` dims rotated in interleaved pairs (GLM-5) or in halves
    (DeepSeek-V3.2; the spec's ``attention.dsa_indexer_rope``); the heads are
    summed with weights ``weights_proj(x) / sqrt(heads)``; future keys are masked; the top ``index_topk`` keys
    are kept. Computed in float32 in transformers' operation order, so score ties break the same way.
    """

    hf_role = "indexer"

    def __init__(self, cfg: MoeConfig, layer_idx: int):
        super().__init__()
        d = cfg.attention.indexer
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim, self.topk = d.n_heads, d.head_dim, d.topk
        self.rope_dim = cfg.attention.qk_rope_head_dim
        halves = cfg.spec.attention.indexer_rope_halves
        self.rope = apply_rope if halves else apply_rope_interleaved
        self.wq_b = nn.Linear(cfg.attention.q_lora_rank, d.n_heads * d.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, d.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(d.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, d.n_heads, bias=False)

    def forward(self, hidden, q_resid, cos_sin, past: int, cache: KVCache | None = None) -> torch.Tensor:
        """``allowed [B, T, S]``: the keys each of the T queries (positions ``past ..``) keeps."""
        b, t, _ = hidden.shape
        cos, sin = cos_sin
        q = self.wq_b(q_resid).view(b, t, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden)).unsqueeze(2)  # [B, T, 1, D]
        r = self.rope_dim
        q_rot, k_rot = self.rope(q[..., :r].transpose(1, 2), k[..., :r].transpose(1, 2), cos, sin)
        q = torch.cat([q_rot.transpose(1, 2), q[..., r:]], dim=-1)
        k = torch.cat([k_rot.transpose(1, 2), k[..., r:]], dim=-1).squeeze(2)  # [B, T, D]
        if cache is not None:
            k = cache.update(("dsa", self.layer_idx), k.unsqueeze(1))[0].squeeze(1)
        s = k.shape[1]
        scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.head_dim**-0.5)
        weights = self.weights_proj(hidden).float() * self.n_heads**-0.5
        index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, T, S]
        future = torch.arange(s, device=hidden.device)[None, :] > (torch.arange(t, device=hidden.device) + past)[:, None]
        index = index + torch.zeros_like(index).masked_fill(future, torch.finfo(torch.float32).min)
        ids = index.topk(min(self.topk, s), dim=-1).indices
        return torch.zeros(b, t, s, dtype=torch.bool, device=hidden.device).scatter(-1, ids, True)


class GatedMLP(Tagged, nn.Module):
    """``down(silu(gate(x)) * up(x))``; projection names are configurable (Mixtral experts: w1, w3, w2).

    ``bias``: every projection has one; ``clamp`` ``(alpha, limit)``: the clamped SwiGLU of gpt-oss,
    ``down((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g))`` with ``g = min(gate, limit)``; with alpha
    ``None`` (GLM-5-Next, DeepSeek-V4) ``down(silu(min(gate, limit)) * clamp(up, -limit, limit))``.
    """

    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 *, bias: bool = False, clamp: tuple[float, float] | None = None):
        super().__init__()
        self._names = names
        setattr(self, names[0], nn.Linear(hidden, intermediate, bias=bias))
        setattr(self, names[1], nn.Linear(hidden, intermediate, bias=bias))
        setattr(self, names[2], nn.Linear(intermediate, hidden, bias=bias))
        self.act_fn = nn.SiLU()  # a module, as in HF (ACT2FN): rule regexes see `...mlp.act_fn` upstream too
        self.clamp = clamp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self._names)
        if self.clamp is not None and self.clamp[0] is None:
            limit = self.clamp[1]
            return down(self.act_fn(gate(x).clamp(max=limit)) * up(x).clamp(min=-limit, max=limit))
        if self.clamp is not None:
            return down(swiglu_clamped(gate(x), up(x), *self.clamp))
        return down(self.act_fn(gate(x)) * up(x))


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss' activation: the gate clamped above at ``limit``, up clamped to +-``limit`` and shifted by one."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


#: rows of the vocabulary one lookup or one ``lm_head`` matmul takes at a time (:class:`VocabEmbedding`,
#: :class:`VocabHead`): a multiple of 16, so a resident chunk's row-slice starts 64-byte aligned, as a fresh tensor
VOCAB_CHUNK = 4096


class VocabEmbedding(nn.Embedding):
    """The token embedding (``nn.Embedding``, which upstream rules match), whose rows a streaming weight provider
    can hand in per lookup: ``fetch_rows`` (None: the whole table is resident) is set by
    :mod:`ktconvert.model.executor` to ``fetch_rows(ids)``, a context manager yielding the float32 rows ``ids``
    (sorted, distinct, all within one :data:`VOCAB_CHUNK`-row window of the vocabulary) for the ``with`` block.

    Bit-identical either way: a lookup copies rows and computes nothing, so gathering from the rows the tokens pick
    equals gathering from the whole table."""

    hf_class = "Embedding"  # what it stands for upstream: torch's own class (rules match nn.Embedding)
    hf_class_paths = ("torch.nn.Embedding", "torch.nn.modules.sparse.Embedding")

    fetch_rows = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.fetch_rows is None:
            return super().forward(input_ids)
        ids, inverse = torch.unique(input_ids, sorted=True, return_inverse=True)
        window = torch.div(ids, VOCAB_CHUNK, rounding_mode="floor")
        parts = []
        for w in torch.unique(window).tolist():
            with self.fetch_rows(ids[window == w]) as rows:
                parts.append(rows.clone())
        return F.embedding(inverse, torch.cat(parts))


class ChunkedLogits:
    """What computes ``lm_head``'s logits over vocabulary chunks (:class:`VocabHead`, and the injected
    ``KLinearTorch`` on ``lm_head``, :class:`~ktconvert.model.ops.linear.VocabLinearDequant`): ``chunked(inputs)``
    gives the logits of several inputs with each chunk of the weight fetched (read, decoded) once for all of them,
    every (input, chunk) block the same ops on the same operands as one call per input. ``ready``: ``(inputs,
    logits)`` that :meth:`~ktconvert.model.executor.LayerMajor.heads` computed that way for the calls about to come
    (a decode's positions): a call with one of those inputs returns its logits, so a streamed head is read once
    per phase, not once per position, and module hooks still see one call per input."""

    ready = None

    def chunked(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden``'s logits: the ready ones, else computed alone."""
        if self.ready is not None:
            for h, logits in zip(*self.ready):
                if h is hidden:
                    return logits
        return self.chunked([hidden])[0]


class VocabHead(ChunkedLogits, nn.Linear):
    """``lm_head`` (``nn.Linear``, which upstream rules match) computed over :data:`VOCAB_CHUNK` rows of the
    vocabulary at a time, so a streaming provider holds one chunk of its weight: ``fetch_rows`` (None: the whole
    weight is resident) is set to ``fetch_rows(a, z)``, a context manager yielding weight rows ``a:z`` in float32.

    The resident path takes the same chunks (a row-slice of the resident weight: same shape, strides and
    alignment), so both run the same matmul on the same operands and agree bit for bit whatever the vocabulary's
    size; chunking changes no sum (each logit is one row's dot product with the hidden state)."""

    hf_class = "Linear"  # what it stands for upstream: torch's own class (rules match nn.Linear)
    hf_class_paths = ("torch.nn.Linear", "torch.nn.modules.linear.Linear")

    fetch_rows = None

    def chunked(self, hiddens: list[torch.Tensor]) -> list[torch.Tensor]:
        """The logits of several inputs (a decode's positions), each vocabulary chunk fetched once for all of them:
        every (input, chunk) block is the same ``F.linear`` on the same operands as :meth:`forward` of that input
        computes, so the numbers are those of one call per input."""
        outs: list[list[torch.Tensor]] = [[] for _ in hiddens]
        for a in range(0, self.out_features, VOCAB_CHUNK):
            z = min(a + VOCAB_CHUNK, self.out_features)
            with self.fetch_rows(a, z) if self.fetch_rows is not None else nullcontext(self.weight[a:z]) as w:
                for out, hidden in zip(outs, hiddens):
                    out.append(F.linear(hidden, w, None if self.bias is None else self.bias[a:z]))
        return [out[0] if len(out) == 1 else torch.cat(out, dim=-1) for out in outs]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_of(hidden)


class RoutedExperts(Tagged, nn.ModuleList):
    """The routed experts, one child per expert (``experts.E.gate_proj`` ...), as upstream's ``nn.ModuleList``.

    ``forward(hidden [N, H], topk_ids [N, K], topk_weights [N, K]) -> [N, H]``, the contract of
    ktransformers' expert operators, so an operator reading converted ggml blocks can take this module's place.

    ``fetch``: ``None`` when every expert is resident; a streaming weight provider
    (:mod:`ktconvert.model.executor`) sets it to ``fetch(e)``, a context manager that makes expert ``e``'s weights
    resident for the ``with`` block and drops them after, so only the experts the tokens pick are ever read, one
    at a time. Forward hooks on ``experts.E.*`` fire either way (the module objects stay; only their tensors come
    and go).
    """

    fetch = None

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        chosen = torch.unique(topk_ids).tolist()
        if chosen and not 0 <= chosen[0] <= chosen[-1] < len(self):
            # a router (or an injected router operator) produced an impossible id: a bug to surface, not skip
            raise ValueError(f"expert ids {chosen[0]}..{chosen[-1]} outside 0..{len(self) - 1}")
        for e in chosen:
            tok, pos = torch.where(topk_ids == e)
            with self.fetch(e) if self.fetch is not None else nullcontext():
                y = self[e](hidden[tok]) * topk_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class TopKRouter(Tagged, nn.Linear):
    """Qwen/Mixtral router: an ``nn.Linear`` producing logits, as upstream (top-k happens in the block)."""


class LogitsRouter(Tagged, nn.Module):
    """A router that is no ``nn.Linear`` upstream (transformers' gpt-oss ``GptOssTopKRouter``: weight and bias
    of its own), so a rule matching ``torch.nn.Linear`` selects it here exactly as there: never."""

    def __init__(self, hidden: int, experts: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.bias = nn.Parameter(torch.zeros(experts)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool, cast_back: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen/Mixtral top-k: softmax in float32, top-k, optional renormalisation.

    ``cast_back``: Qwen returns weights in the logits' dtype, Mixtral keeps float32 (transformers 5).
    """
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if cast_back:
        weights = weights.to(logits.dtype)
    return ids, weights


class MoEGate(Tagged, nn.Module):
    """DeepSeek router: hidden states to ``(topk_ids, topk_weights)``, the contract of ktransformers' KMoEGate.

    Scores and selection run in float32. V3 (``noaux_tc``): sigmoid scores, the selection adds
    ``e_score_correction_bias`` and keeps the ``topk_group`` groups with the best top-2 sums; weights are the
    unbiased scores, renormalised when ``norm_topk_prob``, then scaled. V2: softmax scores (``greedy`` or
    ``group_limited_greedy`` by group maximum); weights are renormalised *or* scaled, as in DeepSeek's
    modeling code (transformers 5 always scales and ignores ``norm_topk_prob`` for V2; the two agree for
    every released V2 config, which sets ``norm_topk_prob: false``).
    """

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_experts
        self.hidden_size = cfg.hidden_size
        r = cfg.routing
        self.method = r.topk_method
        self.scoring = r.scoring_func
        self.n_group, self.topk_group = r.n_group, r.topk_group
        self.norm_topk_prob = r.norm_topk_prob
        self.scaling = r.routed_scaling_factor
        self.renorm_then_scale = r.renorm_then_scale
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if self.method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
        else:
            self.e_score_correction_bias = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.reshape(-1, self.hidden_size).float(), self.weight.float())

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(hidden)
        scores = router_scores(logits, self.scoring)
        n = scores.shape[0]
        if self.method == "greedy":
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        else:
            choice = scores + self.e_score_correction_bias.float() if self.method == "noaux_tc" else scores
            grouped = choice.view(n, self.n_group, -1)
            if self.method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            keep = group_mask.unsqueeze(-1).expand_as(grouped).reshape(n, -1).bool()
            if self.method == "noaux_tc":
                ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
                weights = scores.gather(1, ids)
            else:
                weights, ids = torch.topk(scores.masked_fill(~keep, 0.0), k=self.top_k, dim=-1, sorted=False)
        if self.renorm_then_scale:
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * self.scaling
        elif self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights * self.scaling
        return ids, weights


def router_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Router scores from float32 logits: softmax, sigmoid or sqrt(softplus) (DeepSeek-V4)."""
    if scoring == "softmax":
        return logits.softmax(dim=-1, dtype=torch.float32)
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.sigmoid()


def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss top-k: the k largest logits, then a softmax over those k only (in the logits' dtype)."""
    top, ids = torch.topk(logits, k, dim=-1)
    return ids, F.softmax(top, dim=1, dtype=top.dtype)


class SparseMoeBlock(Tagged, nn.Module):
    """Qwen2-MoE / Qwen3-MoE / Mixtral / gpt-oss block: router (logits; ``gate`` unless the spec names it),
    top-k, ``experts``, Qwen2's gated shared expert."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.routing.norm_topk_prob
        moe = cfg.spec.experts
        self.weights_kind = cfg.routing.weights
        self.cast_back = not cfg.routing.float32_weights
        self.router_attr = moe.router_attr
        # ktransformers' families route with an nn.Linear; a family it lacks keeps transformers' plain module
        router = TopKRouter if moe.linear_router else LogitsRouter
        setattr(self, self.router_attr, router(cfg.hidden_size, cfg.num_experts, bias=moe.router_bias))
        self.experts = RoutedExperts(
            GatedMLP(cfg.hidden_size, cfg.mlp.moe_intermediate_size, cfg.expert_proj_names,
                     bias=moe.expert_bias, clamp=cfg.activation.clamp) for _ in range(cfg.num_experts)
        )
        if cfg.mlp.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.mlp.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    @property
    def router_module(self) -> nn.Module:
        """The router, whatever its attribute name (``gate`` / ``router``)."""
        return getattr(self, self.router_attr)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.weights_kind == "topk_softmax":
            return topk_softmax(router_logits, self.top_k)
        return softmax_topk(router_logits, self.top_k, self.normalize, self.cast_back)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, t, h = hidden.shape
        x = hidden.reshape(-1, h)
        ids, weights = self.route(self.router_module(x))
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(b, t, h)


class DeepseekMoE(Tagged, nn.Module):
    """DeepSeek block: ``gate`` (MoEGate) -> ``experts``, plus always-on ``shared_experts``.

    Where the spec puts the score-correction bias on the block (MiniMax-M2's ``block_sparse_moe.e_score_correction_bias``),
    the block owns it and the gate holds the same tensor unsaved, so the state dict has the checkpoint's name."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.gate = MoEGate(cfg)
        bias = self.gate.e_score_correction_bias
        if bias is not None and cfg.spec.experts.bias_on_block:
            self.gate.register_buffer("e_score_correction_bias", bias, persistent=False)
            self.register_buffer("e_score_correction_bias", bias)
        clamp = cfg.activation.clamp
        self.experts = RoutedExperts(
            GatedMLP(cfg.hidden_size, cfg.mlp.moe_intermediate_size, cfg.expert_proj_names, clamp=clamp)
            for _ in range(cfg.num_experts)
        )
        if cfg.mlp.n_shared_experts:
            self.shared_experts = GatedMLP(cfg.hidden_size, cfg.mlp.shared_experts_inter,
                                           clamp=clamp if cfg.activation.shared else None)
        else:
            self.shared_experts = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        ids, weights = self.gate(hidden)
        out = self.experts(hidden.reshape(-1, shape[-1]), ids, weights).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out
