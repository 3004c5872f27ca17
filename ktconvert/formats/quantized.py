"""Every release format ktconvert reads quantized, behind one interface: recognition, scales attached to their
weights, problems, and exact float32 decoding of a row range (so conversion streams one block of rows at a time).

Formats are recognised from the tensors themselves (names of the companions, dtypes, packed shapes), never from
file names; config.json's ``quantization_config`` only has to agree (a declared group size the tensors contradict
is a problem). Two families of modules:

- E4M3 codes times a scale grid, :mod:`ktconvert.formats.fp8`: ``FP8`` (block-scaled ``_scale_inv``), ``MXFP8``
  (UE8M0 ``_scale_inv`` per 1x32), ``FP8_PERCHANNEL`` (``_scale`` per output row). The weight keeps its name/shape.
- Packed codes, one module each (:mod:`~ktconvert.formats.mxfp4`, :mod:`~ktconvert.formats.nvfp4`,
  :mod:`~ktconvert.formats.rawint4`, :mod:`~ktconvert.formats.gptq`): recognised when the checkpoint is opened,
  which then presents the logical ``X.weight`` ``[N, K]`` (dtype = the format's name) in place of the stored codes.
  :mod:`~ktconvert.formats.mxfp4_fused` (gpt-oss) presents a layer's stacked experts ``X`` ``[E, in, out]``; its
  rows are the flat ``[E * in, out]`` ones, and :func:`read_cols` reads one expert's columns (its stored rows).

Adding a format = one module with ``FMT``, ``match``, ``decode_rows``, ``scale_values`` (and ``encode`` for tiny
releases), listed in :data:`PACKED`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ktconvert.diagnostics import Diagnostic
from ktconvert.errors import InputError
from ktconvert.formats import fp8, gptq, mxfp4, mxfp4_fused, nvfp4, rawint4
from ktconvert.formats.packed import Packed
from ktconvert.formats.tensor_info import TensorInfo

PACKED = (mxfp4, mxfp4_fused, nvfp4, rawint4, gptq)
_BY_FMT = {m.FMT: m for m in PACKED}
#: Every format name this module reports (the ``dtype`` a packed logical weight is shown with).
FORMATS = ("FP8", "MXFP8", "FP8_PERCHANNEL", *(m.FMT for m in PACKED))


@dataclass
class QuantMap:
    """``weights``: logical weight name -> :class:`~ktconvert.formats.fp8.Fp8Weight` or
    :class:`~ktconvert.formats.packed.Packed`; ``scales``: every companion tensor name -> its weight's name;
    ``problems``: empty when usable; ``fp8``: the FP8 part (block size and its source)."""

    fp8: fp8.Fp8Map
    weights: dict = field(default_factory=dict)
    scales: dict[str, str] = field(default_factory=dict)
    problems: list[Diagnostic] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.weights or self.scales or self.problems)

    @property
    def block(self) -> tuple[int, int]:
        return self.fp8.block

    def summary(self) -> dict:
        """Per format: weight count, group sizes (input columns per scale), scale dtypes."""
        out: dict[str, dict] = {}
        for w in self.weights.values():
            f = out.setdefault(fmt_of(w), {"weights": 0, "groups": [], "scale_dtypes": {}})
            f["weights"] += 1
            if w.group not in f["groups"]:
                f["groups"].append(w.group)
            sd = w.scale_dtype if isinstance(w, fp8.Fp8Weight) else None
            if sd is not None:
                f["scale_dtypes"][sd] = f["scale_dtypes"].get(sd, 0) + 1
        for f in out.values():
            f["groups"].sort()
        return out


def fmt_of(w) -> str:
    return w.fmt


# --- recognition at open time (tensors only) --------------------------------------------------------------------


def present_packed(tensors: dict[str, TensorInfo], read_small) -> tuple[dict[str, Packed], list[Packed]]:
    """Find the packed weights among ``tensors`` (names, dtypes, shapes; ``read_small(info)`` reads a tiny tensor
    such as ``weight_shape``): ``({logical name: Packed}, [malformed Packed])``."""
    good: dict[str, Packed] = {}
    bad: list[Packed] = []
    for name in list(tensors):
        for mod in PACKED:
            p = mod.match(tensors, name, read_small)
            if p is not None:
                (bad.append(p) if p.problem else good.__setitem__(p.name, p))
                break
    return good, bad


def overlay(tensors: dict[str, TensorInfo], good: dict[str, Packed]) -> dict[str, TensorInfo]:
    """Replace each packed weight's stored tensor by its logical ``[N, K]`` (dtype = format name) in ``tensors``;
    return the stored infos by logical and stored name (what :meth:`Checkpoint.read` hands out for them)."""
    stored: dict[str, TensorInfo] = {}
    for p in good.values():
        info = tensors.pop(p.stored)
        stored[p.stored] = stored[p.name] = info
        tensors[p.name] = TensorInfo(p.name, p.shape, p.fmt, None, info.file, info.offset, info.nbytes)
    return stored


# --- the whole map --------------------------------------------------------------------------------------------------


def analyze(ck, config: dict | None = None) -> QuantMap:
    """FP8-family weights (:func:`ktconvert.formats.fp8.analyze_fp8`) and the packed weights the checkpoint found,
    with every problem listed (never raised) and the declared ``quantization_config`` checked against them."""
    if config is None:
        config = getattr(ck, "config", None)
    qm = QuantMap(fp8.analyze_fp8(ck, config))
    for name, w in qm.fp8.weights.items():
        qm.weights[name] = w
    qm.scales.update(qm.fp8.scales)
    qm.problems.extend(qm.fp8.problems)
    for p in getattr(ck, "packed", {}).values():
        qm.weights[p.name] = p
        for c in p.companions:
            if c != p.stored:
                qm.scales[c] = p.name
    for p in getattr(ck, "packed_bad", ()):
        qm.problems.append(fp8.tensor_problem(p.problem_tensor, p.problem, p.fix))
    qm.problems.extend(_declared(ck, qm, fp8.quantization_config(config)))
    return qm


def _declared(ck, qm: QuantMap, qc: dict | None) -> list[Diagnostic]:
    """Group sizes the config declares (GPTQ ``group_size``, compressed-tensors ``config_groups.*.weights``) must be
    the ones the tensors use; GPTQ ``bits`` must be 4."""
    if not qc:
        return []
    out: list[Diagnostic] = []
    want: dict[str, int] = {}
    method = qc.get("quant_method")
    where = "config.json quantization_config"
    if method == "gptq":
        if qc.get("bits", 4) != 4:
            first = next((w.name for w in qm.weights.values() if w.fmt == gptq.FMT), "config.json")
            out.append(fp8.tensor_problem(first, f"GPTQ with bits {qc.get('bits')!r}: only 4-bit GPTQ is read",
                                "use a 4-bit release"))
        if type(qc.get("group_size")) is int:
            want[gptq.FMT] = qc["group_size"]
    groups = qc.get("config_groups")
    if method == "compressed-tensors" and isinstance(groups, dict):
        for g in groups.values():
            wts = g.get("weights") if isinstance(g, dict) else None
            if isinstance(wts, dict) and type(wts.get("group_size")) is int:
                fmt = nvfp4.FMT if wts.get("type") == "float" and wts.get("num_bits") == 4 else rawint4.FMT
                want.setdefault(fmt, wts["group_size"])
    for w in qm.weights.values():
        g = want.get(w.fmt)
        if g is None:
            continue
        actual = w.group
        if w.fmt == gptq.FMT and g == -1:
            g = w.shape[1]
        if actual != g:
            out.append(fp8.tensor_problem(w.scale, f"{where} declares group size {g} for {w.fmt}, but the scale of {w.name} "
                                f"has one value per {actual} input columns", "fix group_size in config.json or "
                                "re-download the matching checkpoint"))
            break
    return out


def require(ck, config: dict | None = None, path: str | None = None, analysis: QuantMap | None = None) -> QuantMap:
    """:func:`analyze` (or its ``analysis`` already made), raising the first problem as one :class:`InputError`
    naming the tensor (before any output)."""
    qm = analysis if analysis is not None else analyze(ck, config)
    if qm.problems:
        raise InputError.first_of([(p.message, f"tensor {p.where}", p.fix) for p in qm.problems],
                                  path or str(ck.path), "quantization ")
    return qm


# --- decoding ------------------------------------------------------------------------------------------------------


def read_rows(ck, w, r0: int, r1: int) -> np.ndarray:
    """Rows ``r0..r1`` of the logical weight, decoded exactly to float32, reading only those rows' codes and scales
    (a GPTQ weight reads those columns of its input-major tensors)."""
    if isinstance(w, fp8.Fp8Weight):
        return fp8.read_rows(ck, w, r0, r1)
    return _BY_FMT[w.fmt].decode_rows(ck, w, r0, r1)


def read_row_ids(ck, w, ids: np.ndarray) -> np.ndarray:
    """The rows ``ids`` (any order) decoded; reads the rows between their minimum and maximum."""
    ids = np.asarray(ids)
    if isinstance(w, fp8.Fp8Weight):
        return fp8.read_row_ids(ck, w, ids)
    lo, hi = int(ids.min()), int(ids.max()) + 1
    return read_rows(ck, w, lo, hi)[ids - lo]


def read_float32(ck, w) -> np.ndarray:
    """The whole logical weight decoded, in its logical shape."""
    return read_rows(ck, w, 0, n_rows(w)).reshape(w.shape)


def n_rows(w) -> int:
    """Flat rows of the logical weight (every axis but the last)."""
    n = 1
    for d in w.shape[:-1]:
        n *= d
    return n


def read_cols(ck, w, expert: int, c0: int, c1: int, step: int = 1) -> np.ndarray:
    """Columns ``c0:c1:step`` of expert ``expert``'s slab of a stacked ``[E, in, out]`` weight, as rows: what a
    conversion's transpose segment reads (only fused formats are stacked)."""
    mod = None if isinstance(w, fp8.Fp8Weight) else _BY_FMT[w.fmt]
    if mod is None or not hasattr(mod, "decode_cols"):
        raise AssertionError(f"{w.name}: {w.fmt} weights are 2-D; nothing to transpose")
    return mod.decode_cols(ck, w, expert, c0, c1, step)


