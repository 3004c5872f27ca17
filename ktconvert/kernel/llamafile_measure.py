"""Measure which ggml weight types kt-kernel's LLAMAFILE method runs: one MoE layer per type, in a child each.

For a type T: random float experts are quantized to T (by ktconvert's own quantizer, or a quantizer the caller
passes for the types ktconvert cannot write, such as ggml's C reference for the IQ grids), the blocks are loaded
into a fresh kt-kernel child as LLAMAFILE reads a GGUF's merged experts, and a prefill-sized and a decode-sized
batch go through it (the kernel takes a different path for each: grouped sgemm from ``group_min_len`` tokens up,
per-token below). Its output is compared with a float32 MoE on the *dequantized* blocks, so the error measured is
what the kernel adds to the file's own weights (activation rounding to its vec_dot type, bf16 output), not the
type's quantization error, which is measured apart (the same reference on the float weights) and recorded beside it.

Verdicts: ``runs``; ``aborts`` (the child died: SIGABRT, SIGSEGV, ...); ``refuses`` (the kernel raised, or its
ggml type enum has no such type); ``wrong`` (NaN/Inf, or an error above the type's bound: far above what
activation rounding gives, so garbage). Everything but ``runs`` means LLAMAFILE cannot run the type.

Used by ``benchmarks/measure_llamafile_types.py`` (writes ``rules/kernels/kt-llamafile.yaml``) and by the test
that the table is current. The calling process never imports kt_kernel.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ktconvert import quant
from ktconvert.kernel.runner import KernelCrashed, KernelSession, bf16_bits_to_f32, f32_to_bf16_bits

#: a quantizer: float32 ``[E, rows, cols]`` -> uint8 blocks ``[E, rows, row_bytes]`` of ``qtype``
Quantizer = Callable[[np.ndarray, str], np.ndarray]

#: bounds on the worst token's relative error of the kernel against the dequantized reference (per token, so a
#: kernel that gets some blocks or experts wrong shows even when the batch average hides it). Float weights see
#: only bf16 activations (measured: worst token 0.004); quantized weights see activations rounded to 8-bit blocks
#: (Q8_0/Q8_K; measured: worst token 0.012-0.027 over Q2_K..Q8_0): the bounds are ~3x those, and a wrong decoding
#: measures 0.15 and more (IQ4_XS in kt-kernel 0.7.2: worst tokens 0.17-0.2 at 64 tokens).
BOUND_FLOAT = 0.02
BOUND_QUANT = 0.08
FLOAT_TYPES = ("F32", "F16", "BF16")


def bound(qtype: str) -> float:
    return BOUND_FLOAT if qtype in FLOAT_TYPES else BOUND_QUANT


@dataclass(frozen=True)
class Shape:
    experts: int = 8
    top_k: int = 2
    hidden: int = 256
    inter: int = 256
    prefill: int = 64  # tokens: the grouped path (group_min_len = 10)
    decode: int = 3  # tokens: the per-token path

    def as_dict(self) -> dict:
        return {"experts": self.experts, "top_k": self.top_k, "hidden": self.hidden, "inter": self.inter,
                "prefill_tokens": self.prefill, "decode_tokens": self.decode}


def own_quantizer(w: np.ndarray, qtype: str) -> np.ndarray:
    """ktconvert's quantizer (the types it writes)."""
    return quant.quantize(w, qtype)


def _weights(shape: Shape, seed: int):
    rng = np.random.default_rng(seed)
    e, h, i = shape.experts, shape.hidden, shape.inter
    gate = (rng.standard_normal((e, i, h)) / math.sqrt(h)).astype(np.float32)
    up = (rng.standard_normal((e, i, h)) / math.sqrt(h)).astype(np.float32)
    down = (rng.standard_normal((e, h, i)) / math.sqrt(i)).astype(np.float32)
    return gate, up, down


