"""``quantize --for TARGET``: the output must run on a named backend; checked on the plan, before any data is read.

``kt-llamafile``: kt-kernel's LLAMAFILE method reads the GGUF's merged experts (``blk.L.ffn_{gate,up,down}_exps``)
as stored, and runs only the types its measured table lists (:mod:`ktconvert.quant.kt_llamafile`). An expert tensor
the plan would write in another type is refused, naming the tensor, its type and the closest type that runs, with
the override that asks for it: the type came from the user's own choice (``--type``, the recipe, ``--tensor-type``,
or ``keep`` of a source in that type), so ktconvert does not silently write another one. Non-expert tensors are
not LLAMAFILE's and are left as planned.
"""

from __future__ import annotations

import re

from ktconvert.errors import UsageProblem
from ktconvert.quant import kt_llamafile

TARGETS = ("kt-llamafile",)
_EXPERTS = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.weight$")


def check_target(plan, target: str | None) -> None:
    """Raise :class:`UsageProblem` (exit 2) when ``plan`` cannot serve ``target``; nothing is written yet."""
    if target is None:
        return
    if target not in TARGETS:
        raise UsageProblem(f"--for {target}: unknown target", where="--for", fix=f"use one of {', '.join(TARGETS)}")
    if plan.format != "gguf":
        raise UsageProblem(f"--for {target} needs GGUF output (LLAMAFILE reads a GGUF), not {plan.format}",
                           where="--for", fix="drop --to, or use --to gguf")
    for t in plan.tensors:
        if not _EXPERTS.match(t.name):
            continue
        prob = kt_llamafile.problem(t.type, int(t.shape[-1]))
        if prob is None:
            continue
        how = t.fallback_from and f" (llama.cpp's fallback for {t.fallback_from})" or ""
        fix = prob.fix
        if alt := prob.extra["alternative"]:
            fix += f": add --tensor-type '\\.ffn_(gate|up|down)_exps\\.weight$={alt}'"
            if t.src_dtype and t.src_dtype not in ("F32", "F16", "BF16"):
                fix += " --allow-requantize"
        raise UsageProblem(f"{t.name} would be written as {t.type}{how}, which {target} cannot run: {prob.message}",
                           where="--for", fix=fix)