def check_scale(ck, w) -> list[tuple[str, str, int]]:
    """``(scale tensor, kind, count)`` for bad scale values: ``nan``, ``inf``, ``zero`` (its group decodes to
    zeros), ``negative`` (a scale is a magnitude; NVFP4's E4M3 scales have a sign bit)."""
    if isinstance(w, fp8.Fp8Weight):
        return [(w.scale, k, c) for k, c in fp8.check_scale(ck, w)]
    out = []
    for tensor, s in _BY_FMT[w.fmt].scale_values(ck, w):
        for kind, mask in (("nan", np.isnan(s)), ("inf", np.isinf(s)), ("zero", s == 0), ("negative", s < 0)):
            c = int(np.count_nonzero(mask))
            if c:
                out.append((tensor, kind, c))
    return out


def companions(w) -> tuple[str, ...]:
    """The tensors read with ``w`` besides its codes."""
    return (w.scale,) if isinstance(w, fp8.Fp8Weight) else tuple(c for c in w.companions if c != w.stored)


def activation_scales(qm: QuantMap) -> list[str]:
    """The activation scales among the companions (NVFP4's ``input_scale``): read with their weights, never needed to
    decode them, and written by no output (none keeps the weights in their release format)."""
    return sorted(n for w in qm.weights.values() if not isinstance(w, fp8.Fp8Weight)
                  for r, n in w.parts if r == "activation")


def activation_scale_note(qm: QuantMap) -> str | None:
    """The plan note that says so, or None when there are none."""
    names = activation_scales(qm)
    if not names:
        return None
    fmts = sorted({qm.weights[qm.scales[n]].fmt for n in names})
    return (f"{len(names)} {'/'.join(fmts)} activation scale(s) (input_scale, e.g. {names[0]}) not carried: they "
            "scale the activations of a W4A4 kernel, the weights decode exactly without them, and no ktconvert "
            "output keeps a weight in its release format to pair them with")


def describe(w) -> dict:
    """What inspect shows per quantized weight: format, group, every companion tensor."""
    if isinstance(w, fp8.Fp8Weight):
        return {"format": w.fmt, "group": list(w.block), "scale": w.scale, "companions": [w.scale]}
    return {"format": w.fmt, "group": [1, w.group], "scale": w.scale, "companions": list(companions(w)),
            "stored": w.stored}
