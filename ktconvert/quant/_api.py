"""Validation, chunking and parallelism around the per-type kernels."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, Callable, Iterator

import numpy as np

from . import _legacy as G
from ._types import (
    IMATRIX_REQUIRED,
    IMATRIX_TYPES,
    IQ_GRID_TYPES,
    QUANTIZABLE,
    QType,
    as_qtype,
    block_size,
    check_row,
    elem_shape,
    type_size,
)
from .errors import QuantError

# Elements per work item: one item is one compiled-kernel call on one thread; about 1 MB of float32 keeps the
# per-item overhead (< 0.1 ms) small against the fastest type and leaves enough items to balance threads.
_CHUNK = 1 << 18

# name of the kernel in ``_jit`` (float32 (n_blocks, block_size) -> uint8 (n_blocks, type_size), filled in
# place; F32/F16/BF16: float32 (rows, n) -> int32/uint16 (rows, n), returning whether the chunk was finite); and
# the chunk size
_QUANT: dict[QType, tuple[str, int]] = {
    QType.F32: ("f32", _CHUNK),
    QType.F16: ("f16", _CHUNK),
    QType.BF16: ("bf16", _CHUNK),
    QType.Q8_0: ("q8_0", _CHUNK),
    QType.Q4_0: ("q4_0", _CHUNK),
    QType.Q4_1: ("q4_1", _CHUNK),
    QType.Q5_0: ("q5_0", _CHUNK),
    QType.Q5_1: ("q5_1", _CHUNK),
    QType.Q2_K: ("q2_k", _CHUNK),
    QType.Q3_K: ("q3_k", _CHUNK),
    QType.Q4_K: ("q4_k", _CHUNK),
    QType.Q5_K: ("q5_k", _CHUNK),
    QType.Q6_K: ("q6_k", _CHUNK),
}
# the kernels of ``_jit_imatrix`` and ``_jit_iq`` (whole float32 rows + one importance row per expert -> the rows'
# blocks): every type that takes an importance matrix, used when one is given; the IQ types have only these (their
# search with weights x*x is ggml's path without one, where ggml has one)
_QUANT_ROWS: dict[QType, str] = {qt: qt.name.lower() for qt in IMATRIX_TYPES}
_ROWS_ONLY = frozenset(QType[n] for n in ("IQ4_NL", "IQ4_XS")) | IQ_GRID_TYPES
assert set(_QUANT) | _ROWS_ONLY == QUANTIZABLE and set(_QUANT_ROWS) <= QUANTIZABLE
# the float types' kernels write element for element into this view of the output bytes
_FLOAT_VIEW = {QType.F32: np.int32, QType.F16: np.uint16, QType.BF16: np.uint16}


def _kernel(name: str) -> Callable[[np.ndarray, np.ndarray], None]:
    """The compiled kernel ``name``; numba is imported on the first quantization, and each kernel compiled (or
    loaded from numba's cache) on its first call, so a process pays only for the types it uses."""
    from . import _jit

    return getattr(_jit, name)


def _row_kernel(qt: QType) -> Callable[..., None]:
    """The compiled whole-row kernel of ``qt`` in ``_jit_imatrix`` or, for the grid types, ``_jit_iq`` (loaded as
    :func:`_kernel`; the grid types build their tables on first use)."""
    if qt in IQ_GRID_TYPES:
        from . import _jit_iq as mod
    else:
        from . import _jit_imatrix as mod
    return getattr(mod, _QUANT_ROWS[qt])


def _importance(imatrix: Any, rows: "_Rows", qt: QType, name: str | None) -> tuple[np.ndarray, int]:
    """The importance matrix as float32 ``(E, n)`` rows and the tensor rows each covers.

    ``(n,)``: one importance per column for every row (a 2-D weight); ``(E, n)``: one row per expert of a
    tensor whose first axis holds ``E`` experts (llama.cpp's ``ne[0]*ne[2]`` entries of a 3-D expert tensor).
    """
    a = imatrix.detach().cpu().numpy() if _is_torch(imatrix) else np.asarray(imatrix)
    n = rows.n
    fix_shape = (f"pass one importance per column: shape ({n},), or ({rows.shape[0]}, {n}) with one row per "
                 f"expert" if len(rows.shape) >= 3 else f"pass one importance per column: shape ({n},)")
    if a.dtype.kind not in "fiu":
        raise QuantError(f"the importance matrix for {qt.name} holds {a.dtype}, not numbers", where=name,
                         fix=fix_shape)
    if a.ndim == 1 and a.shape[0] == n:
        e = 1
    elif a.ndim == 2 and a.shape[1] == n and len(rows.shape) >= 3 and a.shape[0] == rows.shape[0]:
        e = a.shape[0]
    else:
        raise QuantError(f"the importance matrix has shape {tuple(a.shape)}; a tensor of shape {rows.shape} "
                         f"needs ({n},)" + (f" or ({rows.shape[0]}, {n})" if len(rows.shape) >= 3 else ""),
                         where=name, fix="use the importance matrix made for this tensor (" + fix_shape + ")")
    qw = np.ascontiguousarray(a.reshape(e, n), dtype=np.float32)
    bad = ~np.isfinite(qw) | (qw < 0)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        at = at[1:] if e == 1 else at
        raise QuantError(f"the importance matrix holds {qw[bad][0]} at index {at}; importances are sums of "
                         f"squares, finite and >= 0", where=name,
                         fix="recompute the importance matrix, or quantize without one")
    return qw, max(1, rows.nrows // e)


def _kquant(name: str) -> Callable[..., np.ndarray]:
    """A K-quant decoder of :mod:`ktconvert.quant._kquants`, imported when first called: its compiled loops bring
    numba (about 100 MiB of resident size), which a run that decodes no K-quant should not pay."""
    def dequantize(b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        from . import _kquants

        return getattr(_kquants, name)(b, out)

    return dequantize


_DEQUANT: dict[QType, Callable[[np.ndarray], np.ndarray]] = {
    QType.F32: G.dequantize_f32,
    QType.F16: G.dequantize_f16,
    QType.BF16: G.dequantize_bf16,
    QType.Q8_0: G.dequantize_q8_0,
    QType.Q4_0: G.dequantize_q4_0,
    QType.Q4_1: G.dequantize_q4_1,
    QType.Q5_0: G.dequantize_q5_0,
    QType.Q5_1: G.dequantize_q5_1,
    QType.Q2_K: _kquant("dequantize_q2_k"),
    QType.Q3_K: _kquant("dequantize_q3_k"),
    QType.Q4_K: _kquant("dequantize_q4_k"),
    QType.Q5_K: _kquant("dequantize_q5_k"),
    QType.Q6_K: _kquant("dequantize_q6_k"),
}
_DEQUANT_CHUNK = 1 << 20
#: decoders that write into the output (``fn(blocks, out=...)``): no temporaries per chunk, which a streamed run's
#: heap policy (every block of 128 KiB or more mapped fresh, ktconvert.io.heap) would page-fault in every time
_DEQUANT_INTO = frozenset({QType.Q8_0, QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K})


def cpu_count() -> int:
    """Cores this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


class _Rows:
    """A tensor seen as ``(nrows, row_len)`` float rows, read chunk by chunk as float32 (never whole)."""

    def __init__(self, data: Any, qt: QType, name: str | None):
        self.torch = _is_torch(data)
        if self.torch:
            t = data.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            if not t.is_floating_point():
                raise QuantError(f"cannot quantize a {t.dtype} tensor to {qt.name}: it must hold floats",
                                 where=name, fix="pass the float weights, not already-quantized bytes")
            self.src = t
        else:
            a = data if isinstance(data, np.ndarray) else np.asarray(data)
            if a.dtype.kind != "f":
                raise QuantError(f"cannot quantize a {a.dtype} array to {qt.name}: it must hold floats",
                                 where=name, fix="pass the float weights, not already-quantized bytes")
            self.src = a
        self.shape = tuple(int(s) for s in self.src.shape)
        if not self.shape:
            raise QuantError(f"cannot quantize a scalar to {qt.name}", where=name, fix="reshape it to (1,) first")
        self.n = self.shape[-1]
        self.nrows = int(np.prod(self.shape[:-1], dtype=np.int64))
        self.view = None
        if self.nrows and self.n:
            if self.torch:
                try:
                    self.view = self.src.view(self.nrows, self.n)
                except RuntimeError:
                    self.view = None
            else:
                r = self.src.reshape(self.nrows, self.n)
                self.view = r if np.may_share_memory(r, self.src) else None

    def get(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """Rows r0:r1, columns c0:c1 as a C-contiguous float32 numpy array."""
        if self.view is not None:
            part = self.view[r0:r1, c0:c1]
        else:  # not viewable as 2-D (e.g. a transposed tensor): gather just these rows
            idx = np.unravel_index(np.arange(r0, r1), self.shape[:-1])
            if self.torch:
                import torch

                idx = tuple(torch.from_numpy(np.ascontiguousarray(i)) for i in idx)
            part = self.src[idx][:, c0:c1]
        if self.torch:
            import torch

            return part.to(torch.float32).contiguous().numpy()
        x = np.ascontiguousarray(part, dtype=np.float32)
        # a read-only source (a memmap opened "r") would make torch.from_numpy warn; kernels never write
        # their input, but a chunk-sized copy is cheaper than an ambiguous warning on every run
        return x if x.flags.writeable else x.copy()

    def first_non_finite(self, step: int) -> tuple[int, ...] | None:
        """Index of the first NaN/inf, scanning in bounded chunks; None if all are finite."""
        rows_per = max(1, step // max(self.n, 1))
        for r0 in range(0, self.nrows, rows_per):
            r1 = min(self.nrows, r0 + rows_per)
            for c0 in range(0, self.n, step):
                c1 = min(self.n, c0 + step)
                if self.view is not None and not self.torch:
                    part = self.view[r0:r1, c0:c1]
                    with np.errstate(invalid="ignore"):
                        ok = np.isfinite(part.max()) and np.isfinite(part.min())
                    if ok:
                        continue
                    part = np.asarray(part, dtype=np.float32)
                else:
                    part = self.get(r0, r1, c0, c1)
                    with np.errstate(invalid="ignore"):
                        if np.isfinite(part.max()) and np.isfinite(part.min()):
                            continue
                bad = np.argwhere(~np.isfinite(part))[0]
                flat_row = r0 + int(bad[0])
                lead = np.unravel_index(flat_row, self.shape[:-1]) if len(self.shape) > 1 else ()
                return (*map(int, lead), c0 + int(bad[1]))
        return None


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()


def _pool(n: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``n`` quantizer threads, started once: a fresh pool per call costs thread starts
    that, on a busy machine, outweigh the work of a small tensor. Each ``n`` asked for keeps its own pool, so
    ``workers`` is exactly the number of threads a call uses."""
    with _POOL_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            pool = _POOLS[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="ktconvert-quant")
        return pool


class _NonFinite(Exception):
    """A chunk holds a NaN/inf (internal: turned into a QuantError naming the first one)."""


def _raise_non_finite(rows: _Rows, qt: QType, name: str | None) -> None:
    bad = rows.first_non_finite(1 << 22)
    raise QuantError(f"non-finite value at index {bad}; {qt.name} quantization needs finite weights",
                     where=name, fix="fix or drop the NaN/inf in the source tensor before quantizing")


def _work_items(nrows: int, n: int, bs: int, chunk: int, whole_rows: bool = False
                ) -> Iterator[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) pieces of about ``chunk`` elements; a row longer than that is split at block edges
    unless ``whole_rows`` (the importance-matrix searches of the 32-element types weigh by the whole row)."""
    if n <= chunk or whole_rows:
        rows_per = max(1, chunk // n)
        for r0 in range(0, nrows, rows_per):
            yield r0, min(nrows, r0 + rows_per), 0, n
    else:
        step = max(bs, chunk // bs * bs)
        for r in range(nrows):
            for c0 in range(0, n, step):
                yield r, r + 1, c0, min(n, c0 + step)


def quantize(data: Any, qtype: QType | int | str, *, imatrix: Any = None, workers: int | None = 1,
             name: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Quantize float rows (last axis) to ``qtype``; returns uint8 in byte shape ``(..., row_bytes)``.

    Bit-exact with ggml's ``ggml_quantize_chunk(..., imatrix)``, i.e. what ``llama-quantize`` writes with
    or without (``imatrix=None``) an importance matrix. ``imatrix``: one non-negative float per column,
    shape ``(row_len,)``, or ``(E, row_len)`` for a tensor whose first axis holds ``E`` experts; Q2_K..Q6_K,
    Q4_0..Q5_1 and the IQ types then take ggml's weighted search, Q8_0/F16/BF16/F32 ignore it as ggml does.
    ``data``: a numpy array (float16/32/64, memmaps welcome) or a torch
    tensor (any float dtype, bf16 included); it is read in chunks, so memory beyond ``out`` stays bounded.
    ``workers``: threads over chunks (``None``: every core). ``out``: optional preallocated uint8 array of
    the byte shape (e.g. a memmap into the output file). ``name`` (the tensor's) goes into error messages.

    Raises :class:`QuantError`, before any work, for an unsupported type, a row length the type cannot
    hold, a NaN/inf anywhere in ``data``, or an importance matrix of the wrong shape or with a negative or
    non-finite value. F32/F16/BF16 come back as their raw little-endian bytes.
    """
    qt = as_qtype(qtype)
    if qt not in QUANTIZABLE:
        raise QuantError(f"quantizing to {qt.name} is not implemented", where=name,
                         fix="choose one of " + ", ".join(sorted(t.name for t in QUANTIZABLE)))
    if imatrix is None and qt in IMATRIX_REQUIRED:
        raise QuantError(f"{qt.name} needs an importance matrix: ggml does not quantize it without one", where=name,
                         fix="pass an importance matrix (quantize --imatrix FILE), or choose a type that works "
                             "without one such as IQ3_XXS, IQ4_XS or Q2_K")
    rows = _Rows(data, qt, name)
    check_row(rows.n, qt, name=name)
    qw, rpe = (None, 1) if imatrix is None else _importance(imatrix, rows, qt, name)
    bs, ts = block_size(qt), type_size(qt)
    bshape = (*rows.shape[:-1], rows.n // bs * ts)
    caller_out = out
    if out is None:
        out = np.empty(bshape, dtype=np.uint8)
    elif out.dtype != np.uint8 or tuple(out.shape) != bshape:
        raise QuantError(f"out has dtype {out.dtype} and shape {tuple(out.shape)}; {qt.name} needs uint8 {bshape}",
                         where=name, fix="allocate out with ktconvert.quant.byte_shape(shape, qtype)")
    if rows.nrows == 0:
        return out
    out2 = out.reshape(rows.nrows, bshape[-1])
    if not np.may_share_memory(out2, out):
        raise QuantError("out must be C-contiguous", where=name, fix="allocate out with np.empty or a memmap")
    by_rows = qt in _ROWS_ONLY or (qw is not None and qt in _QUANT_ROWS)
    if by_rows:
        kernel = _row_kernel(qt)
        chunk = _CHUNK
        if qw is None:
            qw = np.zeros((0, rows.n), dtype=np.float32)
    else:
        kname, chunk = _QUANT[qt]
        kernel = _kernel(kname)
    finite = _kernel("finite")
    items = list(_work_items(rows.nrows, rows.n, bs, chunk, whole_rows=by_rows))
    # NaN/inf are refused before anything reaches the caller: with a caller's `out` (a memmap into a file, say)
    # by a scan before any write; otherwise each chunk is checked just before it is quantized, while it is in
    # cache, and the fresh output is dropped on a failure.
    fused = caller_out is None
    if not fused and not all(finite(rows.get(*it)) for it in items):
        _raise_non_finite(rows, qt, name)

    def run(item: tuple[int, int, int, int]) -> None:
        r0, r1, c0, c1 = item
        x = rows.get(r0, r1, c0, c1)
        dst = np.asarray(out2[r0:r1, c0 // bs * ts:c1 // bs * ts])  # a plain ndarray view, even of a memmap
        if qt in _FLOAT_VIEW:  # one pass: the conversion loop checks finiteness itself
            if not kernel(x, dst.view(_FLOAT_VIEW[qt])) and fused:
                raise _NonFinite
            return
        if fused and not finite(x):
            raise _NonFinite
        if by_rows:  # whole rows: the rows' blocks are contiguous in the output
            failed = kernel(x, qw, r0, rpe, dst.reshape(-1, ts))
            if failed is not None and failed >= 0:  # a grid type's search that ggml aborts on
                raise QuantError(f"{qt.name}'s grid search finds no finite distance in row {r0 + failed}: its "
                                 f"weights overflow float32 (values beyond about 1e12), where ggml aborts",
                                 where=name, fix="scale the tensor down, or keep it in F16, BF16 or Q8_0")
        elif dst.flags.c_contiguous:  # whole rows: the kernel writes straight into the output
            kernel(x.reshape(-1, bs), dst.reshape(-1, ts))
        else:  # part of a row longer than a chunk
            q = np.empty((x.size // bs, ts), dtype=np.uint8)
            kernel(x.reshape(-1, bs), q)
            dst[...] = q.reshape(dst.shape)

    nw = cpu_count() if workers is None else max(1, int(workers))
    nw = min(nw, len(items))
    try:
        if nw == 1:
            for it in items:
                run(it)
        else:  # the kernels release the GIL: threads over row slices use nw cores
            pool = _pool(nw)
            futures = [pool.submit(run, it) for it in items]
            for f in futures:  # wait for every one (none keeps writing after we return), then raise the first error
                f.exception()
            for f in futures:
                f.result()
    except _NonFinite:
        _raise_non_finite(rows, qt, name)
    return out


def bf16_to_float32(raw: np.ndarray, out: np.ndarray) -> bool:
    """Widen bf16 rows (uint16 bits, 2-D) into the float32 array ``out`` of the same shape (rows C-contiguous, a
    slice of rows welcome), in one compiled pass; returns whether every value is finite (``out`` is filled either
    way, so the caller can locate a NaN/inf)."""
    if raw.dtype != np.uint16 or out.dtype != np.float32 or raw.shape != out.shape or raw.ndim != 2:
        raise QuantError(f"bf16_to_float32 needs 2-D uint16 and float32 of one shape, got {raw.dtype}{raw.shape} "
                         f"and {out.dtype}{out.shape}", fix="pass the bf16 bits as uint16 rows and a float32 array of "
                         "their shape")
    return bool(_kernel("from_bf16")(raw, out.view(np.int32)))


def quantize_parallel(data: Any, qtype: QType | int | str, *, imatrix: Any = None, workers: int | None = None,
                      name: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """:func:`quantize` on every core (or ``workers`` threads) for one large tensor; same bytes."""
    return quantize(data, qtype, imatrix=imatrix, workers=workers, name=name, out=out)


@lru_cache(maxsize=1)
def _gguf_dequantizable() -> frozenset[QType]:
    """Types the installed ``gguf`` package can dequantize, found by asking it once with one zero block."""
    from gguf import GGML_QUANT_SIZES
    from gguf import quants as gq

    found = set()
    for qt, (_, ts) in GGML_QUANT_SIZES.items():
        try:
            gq.dequantize(np.zeros((1, ts), dtype=np.uint8), qt)
        except (NotImplementedError, ValueError, TypeError, AssertionError):
            continue
        found.add(qt)
    return frozenset(found)


def dequantizable() -> frozenset[QType]:
    """Types :func:`dequantize` accepts: ours plus every type the ``gguf`` package can dequantize."""
    return frozenset(_DEQUANT) | _gguf_dequantizable()


def _as_bytes(data: Any, qt: QType, name: str | None) -> np.ndarray:
    a = data.detach().cpu().numpy() if _is_torch(data) else np.asarray(data)
    if qt == QType.F32 and a.dtype == np.float32 or qt == QType.F16 and a.dtype == np.float16:
        return np.ascontiguousarray(a).view(np.uint8)
    if qt == QType.BF16 and a.dtype in (np.uint16, np.int16):
        return np.ascontiguousarray(a).view(np.uint8)
    if a.dtype != np.uint8:
        raise QuantError(f"{qt.name} data must be uint8 bytes (rows along the last axis); got {a.dtype}",
                         where=name, fix="pass the tensor's raw bytes, e.g. GGUFReader's tensor.data")
    return a


def dequantize(data: Any, qtype: QType | int | str, *, name: str | None = None) -> np.ndarray:
    """Bytes of ``qtype`` (rows along the last axis, as ``GGUFReader`` yields them) -> float32 in element shape.

    Our own decoders (bit-identical to ggml's ``dequantize_row_*``) for the quantizable types, the ``gguf``
    package for everything else it knows (IQ*, TQ*, MXFP4, ...). F32/F16 may also be given as float arrays
    and BF16 as uint16, as ``GGUFReader`` does for F32/F16.
    """
    qt = as_qtype(qtype)
    if qt not in dequantizable():
        raise QuantError(f"dequantizing {qt.name} is not supported", where=name,
                         fix="this build of the gguf package has no decoder for it; upgrade gguf")
    b = _as_bytes(data, qt, name)
    shape = elem_shape(b.shape, qt)
    fn = _DEQUANT.get(qt)
    if fn is None:
        from gguf import quants as gq

        with np.errstate(all="ignore"):  # as below: an overflowed fp16 scale gives the C's inf/NaN too
            return np.asarray(gq.dequantize(np.ascontiguousarray(b), qt), dtype=np.float32).reshape(shape)
    bs, ts = block_size(qt), type_size(qt)
    blocks = b.reshape(-1, ts) if b.flags.c_contiguous else np.ascontiguousarray(b).reshape(-1, ts)
    y = np.empty((blocks.shape[0], bs), dtype=np.float32)
    step = max(1, _DEQUANT_CHUNK // bs)
    with np.errstate(all="ignore"):  # inf*0 in a block with an overflowed fp16 scale is C's NaN too
        for i in range(0, blocks.shape[0], step):
            if qt in _DEQUANT_INTO:
                fn(blocks[i:i + step], out=y[i:i + step])
            else:
                y[i:i + step] = fn(blocks[i:i + step])
    return y.reshape(shape)
