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


class VocabLinearDequant(LinearDequant):
    """``KLinearTorch`` on ``lm_head``: the same numbers as :class:`LinearDequant`, computed over ``chunk`` rows of
    the vocabulary at a time. In memory (``rows`` None) it slices its dequantized weight; streamed it holds nothing
    and reads each chunk's rows from ``rows(a, z)`` (float32, decoded as the whole tensor is) when it runs, so a
    verify within a budget never holds a real model's whole head (151936 x 2048 in float32 is 1.16 GiB). Both take
    the same chunks, the same matmul on the same operands, so they agree bit for bit (as
    :class:`~ktconvert.model.modules.VocabHead` does for the reference)."""

    def __init__(self, weight, bias, compute_dtype: str, qtype: str, *, chunk: int, shape: tuple[int, int],
                 rows=None):
        nn.Module.__init__(self)
        self.dtype = torch_dtype(compute_dtype)
        self.compute_dtype = compute_dtype
        self.qtype = qtype
        self.chunk, self.shape, self.rows = chunk, tuple(shape), rows
        self.weight = None if weight is None else torch.as_tensor(weight).to(self.dtype)
        self.bias = None if bias is None else torch.as_tensor(bias).to(self.dtype)

    def describe(self) -> str:  # the same either way: a streamed report equals the in-memory one
        return f"weight {self.qtype} dequantized to {self.compute_dtype}, in chunks of {self.chunk} vocabulary rows"

    def resident_bytes(self) -> int:
        """The whole dequantized weight in memory; streamed, one chunk (its float32 rows and their cast)."""
        if self.weight is not None:
            return super().resident_bytes()
        rows = min(self.chunk, self.shape[0])
        return 2 * rows * self.shape[1] * 4 + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        org, h = x.dtype, x.to(self.dtype)
        outs = []
        for a in range(0, self.shape[0], self.chunk):
            z = min(a + self.chunk, self.shape[0])
            w = self.weight[a:z] if self.weight is not None else torch.from_numpy(self.rows(a, z)).to(self.dtype)
            outs.append(nn.functional.linear(h, w, None if self.bias is None else self.bias[a:z]))
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).to(org)
