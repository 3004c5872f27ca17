"""Read tensor data and report NaN/Inf values and all-zero experts, one expert (or one bounded chunk) at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ktconvert.errors import InputError
from ktconvert.formats.checkpoint import Checkpoint
from ktconvert.formats.quantized import QuantMap, check_scale, read_cols, read_rows
from ktconvert.formats.naming import NameMatch
from ktconvert.io.dtypes import SAFETENSORS_DTYPES
from ktconvert.formats.kt_amx import scan_dequantized

CHUNK_BYTES = 16 << 20  # raw bytes per decoded block of a non-expert tensor (float32 output is up to 8x)


@dataclass(frozen=True)
class ScanFinding:
    """``kind`` is ``"nan"``, ``"inf"`` or ``"all-zero"``; ``expert`` is set when the unit scanned was one expert."""

    kind: str
    tensor: str
    expert: int | None
    count: int

    @property
    def where(self) -> str:
        return self.tensor if self.expert is None else f"{self.tensor}[expert {self.expert}]"


@dataclass(frozen=True)
class ScanResult:
    findings: tuple[ScanFinding, ...]
    scanned_tensors: int
    scanned_bytes: int
    skipped: tuple[tuple[str, str], ...]  # (tensor, why)


def scan_checkpoint(
    ck: Checkpoint,
    names: Iterable[str] | None = None,
    matches: dict[str, NameMatch] | None = None,
    progress: Callable[[int], None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    fp8: QuantMap | None = None,
) -> ScanResult:
    """Scan ``names`` (default: every tensor). ``matches`` (from :func:`detect_layout`) says which tensors are
    experts, so that all-zero checks run per expert; ``progress`` is called with the bytes done after each unit.
    ``fp8`` (a :class:`~ktconvert.formats.quantized.QuantMap`, every quantized release format): its weights are
    scanned decoded (a NaN or zero scale shows in the values) and their scales checked for NaN, Inf, zero and
    negative values."""
    matches = matches or {}
    findings: list[ScanFinding] = []
    skipped: list[tuple[str, str]] = []
    done_tensors = done_bytes = 0
    for name in names if names is not None else list(ck):
        info = ck[name]
        m = matches.get(name)
        why = None if fp8 is not None and name in fp8.weights else _undecodable(info)
        if fp8 is not None and (name in fp8.weights or name in fp8.scales):
            if name in fp8.weights:
                findings.extend(_scan_fp8(ck, fp8.weights[name], m, chunk_bytes))
            elif fp8.scales[name] in fp8.weights:
                w = fp8.weights[fp8.scales[name]]
                wm = matches.get(w.name)
                findings.extend(ScanFinding(f"scale-{k}", t, wm.expert if wm else None, c)
                                for t, k, c in check_scale(ck, w) if t == name)
            else:
                skipped.append((name, "not checked: no usable FP8 weight for this scale (see the fp8-scale problems)"))
                why = "skip"
            if why != "skip":
                done_tensors += 1
                done_bytes += info.nbytes
        elif why and not (m is not None and m.layout == "kt-amx" and m.group == "experts"):
            skipped.append((name, why))
        else:
            try:
                if m is not None and m.group == "experts":
                    findings.extend(_scan_expert_tensor(ck, name, m))
                else:
                    findings.extend(_scan_plain(ck, name, chunk_bytes))
            except InputError as exc:  # a type no decoder handles yet: say so, keep scanning the rest
                skipped.append((name, exc.message))
            else:
                done_tensors += 1
                done_bytes += info.nbytes
        if progress is not None:
            progress(info.nbytes)
    return ScanResult(tuple(findings), done_tensors, done_bytes, tuple(skipped))


def _undecodable(info) -> str | None:
    if info.ggml_type is None:
        d = SAFETENSORS_DTYPES[info.dtype]
        if not d.is_float:
            return f"{info.dtype} is not a float type"
        if d.bits < 8 or d.bits % 8:
            return f"{info.dtype} is a packed sub-byte type (not decoded)"
        return None
    if info.dtype in ("I8", "I16", "I32", "I64"):
        return f"{info.dtype} is not a float type"
    return None


def _check(x: np.ndarray, name: str, expert: int | None, zero_check: bool) -> list[ScanFinding]:
    out = []
    if x.dtype.kind == "f":
        nan = int(np.count_nonzero(np.isnan(x)))
        inf = int(np.count_nonzero(np.isinf(x)))
        if nan:
            out.append(ScanFinding("nan", name, expert, nan))
        if inf:
            out.append(ScanFinding("inf", name, expert, inf))
    if zero_check and x.size and not x.any():
        out.append(ScanFinding("all-zero", name, expert, int(x.size)))
    return out


def _decode(ck: Checkpoint, name: str, index) -> np.ndarray:
    try:
        return ck.read_float32(name, index)
    except InputError:
        raise
    except (ValueError, TypeError) as exc:  # a decoder rejecting bytes that passed header checks
        raise InputError(f"cannot decode data: {exc}", path=str(ck[name].file), where=f"tensor {name}") from None


def _scan_expert_tensor(ck: Checkpoint, name: str, m: NameMatch) -> list[ScanFinding]:
    if m.layout == "kt-amx":  # unpacked and dequantized with its scales (codes x scale)

        x = scan_dequantized(ck, name)
        return _check(np.asarray(ck.read(name)) if x is None else x, name, m.expert, True)
    if m.expert is not None:  # one tensor per expert
        return _check(_decode(ck, name, None), name, m.expert, True)
    out = []
    n_experts = ck[name].shape[0] if ck[name].shape else 0
    for e in range(n_experts):  # stacked: one expert slab at a time
        out.extend(_check(_decode(ck, name, e), name, e, True))
    return out


def _scan_plain(ck: Checkpoint, name: str, chunk_bytes: int) -> list[ScanFinding]:
    info = ck[name]
    if len(info.shape) <= 1 or info.nbytes <= chunk_bytes:
        return _merge(_check(_decode(ck, name, None), name, None, False))
    rows = info.shape[0]
    step = max(1, chunk_bytes // max(1, info.nbytes // rows))
    found = []
    for start in range(0, rows, step):
        found.extend(_check(_decode(ck, name, slice(start, start + step)), name, None, False))
    return _merge(found)


def _scan_fp8(ck: Checkpoint, w, m: NameMatch | None, chunk_bytes: int) -> list[ScanFinding]:
    """A quantized weight decoded exactly, a bounded run of rows at a time; an expert is also checked for all zeros
    (each expert of a stacked fused weight on its own)."""
    if len(w.shape) == 3:
        return _merge([f for e in range(w.shape[0]) for f in _scan_rows(ck, w, e, chunk_bytes)])
    return _scan_rows(ck, w, m.expert if m is not None and m.group == "experts" else None, chunk_bytes)


def _scan_rows(ck: Checkpoint, w, expert: int | None, chunk_bytes: int) -> list[ScanFinding]:
    """The rows of one weight, or of expert ``expert``'s slab of a stacked one, read as stored (its columns: the
    values are the same, and stored rows decode without a transpose)."""
    stacked = len(w.shape) == 3
    rows, k = (w.shape[2], w.shape[1]) if stacked else w.shape
    step = max(1, chunk_bytes // max(1, k))
    found, nonzero = [], False
    for start in range(0, rows, step):
        end = min(rows, start + step)
        x = read_cols(ck, w, expert, start, end) if stacked else read_rows(ck, w, start, end)
        found.extend(_check(x, w.name, expert, False))
        nonzero = nonzero or bool(x.any())
    if expert is not None and not nonzero:
        found.append(ScanFinding("all-zero", w.name, expert, rows * k))
    return _merge(found)


def _merge(found: list[ScanFinding]) -> list[ScanFinding]:
    """Sum per-chunk counts of one tensor into one finding per kind."""
    total: dict[tuple, int] = {}
    for f in found:
        total[(f.kind, f.tensor, f.expert)] = total.get((f.kind, f.tensor, f.expert), 0) + f.count
    return [ScanFinding(k, t, e, n) for (k, t, e), n in total.items()]
