"""The stand-in for upstream's wrapper operators (``KTransformersExperts``, ``KTransformersLinear``)."""

from __future__ import annotations

from torch import nn


class PhaseSwitch(nn.Module):
    """Runs the generate op or the prefill op, as the wrapper upstream does after ``set_inference_mode``.

    The ops are held in a plain dict, not as submodules, so the module tree (and its hooks and state dict)
    keeps upstream's shape: the wrapper sits at the original module's path with nothing below it.
    """

    def __init__(self, path: str, ops: dict, names: dict):
        super().__init__()
        self.path = path
        self.ops = ops  # {"generate": module | None, "prefill": module | None}
        self.names = names  # {"generate": op name | None, "prefill": op name | None}
        self.mode = "generate"
        self.builders: dict | None = None  # {"generate": fn | None, "prefill": fn | None}: ops built per part
        self.described: dict = {}  # with builders: what inject learnt of each op (describe, resident_bytes)

    def load(self) -> None:
        """Build the ops (``inject(..., lazy=True)``: a streamed candidate builds them when their layer runs); one
        builder serving both modes builds one op, as ``inject`` shares it."""
        if self.builders is None:
            return
        made: dict[int, object] = {}
        for mode, build in self.builders.items():
            if build is not None and id(build) not in made:
                made[id(build)] = build()
        self.ops = {mode: None if b is None else made[id(b)] for mode, b in self.builders.items()}

    def release(self) -> None:
        """Drop the ops :meth:`load` built (their weights go with them; an op holding memory elsewhere, the real
        kernel's layer in its child process, is told to free it)."""
        if self.builders is not None:
            for op in {id(o): o for o in self.ops.values() if o is not None}.values():
                if callable(getattr(op, "release", None)):
                    op.release()
            self.ops = {mode: None for mode in self.ops}

    def forward(self, *args):
        op = self.ops.get(self.mode)
        if op is None:
            raise RuntimeError(f"{self.path}: no {self.mode} op (the rule selects {self.names.get(self.mode)!r}); "
                               f"upstream asserts here")
        return op(*args)
