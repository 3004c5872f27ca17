"""Reference operator for ``KLinearTorch``: the weight dequantized to the compute dtype, ``x @ W.T (+ b)`` in it."""

from __future__ import annotations

import torch
from torch import nn

from ktconvert.model.ops.experts import torch_dtype


class LinearDequant(nn.Module):
    emulation = "linear-dequant"

    def __init__(self, weight, bias, compute_dtype: str, qtype: str):
        super().__init__()
        self.dtype = torch_dtype(compute_dtype)
        self.compute_dtype = compute_dtype
        self.qtype = qtype
        self.weight = torch.as_tensor(weight).to(self.dtype)
        self.bias = None if bias is None else torch.as_tensor(bias).to(self.dtype)

    def describe(self) -> str:
        return f"weight {self.qtype} dequantized to {self.compute_dtype}"

    def resident_bytes(self) -> int:
        """The dequantized weight and bias it holds."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        org = x.dtype
        return nn.functional.linear(x.to(self.dtype), self.weight, self.bias).to(org)
