"""Which ggml weight types kt-kernel's LLAMAFILE method runs: the measured table and the questions asked of it.

The table is data, ``rules/kernels/kt-llamafile.yaml`` (schema ``schemas/kt-llamafile-types.schema.json``), written
by ``benchmarks/measure_llamafile_types.py``, which runs each type through the real kernel (one entry per kt-kernel
version and CPU variant). A type *runs* only where every entry measured it and says ``runs``: a launch may land on
any variant, so one failure anywhere refuses it. Preflight, ``check-rules --weights`` and ``quantize --for
kt-llamafile`` ask :func:`problem`; the kernel runner refuses with the same answer before loading.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from ktconvert.diagnostics import ERROR, Diagnostic
from ktconvert.io.datafile import load_data_file
from ktconvert.io.resources import rules_dir

from ._types import QType, block_size, row_ok, type_size

TABLE = Path("kernels") / "kt-llamafile.yaml"
SCHEMA = "kt-llamafile-types"
VERDICT_WORDS = {"aborts": "aborts the process on", "refuses": "refuses", "wrong": "computes wrong results on"}


def table_path() -> Path:
    return rules_dir() / TABLE


@lru_cache(maxsize=4)
def _load(path: str) -> tuple[dict, ...]:
    shown = "rules/kernels/kt-llamafile.yaml" if Path(path) == table_path() else path
    return tuple(load_data_file(path, SCHEMA, "kt-llamafile type table", shown,
                                missing_fix="reinstall ktconvert, or measure it: python benchmarks/"
                                "measure_llamafile_types.py --write").data["measurements"])


def measurements(path: str | Path | None = None) -> tuple[dict, ...]:
    """Every entry of the table (``path``: another table, e.g. a test's)."""
    return _load(str(path or table_path()))


def bits_per_weight(qtype: str) -> float:
    return type_size(qtype) * 8 / block_size(qtype)


def _name(qtype) -> str:
    return qtype.name if isinstance(qtype, QType) else str(qtype).upper()


def failures(qtype: str, path: str | Path | None = None) -> list[dict]:
    """The entries that measured ``qtype`` and found it does not run: ``{"variant", "kt_kernel", "verdict",
    "detail"}``. An entry that did not measure it counts as ``unmeasured``."""
    t = _name(qtype)
    out = []
    for m in measurements(path):
        r = m["types"].get(t)
        if r is None:
            out.append({"variant": m["variant"], "kt_kernel": m["kt_kernel"], "verdict": "unmeasured", "detail": ""})
        elif r["verdict"] != "runs":
            out.append({"variant": m["variant"], "kt_kernel": m["kt_kernel"], "verdict": r["verdict"],
                        "detail": r.get("detail", "")})
    return out


def runnable(path: str | Path | None = None) -> list[str]:
    """Types every entry measured as running, fewest bits first."""
    ms = measurements(path)
    names = set.intersection(*(set(t for t, r in m["types"].items() if r["verdict"] == "runs") for m in ms))
    return sorted(names, key=lambda t: (bits_per_weight(t), t))


def _quant_error(t: str, ms) -> float:
    return max(m["types"][t]["quant_error"] for m in ms)


def closest(qtype: str, row_len: int | None = None, path: str | Path | None = None) -> str | None:
    """The runnable type nearest ``qtype`` that loses no bits: the fewest bits per weight at or above its own
    (ties: the lower measured quantization error), else the most bits below it; only types whose block divides
    ``row_len`` when given. ``None`` when no runnable type can hold such rows."""
    ms = measurements(path)
    cands = [t for t in runnable(path) if row_len is None or row_ok(row_len, t)]
    if not cands:
        return None
    bpw = bits_per_weight(_name(qtype))
    above = [t for t in cands if bits_per_weight(t) >= bpw]
    if above:
        return min(above, key=lambda t: (bits_per_weight(t), _quant_error(t, ms), t))
    return max(cands, key=lambda t: (bits_per_weight(t), -_quant_error(t, ms), t))


def problem(qtype: str, row_len: int | None = None, path: str | Path | None = None) -> Diagnostic | None:
    """``None`` when LLAMAFILE runs ``qtype`` on every measured variant, else what happens and the fix, with the
    closest type that runs as ``extra["alternative"]`` (``None``: no runnable type fits the row length)."""
    t = _name(qtype)
    bad = failures(t, path)
    if not bad:
        return None
    first = bad[0]
    if first["verdict"] == "unmeasured":
        what = f"kt-kernel's LLAMAFILE has not been measured on {t} weights"
    else:
        detail = first["detail"]
        said = f": {detail}" if detail else ""
        what = (f"kt-kernel {first['kt_kernel']}'s LLAMAFILE {VERDICT_WORDS[first['verdict']]} {t} weights "
                f"(measured on its {first['variant']} variant{said})")
    alt = closest(t, row_len, path)
    if alt is not None:
        fix = f"requantize the experts to {alt}, the closest type LLAMAFILE runs"
    else:
        fix = f"use another --kt-method: no type LLAMAFILE runs ({', '.join(runnable(path))}) holds rows of {row_len}"
    return Diagnostic("", ERROR, what, fix, extra={"alternative": alt})
