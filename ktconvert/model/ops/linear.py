"""Reference operator for ``KLinearTorch``: the weight dequantized to the compute dtype, ``x @ W.T (+ b)`` in it."""

from __future__ import annotations

import torch
from torch import nn

from ktconvert.model.modules import ChunkedLogits
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


class VocabLinearDequant(ChunkedLogits, LinearDequant):
    """``KLinearTorch`` on ``lm_head``: the same numbers as :class:`LinearDequant`, computed over ``chunk`` rows of
    the vocabulary at a time. In memory (``rows`` None) it slices its dequantized weight; streamed it holds nothing
    and reads each chunk's rows from ``rows(a, z)`` (float32, decoded as the whole tensor is) when it runs, so a
    verify within a budget never holds a real model's whole head (151936 x 2048 in float32 is 1.16 GiB). Both take
    the same chunks, the same matmul on the same operands, so they agree bit for bit (as
    :class:`~ktconvert.model.modules.VocabHead` does for the reference). A decode's positions take each chunk once
    for all of them (:class:`~ktconvert.model.modules.ChunkedLogits`): streamed, the head is read and decoded once
    per phase, not once per position."""

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
        return self.logits_of(x)

    def chunked(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        hs = [x.to(self.dtype) for x in inputs]
        outs: list[list[torch.Tensor]] = [[] for _ in inputs]
        for a in range(0, self.shape[0], self.chunk):
            z = min(a + self.chunk, self.shape[0])
            w = self.weight[a:z] if self.weight is not None else torch.from_numpy(self.rows(a, z)).to(self.dtype)
            for out, h in zip(outs, hs):
                out.append(nn.functional.linear(h, w, None if self.bias is None else self.bias[a:z]))
            del w
        return [(out[0] if len(out) == 1 else torch.cat(out, dim=-1)).to(x.dtype) for out, x in zip(outs, inputs)]
