"""Helpers for tests that run the real kt-kernel (always in a child process, never imported here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ktconvert.model.ops.experts import CpuExpertsGGML, CpuKernelNumerics


def require_kernel() -> dict:
    """kt-kernel's probe, or skip the test with the reason it cannot be imported in a child process."""
    from ktconvert.kernel import probe_kernel

    info = probe_kernel()
    if not info["available"]:
        pytest.skip(f"kt-kernel cannot be imported in a child process here: {info['error']} "
                    "(pip install --no-deps kt-kernel==0.7.2)")
    return info


def batch(tokens: int = 16, hidden: int = 256, experts: int = 8, k: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).astype(np.int64)
    w = rng.random((tokens, k)).astype(np.float32)
    return x, ids, w


def f32_moe(blocks, x, ids, w) -> np.ndarray:
    """A float32 MoE on the weights as stored (no rounding of activations)."""
    op = CpuExpertsGGML(blocks, CpuKernelNumerics("float32", False))
    return op.forward(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w)).numpy()


def emulated(blocks, x, ids, w) -> np.ndarray:
    op = CpuExpertsGGML(blocks, CpuKernelNumerics())
    return op.forward(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w)).to(torch.float32).numpy()


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
