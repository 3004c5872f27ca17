"""``quantize --imatrix``: which output tensors take which importances, checked before anything is written.

llama-quantize's rules (``src/llama-quant.cpp``, the pinned version): every tensor it quantizes looks its own
llama.cpp name up in the importance matrix; with an entry of ``n_in * n_expert`` values it quantizes with it, with
no entry it quantizes without one (and says so), with an entry of another size it refuses (``token_embd.weight``
excepted: quantized without one). ggml's Q8_0, F16, BF16 and F32 ignore an importance matrix. ktconvert refuses,
beyond that, an importance matrix none of whose entries names a tensor of this model (made for another model).

The very low-bit types need one (``tensor_requires_imatrix`` in src/llama-quant.cpp, ggml-org/llama.cpp@0c1e57098: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, and
Q2_K in a Q2_K_S file; never output.weight or token_embd.weight): llama-quantize refuses the whole file when no
importance matrix is given (its first loop, before writing), and aborts at the first such tensor the given one has
no entry for ("the result will be garbage"). ktconvert refuses both before it writes anything
(:func:`refuse_without_imatrix`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from gguf import GGUFValueType

from ktconvert.convert.recipe import requires_imatrix
from ktconvert.errors import InputError, UsageProblem
from ktconvert.formats.gguf_write import encode_kv
from ktconvert.formats.imatrix import Imatrix, read_imatrix
from ktconvert.quant import IMATRIX_TYPES, as_qtype

if TYPE_CHECKING:
    from ktconvert.convert.items import Plan


def provenance_kv(imx: Imatrix, given: str) -> list[tuple[str, bytes]]:
    """The keys llama-quantize adds (tools/quantize/quantize.cpp, as KV overrides): the imatrix path as given and its
    first dataset (each cut to 127 bytes), its entry count and chunk count (UINT32, the latter only when > 0)."""
    def s127(v: str) -> str:
        return v.encode("utf-8")[:127].decode("utf-8", errors="ignore")

    out = [("quantize.imatrix.file", GGUFValueType.STRING, s127(given))]
    if imx.datasets:
        out.append(("quantize.imatrix.dataset", GGUFValueType.STRING, s127(imx.datasets[0])))
    out.append(("quantize.imatrix.entries_count", GGUFValueType.UINT32, len(imx.values)))
    if imx.chunk_count > 0:
        out.append(("quantize.imatrix.chunks_count", GGUFValueType.UINT32, imx.chunk_count))
    return [(k, encode_kv(k, t, v)) for k, t, v in out]


def refuse_without_imatrix(plan: "Plan", imx: Imatrix | None = None, path: str | Path | None = None) -> None:
    """Raise unless every tensor ``plan`` quantizes to a type that needs an importance matrix has one: without any
    (``imx`` None) a :class:`UsageProblem` naming the type and ``--imatrix FILE``; with ``imx`` lacking the
    tensor's entry an :class:`InputError` naming the file and the tensor."""
    ftype = plan.recipe.file_type
    for t in plan.tensors:
        if t.const is not None or t.kt_pack is not None or not requires_imatrix(t.name, t.type, ftype):
            continue
        what = f"file type {ftype}" if ftype else plan.recipe.source
        if imx is None:
            raise UsageProblem(
                f"{t.type} ({what}, first for {t.name}) needs an importance matrix: llama-quantize refuses it "
                "without one", fix="pass --imatrix FILE (made by llama-imatrix for this model), or choose a preset that "
                "needs none (Q3_K_S, IQ3_S, Q4_K_M ...)")
        if imx.for_tensor(t.name, t.shape) is None:
            raise InputError(
                f"has no data for {t.name}, which {what} quantizes to {t.type}: llama-quantize aborts there "
                "(a very low-bit type without importances is garbage)", path=str(path), where=t.name,
                fix="remake the imatrix on text that reaches this tensor, or give it a type that needs none "
                "(Q3_K, IQ3_S, Q4_K ...) with --tensor-type")


def read_selection(path: str | Path, include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> Imatrix:
    """The importance matrix file, read once; refuses ``include`` with ``exclude``. Whether llama-quantize then
    has one at all (``has_imatrix``, which some mixes' choices depend on) is ``bool(.select(include,
    exclude).values)``: a selection that leaves no entry is no importance matrix."""
    if include and exclude:
        raise UsageProblem("--include-weights and --exclude-weights cannot be used together (as in llama-quantize)",
                           fix="keep one of them")
    return read_imatrix(path)


def attach_imatrix(plan: "Plan", path: str | Path, *, include: tuple[str, ...] = (),
                   exclude: tuple[str, ...] = (), whole: Imatrix | None = None) -> "Plan":
    """``plan`` (not laid out yet) with ``imatrix`` set on every tensor quantized to a type that takes one and
    named in the file, and llama-quantize's ``quantize.imatrix.*`` keys to write. ``include``/``exclude``:
    llama-quantize's ``--include-weights``/``--exclude-weights`` (substrings of entry names; one or the other).
    ``whole``: the file as :func:`read_selection` read it (read here when not given)."""
    whole = whole if whole is not None else read_selection(path, include, exclude)
    names = {t.name for t in plan.tensors}
    if not names & set(whole.values):
        first = sorted(whole.values)[0]
        raise InputError(f"none of its {len(whole.values)} entries (first: {first}) names a tensor of this model",
                         path=str(path), where=first, fix="this imatrix was made for another model; remake it "
                         "with llama-imatrix for this model")
    imx = whole.select(include, exclude)
    if not imx.values:  # llama-quantize then quantizes without an importance matrix at all
        refuse_without_imatrix(plan)
        plan.notes.append("--include-weights/--exclude-weights left no importance-matrix entry: quantized without one")
        return plan
    refuse_without_imatrix(plan, imx, path)
    used, without = 0, []
    tensors = []
    for t in plan.tensors:
        if t.const is None and not t.copy_bytes and t.kt_pack is None and as_qtype(t.type) in IMATRIX_TYPES:
            if imx.for_tensor(t.name, t.shape) is not None:
                t = dataclasses.replace(t, imatrix=str(Path(path).resolve()))
                used += 1
            else:
                without.append(t.name)
        tensors.append(t)
    plan.tensors = tensors
    plan.imatrix = {**imx.summary(), "tensors_with": used, "tensors_without": without}
    plan.extra_kv = provenance_kv(imx, str(path))
    if without:
        plan.notes.append(f"the importance matrix has no data for {len(without)} quantized tensor(s) (first: "
                          f"{without[0]}); they are quantized without one, as llama-quantize does")
    for name, experts in sorted(imx.no_data.items()):
        if name in names:
            plan.notes.append(f"the importance matrix has no data for {name} expert(s) {list(experts)[:8]}"
                              f"{' ...' if len(experts) > 8 else ''}: importance 1 there, as llama-quantize")
    return plan
