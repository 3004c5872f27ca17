"""Reference blocks of compressed sparse MQA and hash routing (DeepSeek-V4; spec ``attention.kind:
compressed_mqa``, ``routing.hash_layers``); its hyper-connections are ``hyper.py``'s.

Numerics follow transformers 5.23's modeling_deepseek_v4.py operation by operation (float32 softmaxes, rope in
float32, the Sinkhorn loop as written there). Attention is computed over the whole sequence each call: decode keeps
the layer's inputs in the cache and recomputes, which equals transformers' stateful compressor (buffered windows,
carried overlap) by construction and keeps one code path for prefill and decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ktconvert.families.config import MoeConfig
from ktconvert.model.hyper import unweighted_rms_norm
from ktconvert.model.modules import DeepseekMoE, KVCache, RMSNorm, RotaryEmbedding, Tagged, rms_norm, router_scores


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rope on the trailing ``2 * cos.shape[-1]`` dims of ``x [B, h, T, d]`` (heads lead as
    ``[nope | rope]``); ``cos``/``sin`` ``[B, T, r / 2]``, one entry per pair. Computed in float32."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    out = (rope.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat([nope, out], dim=-1)


class PairRotary(RotaryEmbedding):
    """cos/sin with one entry per rotated pair (``[B, T, r / 2]``), as :func:`rope_tail` takes them."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        return (freqs.cos() * self.attention_scaling).to(x.dtype), (freqs.sin() * self.attention_scaling).to(x.dtype)


class WindowCompressor(Tagged, nn.Module):
    """Pools every closed window of ``ratio`` tokens into one KV entry: ``kv_norm(sum softmax(gate + position_bias)
    * kv)``, rotated at the window's first position. ``overlap``: each token projects two series (2 x width); entry
    ``w`` pools window ``w - 1``'s first series with window ``w``'s second (the ratio-4 layers and their indexer)."""

    def __init__(self, cfg: MoeConfig, ratio: int, width: int, overlap: bool):
        super().__init__()
        self.ratio, self.width, self.overlap = ratio, width, overlap
        coff = 2 if overlap else 1
        self.kv_proj = nn.Linear(cfg.hidden_size, coff * width, bias=False)
        self.gate_proj = nn.Linear(cfg.hidden_size, coff * width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, coff * width))
        self.kv_norm = RMSNorm(width, cfg.rms_norm_eps)

    def entries(self, hidden: torch.Tensor, rotary: PairRotary) -> torch.Tensor:
        """``[B, S // ratio, width]`` compressed entries of ``hidden [B, S, H]`` (positions from 0)."""
        b, s, _ = hidden.shape
        n = s // self.ratio
        if n == 0:
            return hidden.new_zeros((b, 0, self.width))
        r, d = self.ratio, self.width
        kv = self.kv_proj(hidden)[:, : n * r].view(b, n, r, -1)
        gate = self.gate_proj(hidden)[:, : n * r].view(b, n, r, -1) + self.position_bias
        if self.overlap:
            new_kv = kv.new_zeros((b, n, 2 * r, d))
            new_gate = gate.new_full((b, n, 2 * r, d), float("-inf"))
            new_kv[:, :, r:] = kv[..., d:]
            new_gate[:, :, r:] = gate[..., d:]
            if n > 1:
                new_kv[:, 1:, :r] = kv[:, :-1, :, :d]
                new_gate[:, 1:, :r] = gate[:, :-1, :, :d]
            kv, gate = new_kv, new_gate
        pooled = self.kv_norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        positions = (torch.arange(n, device=hidden.device) * r).unsqueeze(0).expand(b, -1)
        cos, sin = rotary(pooled, positions)
        return rope_tail(pooled.unsqueeze(1), cos, sin).squeeze(1)


class IndexerScorer(Tagged, nn.Module):
    """Holds the indexer's per-head weight projection (``scorer.weights_proj``), as transformers nests it."""

    hf_role = "indexer_scorer"

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.attention.indexer.n_heads, bias=False)


