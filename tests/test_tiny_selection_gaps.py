"""No tiny model's golden may hang on a near-tie of one of its selections.

Every top-k choice a model makes (routed experts, expert groups, DSA / MSA / lightning-indexer keys, k-pool pools)
compares computed scores. Where the k-th and the (k+1)-th score of a row are nearly equal, float32 rounding on
another CPU (or the noise of a quantized candidate) picks the other one, and the golden's logits move far: a
verdict would then depend on the machine. So the tiny models' generators must leave every selection on the golden
prompt a clear gap.

The gap of a row is ``(score_k - score_k+1) / max |score|`` over the row's visible entries (masked keys, filled
with -inf or float32's lowest value, are not candidates; a row with no more candidates than k selects them all).
Scaling by the row's largest magnitude, not by the two scores themselves, is the conservative choice: the rounding
of a computed score follows the magnitude of what went into it. The bound is 1% (float32 noise between CPUs is
about 1e-6 of that scale). Prefill suffices: decode computes the same scores position by position.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ktconvert.golden import golden_root, read_golden
from ktconvert.model import from_pretrained
from ktconvert.model.tiny import write_tiny_model

MIN_GAP = 0.01


def _tiny_goldens() -> list[str]:
    """Each committed golden of a tiny model (the LoRA golden runs the same base model with an adapter merged)."""
    names = []
    for d in sorted(golden_root().iterdir()):
        if (d / "manifest.yaml").is_file() and not d.name.endswith("-lora"):
            names.append(d.name)
    return names


class _Recorder:
    """Wraps ``torch.topk`` and ``Tensor.topk`` while a forward runs and keeps each selecting row's gap."""

    def __init__(self):
        self.gaps: list[tuple[float, str, int]] = []

    def note(self, x: torch.Tensor, k: int, dim: int, largest: bool) -> None:
        if not largest:
            return
        rows = x.detach().double().movedim(dim, -1).reshape(-1, x.shape[dim])
        lowest = torch.finfo(torch.float32).min / 2
        ordered = torch.sort(rows, dim=-1, descending=True).values
        for row in ordered:
            visible = row[torch.isfinite(row) & (row > lowest)]
            if len(visible) <= k:
                continue
            scale = float(visible.abs().max())
            gap = float(visible[k - 1] - visible[k]) / scale if scale > 0 else 0.0
            self.gaps.append((gap, f"top-{k} of {len(visible)}", len(self.gaps)))

    def __enter__(self):
        self._f, self._m = torch.topk, torch.Tensor.topk
        rec, f, m = self, self._f, self._m

        def topk_f(inp, k, dim=-1, largest=True, sorted=True, **kw):
            rec.note(inp, int(k), dim, largest)
            return f(inp, k, dim=dim, largest=largest, sorted=sorted, **kw)

        def topk_m(self_, k, dim=-1, largest=True, sorted=True, **kw):
            rec.note(self_, int(k), dim, largest)
            return m(self_, k, dim=dim, largest=largest, sorted=sorted, **kw)

        torch.topk, torch.Tensor.topk = topk_f, topk_m
        return self

    def __exit__(self, *exc):
        torch.topk, torch.Tensor.topk = self._f, self._m


@pytest.mark.parametrize("name", _tiny_goldens())
def test_every_selection_on_the_golden_prompt_has_a_clear_gap(name, tmp_path, one_torch_thread):
    golden = read_golden(golden_root() / name)
    family = golden.manifest["model"]["family"]
    tiny = golden.manifest["model"]["tiny_model"]
    variant = tiny[len(family) + 1:] if tiny != family else None
    write_tiny_model(family, tmp_path / "m", **({"variant": variant} if variant else {}))
    model = from_pretrained(tmp_path / "m")
    with _Recorder() as rec, torch.no_grad():
        model(torch.from_numpy(golden.input_ids))
    gaps = np.array([g for g, _, _ in rec.gaps])
    if not len(gaps):  # hash-routed or dense selections only
        return
    worst = min(rec.gaps)
    assert worst[0] >= MIN_GAP, (f"{name}: {int((gaps < MIN_GAP).sum())} of {len(gaps)} selections closer than "
                                 f"{MIN_GAP:.0%}; smallest {worst[0]:.2e} ({worst[1]}): change the tiny generator")


def test_the_recorder_sees_a_near_tie():
    """The measurement can fail: a row whose 2nd and 3rd scores differ by 0.1% is reported as such."""
    with _Recorder() as rec:
        torch.tensor([[1.0, 0.5, 0.499, 0.1]]).topk(2)
    assert len(rec.gaps) == 1 and rec.gaps[0][0] == pytest.approx(0.001, rel=1e-3)
    with _Recorder() as rec:  # masked keys are not candidates: nothing to choose among
        torch.topk(torch.tensor([[1.0, 0.5, float("-inf"), torch.finfo(torch.float32).min]]), 2)
    assert rec.gaps == []
