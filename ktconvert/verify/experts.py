"""Which routed expert of a layer is wrong: each candidate expert against the reference's on the same input.

:class:`ExpertProbe` is a :func:`~ktconvert.model.executor.run_pair` probe. While the reference runs a MoE layer it
records what its routed experts module receives (the hidden rows and the top-k ids, per call) and what each expert
``E`` returns for the rows routed to it (before the routing weight). While the candidate's layer is still resident
(streamed or not), it calls the candidate's experts module (the reference module, or the operator injected in its
place) on exactly those rows with every row routed to ``E`` alone at weight 1, and compares: per expert, the NMSE
``sum((cand - ref)^2) / sum(ref^2)`` over the tokens the reference routed to it. So a fault in one expert (its gate
and up swapped) shows on that expert only, whatever the rest of the layer does, because both see the reference's
input and routing (teacher-forced).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass


@dataclass
class ExpertError:
    expert: int
    tokens: int  # rows the reference routed to it (a token routed twice counts twice)
    nmse: float

    def as_dict(self) -> dict:
        import math

        return {"expert": self.expert, "tokens": self.tokens,
                "nmse": float(self.nmse) if math.isfinite(self.nmse) else None}


def _experts_path(layer) -> str | None:
    from ktconvert.model.modules import RoutedExperts

    return next((p for p, m in layer.named_modules() if isinstance(m, RoutedExperts)), None)


class ExpertProbe:
    """See the module docstring. ``guard``: a context manager factory entered around each call of the candidate's
    experts (verify's module tap looks away from them); ``dtype``: the candidate's compute dtype. ``layers``: layer
    index -> :class:`ExpertError` per expert the reference used, expert order."""

    def __init__(self, guard=None, dtype=None):
        self.guard = guard
        self.dtype = dtype
        self.layers: dict[int, list[ExpertError]] = {}
        self._seen: dict[int, tuple] = {}  # layer -> (experts path, {expert: ([rows], [outputs])})

    @contextmanager
    def reference(self, index: int, layer):
        path = _experts_path(layer)
        if path is None:
            yield
            return
        experts = layer.get_submodule(path)
        seen: dict[int, tuple[list, list]] = {}

        def after(e):
            def hook(_module, args, out):
                rows, outs = seen.setdefault(e, ([], []))
                rows.append(args[0].detach())
                outs.append(out.detach())
            return hook

        handles = [child.register_forward_hook(after(e)) for e, child in enumerate(experts)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        self._seen[index] = (path, seen)

    def candidate(self, index: int, layer) -> None:
        import torch

        got = self._seen.pop(index, None)
        if got is None:
            return
        path, seen = got
        experts = layer.get_submodule(path)
        rows = []
        for e in sorted(seen):
            x = torch.cat(seen[e][0])
            want = torch.cat(seen[e][1]).to(torch.float32)
            n = x.shape[0]
            ids = torch.full((n, 1), e, dtype=torch.long)
            ones = torch.ones((n, 1), dtype=torch.float32)
            with self.guard() if self.guard is not None else nullcontext():
                y = experts(x.to(self.dtype) if self.dtype is not None else x, ids, ones).to(torch.float32)
            den = float((want ** 2).sum())
            num = float(((y - want) ** 2).sum())
            rows.append(ExpertError(e, n, num / den if den > 0 else (0.0 if num == 0 else float("inf"))))
        self.layers[index] = rows

    def worst(self, index: int) -> ExpertError | None:
        """The expert of layer ``index`` with the largest error (the lowest id on a tie), None for a layer without
        routed experts."""
        rows = self.layers.get(index)
        if not rows:
            return None
        return max(rows, key=lambda r: (r.nmse if r.nmse == r.nmse else float("inf"), -r.expert))