class LightningIndexer(WindowCompressor):
    """Which compressed entries each query of a ratio-4 layer sees: its own overlapping compressor at
    ``index_head_dim``, scores ``sum_h w_h relu(q_h . k) / sqrt(d)`` with ``q = q_b_proj(q_residual)`` rotated at the
    query position and ``w = scorer.weights_proj(x) / sqrt(heads)``; the top ``index_topk`` causal entries are kept."""

    hf_role = "indexer"

    def __init__(self, cfg: MoeConfig, ratio: int):
        d = cfg.attention.indexer
        super().__init__(cfg, ratio, d.head_dim, overlap=True)
        self.n_heads, self.topk = d.n_heads, d.topk
        self.q_b_proj = nn.Linear(cfg.attention.q_lora_rank, d.n_heads * d.head_dim, bias=False)
        self.scorer = IndexerScorer(cfg)

    def select(self, hidden, q_residual, position_ids, rotary: PairRotary) -> torch.Tensor:
        """``allowed [B, S, n]`` over the ``n`` compressed entries."""
        b, s, _ = hidden.shape
        keys = self.entries(hidden, rotary)
        n = keys.shape[1]
        if n == 0:
            return torch.zeros(b, s, 0, dtype=torch.bool, device=hidden.device)
        cos, sin = rotary(hidden, position_ids)
        q = self.q_b_proj(q_residual).view(b, s, -1, self.width).transpose(1, 2)
        q = rope_tail(q, cos, sin).transpose(1, 2)
        scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))) * self.width**-0.5
        weights = self.scorer.weights_proj(hidden).float() * self.n_heads**-0.5
        index = (scores * weights.unsqueeze(-1)).sum(dim=2)  # [B, S, n]
        visible = torch.arange(n, device=hidden.device).view(1, 1, -1) < ((position_ids + 1) // self.ratio).unsqueeze(-1)
        index = index.masked_fill(~visible, float("-inf"))
        ids = index.topk(min(self.topk, n), dim=-1).indices
        chosen = torch.zeros(b, s, n, dtype=torch.bool, device=hidden.device).scatter(-1, ids, True)
        return chosen & visible


class CompressedCompressor(WindowCompressor):
    """A compressed layer's ``self_attn.compressor``: the indexer lives under it (ratio-4 layers), as transformers
    names the modules."""

    @property
    def hf_role(self) -> str:
        return "csa_compressor" if self.indexer is not None else "hca_compressor"

    def __init__(self, cfg: MoeConfig, ratio: int):
        csa = ratio == cfg.attention.compressed.csa_ratio
        super().__init__(cfg, ratio, cfg.head_dim, overlap=csa)
        self.indexer = LightningIndexer(cfg, ratio) if csa else None


class CompressedAttention(Tagged, nn.Module):
    """Shared-KV MQA over a sliding window plus the layer's compressed entries, per-head sinks, rope undone on the
    output, grouped low-rank output projection (``o_a_proj`` per group of heads, then ``o_b_proj``)."""

    def __init__(self, cfg: MoeConfig, layer_idx: int):
        super().__init__()
        c = cfg.attention.compressed
        self.layer_idx = layer_idx
        self.ratio = c.ratios[layer_idx]
        self.n_heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, c.o_groups
        self.window, self.eps = cfg.attention.sliding_window, cfg.rms_norm_eps
        h, q_lora = cfg.hidden_size, cfg.attention.q_lora_rank
        self.q_a_proj = nn.Linear(h, q_lora, bias=False)
        self.q_a_norm = rms_norm(cfg, q_lora)
        self.q_b_proj = nn.Linear(q_lora, self.n_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(h, self.head_dim, bias=False)
        self.kv_norm = rms_norm(cfg, self.head_dim)
        self.o_a_proj = nn.Linear(self.n_heads * self.head_dim // c.o_groups, c.o_groups * c.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads))
        self.rotary_emb = PairRotary(c.compress_rope if self.ratio else cfg.rope)
        self.compressor = CompressedCompressor(cfg, self.ratio) if self.ratio else None

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        t = hidden.shape[1]
        if cache is not None:  # decode recomputes over every input so far (see the module docstring)
            hidden = cache.update(("inputs", self.layer_idx), hidden.unsqueeze(1))[0].squeeze(1)
        b, s, _ = hidden.shape
        positions = torch.arange(s, device=hidden.device).unsqueeze(0).expand(b, -1)
        cos, sin = self.rotary_emb(hidden, positions)
        q_residual = self.q_a_norm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_residual).view(b, s, -1, self.head_dim).transpose(1, 2)
        q = rope_tail(unweighted_rms_norm(q, self.eps), cos, sin)
        kv = self.kv_norm(self.kv_proj(hidden)).view(b, s, 1, self.head_dim).transpose(1, 2)
        kv = rope_tail(kv, cos, sin)
        qpos = torch.arange(s, device=hidden.device)
        visible = (qpos[None, :] <= qpos[:, None]) & (qpos[:, None] - qpos[None, :] < self.window)  # [S, S]
        visible = visible.expand(b, s, s)
        if self.compressor is not None:
            entries = self.compressor.entries(hidden, self.rotary_emb)  # [B, n, d]
            n = entries.shape[1]
            if self.compressor.indexer is not None:
                seen = self.compressor.indexer.select(hidden, q_residual, positions, self.rotary_emb)
            else:
                seen = torch.arange(n, device=hidden.device).view(1, 1, -1) < ((positions + 1) // self.ratio).unsqueeze(-1)
            kv = torch.cat([kv, entries.unsqueeze(1)], dim=2)
            visible = torch.cat([visible, seen], dim=-1)
        w = torch.matmul(q, kv.transpose(2, 3)) * self.head_dim**-0.5
        w = w.masked_fill(~visible.unsqueeze(1), float("-inf"))
        w = torch.cat([w, self.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, 1).to(w.dtype)], dim=-1)
        w = w - w.max(dim=-1, keepdim=True).values
        w = F.softmax(w, dim=-1, dtype=w.dtype)[..., :-1].to(kv.dtype)
        out = torch.matmul(w, kv)  # [B, h, S, d]
        out = rope_tail(out, cos, -sin).transpose(1, 2)[:, s - t:]  # the rope that V carried, undone
        grouped = out.reshape(b * t, self.groups, -1).transpose(0, 1)  # [g, N, heads * d / g]
        weight = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)
        mixed = torch.bmm(grouped, weight).transpose(0, 1).reshape(b, t, -1)
        return self.o_b_proj(mixed)


class HashGate(Tagged, nn.Module):
    """Hash routing: the experts of a token are ``tid2eid[input_id]`` (a fixed table); the gate's scores weight
    them (renormalised, then scaled), as the score-routed layers do. Same ``(ids, weights)`` contract as MoEGate."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.hidden_size, self.scoring = cfg.hidden_size, cfg.routing.scoring_func
        self.norm_topk_prob, self.scaling = cfg.routing.norm_topk_prob, cfg.routing.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.reshape(-1, self.hidden_size).float(), self.weight.float())
        scores = router_scores(logits, self.scoring)
        ids = self.tid2eid[input_ids.reshape(-1)].long()
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class HashRoutedMoE(DeepseekMoE):
    """DeepSeek's block (routed experts + shared experts) whose gate routes by token id (:class:`HashGate`)."""

    takes_input_ids = True

    def __init__(self, cfg: MoeConfig):
        super().__init__(cfg)
        self.gate = HashGate(cfg)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        ids, weights = self.gate(hidden, input_ids)
        out = self.experts(hidden.reshape(-1, shape[-1]), ids, weights).view(shape)
        return out + self.shared_experts(hidden) if self.shared_experts is not None else out