def _batch(shape: Shape, tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    x = bf16_bits_to_f32(f32_to_bf16_bits(rng.standard_normal((tokens, shape.hidden)).astype(np.float32)))
    ids = np.stack([rng.choice(shape.experts, shape.top_k, replace=False) for _ in range(tokens)]).astype(np.int64)
    w = rng.random((tokens, shape.top_k)).astype(np.float32)
    return x, ids, w


def reference_moe(gate, up, down, x, ids, w) -> np.ndarray:
    """float32 MoE, float64 accumulation: ``sum_k w * down_e(silu(gate_e x) * up_e x)``."""
    out = np.zeros((x.shape[0], down.shape[1]), dtype=np.float64)
    xd = x.astype(np.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            g = gate[e].astype(np.float64) @ xd[t]
            u = up[e].astype(np.float64) @ xd[t]
            out[t] += w[t, s] * (down[e].astype(np.float64) @ (g / (1.0 + np.exp(-g)) * u))
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@dataclass
class _Blocks:  # the attributes KernelSession.load_gguf_layer reads
    qtype: str
    data: np.ndarray
    shape: tuple


@dataclass
class _Layer:
    layer: int
    gate: _Blocks
    up: _Blocks
    down: _Blocks

    def types(self) -> dict[str, str]:
        return {p: getattr(self, p).qtype for p in ("gate", "up", "down")}


def measure_type(qtype: str, quantizer: Quantizer = own_quantizer, *, shape: Shape = Shape(), seed: int = 0,
                 threads: int = 1, timeout: float = 120.0) -> dict:
    """One type through LLAMAFILE: ``{"type", "verdict", "error": {phase: {"rel", "token_max"}}, "quant_error",
    "bound", "detail", "variant", "kt_kernel"}`` (``error`` only for a run that returned, ``detail`` only for a type
    that does not run). ``quant_error``: the type's own error (reference on the dequantized vs the float weights)."""
    gate, up, down = _weights(shape, seed)
    blocks = {p: np.ascontiguousarray(quantizer(a, qtype)) for p, a in (("gate", gate), ("up", up), ("down", down))}
    deq = {p: quant.dequantize(b, qtype).reshape(a.shape)
           for (p, b), a in zip(blocks.items(), (gate, up, down))}
    layer = _Layer(0, *(_Blocks(qtype, blocks[p], deq[p].shape) for p in ("gate", "up", "down")))
    res = {"type": qtype, "bound": bound(qtype)}
    batches = {"prefill": _batch(shape, shape.prefill, seed + 1), "decode": _batch(shape, shape.decode, seed + 2)}
    x, ids, w = batches["prefill"]
    res["quant_error"] = round(_rel(reference_moe(*deq.values(), x, ids, w), reference_moe(gate, up, down, x, ids, w)), 4)
    errors: dict = {}
    doing = "load"
    try:
        with KernelSession("LLAMAFILE", threadpools=1, threads=threads, timeout=timeout) as s:
            res["variant"] = s.info.variant
            res["kt_kernel"] = s.info.version
            s.load_gguf_layer("L", layer, shape.top_k, max_len=max(shape.prefill, shape.decode), check_types=False)
            for phase, (x, ids, w) in batches.items():
                doing = f"{phase} batch ({x.shape[0]} tokens)"
                y = bf16_bits_to_f32(s.forward("L", f32_to_bf16_bits(x), ids, w))
                if not np.isfinite(y).all():
                    res.update(verdict="wrong", detail=f"NaN/Inf in the output of the {doing}")
                    return res
                ref = reference_moe(*deq.values(), x, ids, w)
                per_token = np.linalg.norm(y - ref, axis=1) / np.linalg.norm(ref, axis=1)
                errors[phase] = {"rel": round(_rel(y, ref), 5), "token_max": round(float(per_token.max()), 5)}
    except KernelCrashed as exc:
        if errors:  # the phases that ran before it died
            res["error"] = errors
        res.update(verdict="aborts" if "killed by" in exc.message else "refuses", detail=_detail(exc.message, doing))
        return res
    res["error"] = errors
    phase, worst = max(((p, e["token_max"]) for p, e in errors.items()), key=lambda pe: pe[1])
    if worst > res["bound"]:
        res.update(verdict="wrong", detail=f"worst token's relative error {worst:.3g} ({phase}) against the "
                   f"dequantized weights, above the bound {res['bound']}: the kernel computes other weights than "
                   "the file's")
    else:
        res["verdict"] = "runs"
    return res


def _detail(message: str, doing: str) -> str:
    """What the kernel did, in the table's words: the signal or the error, the batch, its last words (no paths)."""
    sig = re.search(r"killed by (\w+)", message)
    words = message.partition("; its last words: ")[2].strip()
    if sig:
        return f"{sig.group(1)} in the {doing}" + (f": {words[-160:]}" if words else "")
    err = message.rpartition("): ")[2] if "): " in message else message.rpartition(": ")[2]
    return f"error at {doing}: {err[:200]}"
