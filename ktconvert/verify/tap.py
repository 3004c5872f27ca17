"""Per-module error: every tapped module of the candidate compared with the same module of the reference.

The reference (the plain float32 model with the checkpoint's own weights) runs each step first and its
modules' inputs and outputs are kept; the candidate then runs the same step and each of its modules is
compared call by call. A module's *input* error says how much error reached it, its *output* error how much
left it; where the output error jumps while the input error is small is where the fault is.

Routing ids are compared as sets per token (DeepSeek's top-k is unsorted); float tensors of the same shape
as the ids (the routing weights) are reordered with them.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ktconvert.verify.metrics import Accumulator

_SKIP = re.compile(r"\.experts\.\d+(\.|$)")  # per-expert modules run as routing decides: not comparable


@dataclass
class ModuleError:
    path: str
    order: int  # first-call order in the step (execution order)
    layer: int | None  # decoder layer index; -1 embeddings; None for the head (final norm, lm_head)
    float_in: list = field(default_factory=list)
    float_out: list = field(default_factory=list)
    ids_in: list = field(default_factory=lambda: [0, 0])  # mismatched, total
    ids_out: list = field(default_factory=lambda: [0, 0])
    calls: int = 0

    @staticmethod
    def _worst(accs: list, ids: list) -> float:
        vals = [a.value for a in accs]
        if ids[1]:
            vals.append(ids[0] / ids[1])
        if any(v != v for v in vals):  # NaN
            return float("nan")
        return max(vals, default=0.0)

    @property
    def nmse_in(self) -> float:
        return self._worst(self.float_in, self.ids_in)

    @property
    def nmse_out(self) -> float:
        return self._worst(self.float_out, self.ids_out)

    @property
    def added(self) -> float:
        """Error this module adds: output error minus input error (NaN output: infinite)."""
        out, inp = self.nmse_out, self.nmse_in
        if out != out:
            return float("inf")
        return max(0.0, out - (inp if inp == inp else 0.0))

    def as_dict(self) -> dict:
        def j(v):
            return float(v) if np.isfinite(v) else None

        return {"module": self.path, "layer": self.layer, "nmse_in": j(self.nmse_in), "nmse_out": j(self.nmse_out),
                "added": j(self.added), "calls": self.calls}


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for t in obj if isinstance(t, torch.Tensor)]
    return []


def _canonical(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Detached numpy copies; ``[N, K]`` integer ids sorted per row, equal-shaped floats permuted alike."""
    out = [t.detach().to(torch.float32).numpy().copy() if t.is_floating_point() else t.detach().numpy().copy()
           for t in tensors]
    for i, t in enumerate(tensors):
        if not t.is_floating_point() and t.dim() == 2 and t.shape[-1] > 1:
            order = np.argsort(out[i], axis=-1, kind="stable")
            for j, u in enumerate(out):
                if u.shape == out[i].shape and (j == i or tensors[j].is_floating_point()):
                    out[j] = np.take_along_axis(u, order, axis=-1)
    return out


def _layer(path: str) -> int | None:
    m = re.match(r"^model\.layers\.(\d+)(\.|$)", path)
    if m:
        return int(m.group(1))
    if path.startswith("model.embed_tokens"):
        return -1
    return None


class ModuleTap:
    """Hooks on both models. Each module's reference calls must come before the candidate's, in the same order:
    the layer-major lockstep of :func:`ktconvert.model.executor.run_pair` runs each layer of the reference, then
    of the candidate, over every position; :meth:`step` after each layer forgets what it kept, and the
    candidate's teacher-forced job runs under :meth:`paused` (its calls are not the candidate's own)."""

    def __init__(self, reference: nn.Module, candidate: nn.Module):
        ref_modules = dict(reference.named_modules())
        self.paths = [p for p, m in candidate.named_modules()
                      if p and p in ref_modules and not _SKIP.search(p) and not isinstance(m, nn.ModuleList)]
        self.errors: dict[str, ModuleError] = {}
        self._ref: dict[str, list] = {}
        self._cursor: dict[str, int] = {}
        self._order = 0
        self._paused = False
        self._muted = False  # another phase's calls (verify runs its phases in one pass): neither model's are kept
        self._handles = []
        cand_modules = dict(candidate.named_modules())
        for p in self.paths:
            self._handles.append(ref_modules[p].register_forward_hook(self._ref_hook(p)))
            self._handles.append(cand_modules[p].register_forward_hook(self._cand_hook(p)))

    def _ref_hook(self, path: str):
        def hook(module, args, output):
            if self._muted:
                return
            self._ref.setdefault(path, []).append((_canonical(_tensors(args)), _canonical(_tensors(output))))
        return hook

    def _cand_hook(self, path: str):
        def hook(module, args, output):
            if self._paused or self._muted:
                return
            calls = self._ref.get(path, [])
            i = self._cursor.get(path, 0)
            self._cursor[path] = i + 1
            if i >= len(calls):
                return  # the candidate called a module the reference did not: nothing to compare with
            ref_in, ref_out = calls[i]
            err = self.errors.get(path)
            if err is None:
                err = self.errors[path] = ModuleError(path, self._order, _layer(path))
                self._order += 1
            err.calls += 1
            self._compare(ref_in, _canonical(_tensors(args)), err.float_in, err.ids_in)
            self._compare(ref_out, _canonical(_tensors(output)), err.float_out, err.ids_out)
        return hook

    @staticmethod
    def _compare(ref: list, cand: list, accs: list, ids: list) -> None:
        fi = 0
        for a, b in zip(ref, cand):
            if a.shape != b.shape:
                continue
            if np.issubdtype(a.dtype, np.floating):
                while len(accs) <= fi:
                    accs.append(Accumulator())
                accs[fi].add(a, b)
                fi += 1
            else:
                ids[0] += int(np.sum(a != b))
                ids[1] += int(a.size)

    def step(self) -> None:
        """Forget the reference calls kept so far (every module that made them has been compared)."""
        self._ref.clear()
        self._cursor.clear()

    @contextmanager
    def paused(self):
        """The candidate's calls in the block are not compared."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @contextmanager
    def muted(self):
        """Neither model's calls in the block are seen (they belong to another phase, with a tap of its own)."""
        self._muted = True
        try:
            yield
        finally:
            self._muted = False

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def results(self) -> list[ModuleError]:
        return sorted(self.errors.values(), key=lambda e: e.order)
