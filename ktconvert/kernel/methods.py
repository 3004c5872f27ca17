"""What each kt-kernel method reads and which launches it cannot run, as data and pure checks.

Known from running kt-kernel 0.7.2 here and from its C++ asserts (see the kt-kernel facts): none of these
combinations is caught by the kernel before weights load; some abort the process, some give silent garbage.
Shared by the kernel runner (refuse before loading) and ``preflight`` (refuse before a launch).
"""

from __future__ import annotations

from dataclasses import dataclass

from ktconvert.diagnostics import ERROR, Diagnostic
from ktconvert.quant import kt_llamafile

QK_K = 256
# the one FP8 block kt-kernel's FP8 method reads (its kernels fix group_size = 128 for both block dimensions)
FP8_BLOCK = 128


@dataclass(frozen=True)
class Method:
    name: str
    reads: str  # the weight format, in words
    fmt: str  # gguf | kt-amx-int8 | kt-amx-int4 | hf-bf16 | hf-fp8 | hf-release
    classes: tuple[str, ...]  # kt_kernel_ext.moe classes any of which runs it
    driven: bool  # the ktconvert runner drives it (verify --kernel)
    release: str = ""  # the release format it reads as released (formats.quantized); the runner loads it through
    # kt-kernel's own loader (KernelSession.load_release_layer)


METHODS = {m.name: m for m in (
    Method("LLAMAFILE", "GGUF merged experts (blk.L.ffn_{gate,up,down}_exps.weight)", "gguf", ("MOE",), True),
    Method("AMXINT8", "kt-amx directory, INT8", "kt-amx-int8", ("AMXInt8_MOE",), True),
    Method("AMXINT4", "kt-amx directory, INT4", "kt-amx-int4", ("AMXInt4_MOE",), True),
    Method("BF16", "HF bf16 safetensors as released", "hf-bf16", ("AMXBF16_MOE", "AVX2BF16_MOE"), True),
    Method("FP8", "HF FP8 block-128 safetensors as released", "hf-fp8", ("AMXFP8_MOE", "AVX2FP8_MOE"), False,
           "FP8"),
    Method("FP8_PERCHANNEL", "HF per-channel FP8 as released", "hf-release", ("AMXFP8PerChannel_MOE",), False,
           "FP8_PERCHANNEL"),
    Method("RAWINT4", "compressed-tensors INT4 as released", "hf-release",
           ("AMXInt4_KGroup_MOE", "AVX2RawInt4_MOE", "AVXVNNI256RawInt4_MOE"), False, "RAWINT4"),
    Method("GPTQ_INT4", "GPTQ INT4 as released", "hf-release",
           ("AVX2GPTQInt4_MOE", "AVXVNNI256GPTQInt4_MOE"), False, "GPTQ_INT4"),
    Method("MXFP4", "MXFP4 (DeepSeek-V4 names) as released", "hf-release", ("AVX2MXFP4_MOE", "AMXFP4_KGroup_MOE"), False,
           "MXFP4"),
    Method("MXFP8", "MXFP8 as released", "hf-release", ("AVX2MXFP8_MOE", "AMXMXFP8_KGroup_MOE"), False, "MXFP8"),
    Method("NVFP4", "NVFP4 as released", "hf-release", ("AVX2MXFP4_MOE",), False, "NVFP4"),
)}


# the kt-kernel method that reads each release format as released
RELEASE_METHOD = {m.release: m.name for m in METHODS.values() if m.release}
# the expert names kt-kernel's loader of a method finds (its other release loaders take the HF names)
LOADER_NAMES = {"MXFP4": (".ffn.experts.", "DeepSeek-V4 names (…ffn.experts.N.w1/w3/w2)"),
                "MXFP8": (".block_sparse_moe.experts.", "MiniMax-M3 names (…block_sparse_moe.experts.N.w1/w3/w2)")}


def runs_here(method: str, classes: list[str] | tuple[str, ...]) -> bool:
    """Whether the loaded kt_kernel_ext variant (its MoE class names) has a class for ``method``."""
    m = METHODS.get(method)
    return m is not None and any(c in classes for c in m.classes)


def _cannot(what: str, fix: str) -> Diagnostic:
    """Why a method cannot run a given layer shape or weight type, and what to do."""
    return Diagnostic("", ERROR, what, fix)


def shape_problems(method: str, *, hidden: int, inter: int, parts: int = 1) -> list[Diagnostic]:
    """The alignment rules the kernel's C++ enforces (by throwing or aborting), for H, I and P parts."""
    out: list[Diagnostic] = []
    if parts < 1:
        return [_cannot(f"threadpool count {parts} is not positive", "pass a threadpool count of 1 or more")]
    if method == "LLAMAFILE":
        if inter % QK_K:
            out.append(_cannot(f"LLAMAFILE needs I % 256 == 0, I = {inter}",
                               "use a method without this rule (BF16, AMXINT8) or a model whose I is a multiple of 256"))
        elif inter // QK_K < parts:
            out.append(_cannot(f"LLAMAFILE needs I / 256 >= threadpool count, I = {inter}, threadpools = {parts}",
                               f"use at most {inter // QK_K} threadpool(s)"))
    elif method in ("AMXINT8", "AMXINT4"):
        align = 64 if method == "AMXINT8" else 128
        if inter % parts:
            out.append(_cannot(f"{method} needs I % threadpools == 0, I = {inter}, threadpools = {parts}",
                               "pick a threadpool count that divides I"))
        elif (inter // parts) % align:
            out.append(_cannot(f"{method} needs (I / threadpools) % {align} == 0, I / {parts} = {inter // parts}",
                               "use fewer threadpools or another method"))
        if hidden % align:
            out.append(_cannot(f"{method} needs H % {align} == 0, H = {hidden}", "use another method (LLAMAFILE, BF16)"))
    return out


def type_problems(method: str, types: dict[str, str], row_lens: dict[str, int] | None = None) -> list[Diagnostic]:
    """Weight types a method cannot run: for LLAMAFILE, every type the measured table
    (``rules/kernels/kt-llamafile.yaml``, :mod:`ktconvert.quant.kt_llamafile`) does not list as running on every
    variant, with the closest type that runs (for rows of ``row_lens[proj]`` elements when given)."""
    out: list[Diagnostic] = []
    if method != "LLAMAFILE":
        return out
    for proj, t in types.items():
        p = kt_llamafile.problem(t, (row_lens or {}).get(proj))
        if p is not None:
            out.append(_cannot(f"{p.message} ({proj})", p.fix))
    return out
