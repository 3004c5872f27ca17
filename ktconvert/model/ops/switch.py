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

    def forward(self, *args):
        op = self.ops.get(self.mode)
        if op is None:
            raise RuntimeError(f"{self.path}: no {self.mode} op (the rule selects {self.names.get(self.mode)!r}); "
                               f"upstream asserts here")
        return op(*args)
