"""Reference operators for routed experts: ``forward(hidden [N, H], topk_ids [N, K], topk_weights [N, K])``.

* :class:`CpuExpertsGGML` emulates ``KExpertsCPU`` (ktransformers' llamafile MoE kernel): it reads the layer's
  ggml blocks as stored and dequantizes only the experts a token picks. The kernel's rounding steps are
  reproduced: the input arrives in the kernel's ``hidden_type`` (BF16, hard-coded upstream), is converted to
  each weight type's ``vec_dot_type`` for the gate/up products (``act_quant``), the intermediate
  ``silu(gate) * up`` is converted to the down weights' ``vec_dot_type``, the weighted sum over the token's
  experts is accumulated in float32 in top-k order and returned in ``hidden_type``.
* :class:`ExpertsDequant` emulates ``KExpertsTorch``: every expert dequantized to the compute dtype up front,
  then plain matrix products in that dtype, expert by expert as upstream loops.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch
from torch import nn

from ktconvert.io.dtypes import COMPUTE_DTYPES, TORCH_NAMES
from ktconvert.model.ops.actquant import round_trip, vec_dot_type
from ktconvert.model.ops.source import PROJECTIONS, ExpertBlocks


def torch_dtype(name: str) -> torch.dtype:
    """A compute dtype by torch's name (``float32``, ``bfloat16``, ...) or the safetensors one (``BF16``)."""
    known = [TORCH_NAMES[d] for d in COMPUTE_DTYPES]
    name = TORCH_NAMES[name] if name in COMPUTE_DTYPES else name
    if name not in known:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(known)})")
    return getattr(torch, name)


def _check_ids(ids: torch.Tensor, n: int) -> list[int]:
    chosen = torch.unique(ids).tolist()
    if chosen and not 0 <= chosen[0] <= chosen[-1] < n:
        raise ValueError(f"expert ids {chosen[0]}..{chosen[-1]} outside 0..{n - 1}")
    return chosen


@dataclass
class CpuKernelNumerics:
    """What the emulated kernel rounds: its ``hidden_type`` and whether activations go to ``vec_dot_type``."""

    hidden_dtype: str = "bfloat16"
    act_quant: bool = True


class CpuExpertsGGML(nn.Module):
    emulation = "cpu-experts-ggml"

    def __init__(self, blocks: ExpertBlocks, numerics: CpuKernelNumerics):
        super().__init__()
        self.blocks = blocks
        self.numerics = numerics
        self.num_experts = blocks.gate.shape[0]
        self._cache: dict[tuple[str, int], torch.Tensor] = {}
        self.act_types = {}
        self.unknown_act = []  # weight types whose activation rounding this table lacks: run unrounded, reported
        for p in PROJECTIONS:
            qtype = getattr(blocks, p).qtype
            act = vec_dot_type(qtype) if numerics.act_quant else "F32"
            if act is None:
                self.unknown_act.append(qtype)
            self.act_types[p] = act or "F32"
        self.hidden = torch_dtype(numerics.hidden_dtype)

    def describe(self) -> str:
        acts = "/".join(self.act_types[p] for p in PROJECTIONS)
        types = "/".join(getattr(self.blocks, p).qtype for p in PROJECTIONS)
        return f"weights {types}, activations {acts}, hidden {self.numerics.hidden_dtype}"

    def resident_bytes(self) -> int:
        """The least this op holds while it runs: one expert's three projections in float32 (it decodes the
        experts the tokens pick, one at a time, and keeps them in ``_cache``), and the stored experts where they are
        a copy in memory (safetensors experts; a GGUF's are a view of the mapped file)."""
        return sum(math.prod(getattr(self.blocks, p).shape[1:]) * 4 for p in PROJECTIONS) + self.stored_bytes()

    def stored_bytes(self) -> int:
        """The stored experts this op keeps in memory (0 where they are a view of a mapped file)."""
        return sum(b.data.nbytes for b in (getattr(self.blocks, p) for p in PROJECTIONS) if b.in_memory)

    def _weight(self, proj: str, e: int) -> torch.Tensor:
        key = (proj, e)
        w = self._cache.get(key)
        if w is None:
            w = self._cache[key] = torch.from_numpy(getattr(self.blocks, proj).expert(e))
        return w

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        org = hidden.dtype
        chosen = _check_ids(topk_ids, self.num_experts)
        x = hidden.to(self.hidden).to(torch.float32)  # what the kernel reads
        w = topk_weights.to(torch.float32)
        n, k = topk_ids.shape
        contrib = torch.zeros(n, k, x.shape[-1], dtype=torch.float32)
        acts = self.act_types
        xg = round_trip(x, acts["gate"])
        xu = xg if acts["up"] == acts["gate"] else round_trip(x, acts["up"])
        for e in chosen:
            tok, slot = torch.where(topk_ids == e)
            g = xg[tok] @ self._weight("gate", e).T
            u = xu[tok] @ self._weight("up", e).T
            inter = g / (1.0 + torch.exp(-g)) * u  # act_fn(x) = x / (1 + expf(-x)) in the kernel
            contrib[tok, slot] = round_trip(inter, acts["down"]) @ self._weight("down", e).T
        out = torch.zeros(n, x.shape[-1], dtype=torch.float32)
        for s in range(k):  # s_output_fp32 += down * weight, expert slot by slot
            out += contrib[:, s] * w[:, s, None]
        return out.to(self.hidden).to(org)


class ExpertsDequant(nn.Module):
    emulation = "experts-dequant"

    def __init__(self, blocks: ExpertBlocks, compute_dtype: str):
        super().__init__()
        self.dtype = torch_dtype(compute_dtype)
        self.compute_dtype = compute_dtype
        self.types = blocks.types()
        e = blocks.gate.shape[0]
        self.num_experts = e

        def stack(proj: str) -> torch.Tensor:
            b = getattr(blocks, proj)
            return torch.stack([torch.from_numpy(b.expert(x)) for x in range(e)]).to(self.dtype)

        self.gate, self.up, self.down = stack("gate"), stack("up"), stack("down")

    def describe(self) -> str:
        return f"weights {'/'.join(self.types[p] for p in PROJECTIONS)} dequantized to {self.compute_dtype}"

    def resident_bytes(self) -> int:
        """Every expert of the layer, dequantized (it holds them all while it runs)."""
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down))

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        org = hidden.dtype
        _check_ids(topk_ids, self.num_experts)
        x = hidden.to(self.dtype)
        w = topk_weights.to(self.dtype)
        out = torch.zeros(x.shape, dtype=self.dtype)
        for e in range(self.num_experts):
            tok, slot = torch.where(topk_ids == e)
            if tok.numel() == 0:
                continue
            cur = x[tok]
            h = torch.nn.functional.silu(cur @ self.gate[e].T) * (cur @ self.up[e].T)
            out.index_add_(0, tok, h @ self.down[e].T * w[tok, slot, None])
        return out.to(org)
