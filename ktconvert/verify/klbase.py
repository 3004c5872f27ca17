"""``verify --golden FILE`` where FILE is llama.cpp's KL-divergence base file (``llama-perplexity
--kl-divergence-base``, or ``ktconvert golden --kl-base``): the candidate measured against the base's own
log-probabilities, as ``llama-perplexity --kl-divergence`` measures a llama.cpp model against it.

* **Recognised** by what it is, not by its name: ``--golden`` naming a regular file (not a golden directory) is read
  as a base file, which must begin with the ``_logits_`` magic (:func:`ktconvert.golden.kld.read_kl_base`).
* **Run** as llama.cpp runs it: each chunk's ``n_ctx`` tokens from a fresh cache (with the model's BOS at each
  chunk's position 0 when its vocabulary adds one, :func:`ktconvert.imatrix.collect.bos_policy`), prefill then
  token-by-token decode as every verify; the scored rows are positions ``n_ctx // 2 .. n_ctx - 2`` of each chunk.
* **Compared** on what the file holds: per scored row KL(base || candidate) over the base's log-probabilities above
  -16 (llama.cpp's sum), top-1 and top-k agreement. The file holds no logits (``max_abs_diff`` and ``nmse_max``
  are null and not judged) and no hidden states (no per-layer NMSE, no localisation: those need a ktconvert golden
  directory).
* **Judged** by the profile's KL, top-1 and top-k limits, its KL limits widened by the base's own quantization error:
  a row keeps ``log p`` in 16-bit steps of ``range / 65535`` (range: the row's logit spread, at most 16 nats, so a
  step is at most 2.4e-4), within half a step, so a candidate equal to the model the base came from measures
  ``|KL| <= sum p * (step / 2 + float32 rounding)`` at that row; the largest such bound over the rows is the
  allowance. Top-1 sets aside, besides the profile's near-ties, rows whose stored top-2 gap is under two steps.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from ktconvert.errors import InputError, UsageProblem
from ktconvert.golden.kld import LOG_RANGE, KlBase, read_kl_base
from ktconvert.verify.metrics import LogitStats, compare_logits, first_nonfinite, tie_margins
from ktconvert.verify.profile import Breach, Profile, evaluate

KIND = "kl-divergence-base"
#: float32's machine epsilon: the base's ``scale * q + min_log_prob`` is two float32 roundings of numbers up to ~16
_F32 = float(np.finfo(np.float32).eps)
NO_LOCALISATION = ("per-layer hidden-state NMSE and localisation need a ktconvert golden directory (ktconvert golden "
                   "MODEL OUT): a KL-divergence base file holds only the log-probabilities of the scored positions")


@dataclass
class BaseLogitStats(LogitStats):
    """:class:`LogitStats` over a base file's scored rows (chunk by chunk): indices in the summary count those rows;
    each per-position entry gives its ``chunk`` and its ``position`` in the chunk. No logits: max |diff| and NMSE
    are null."""

    n_ctx: int = 0
    rows: int = 1

    def per_position(self) -> list[dict]:
        out = super().per_position()
        for r in out:
            r["chunk"], r["position"] = divmod(r["position"], self.rows)
            r["position"] += self.n_ctx // 2
        return out


def allowance(base: KlBase) -> np.ndarray:
    """Per scored row (chunk by chunk), the most |KL| the base's quantization alone can show: ``sum p`` over the
    kept log-probabilities times half a step plus float32 rounding of values up to the row's least log p."""
    out = []
    for chunk in range(base.n_chunk):
        lp = base.log_probs(chunk).astype(np.float64)
        kept = np.where(lp > -LOG_RANGE, np.exp(lp), 0.0).sum(axis=1)
        out.append(kept * (0.5 * base.scales[chunk] + 2 * _F32 * np.abs(lp.min(axis=1))))
    return np.concatenate(out)


def compare_base(base: KlBase, chunk: int, cand: np.ndarray, profile: Profile) -> LogitStats:
    """The candidate's logits at ``chunk``'s scored rows ``[rows, n_vocab]`` against the base's log-probabilities.

    KL is llama.cpp's: ``sum p_base (log p_base - log q)`` over ``log p_base > -16``, with the candidate's full
    log-softmax. Near-tie margins: the profile's (derived from the base row centred on its mean, which stands in for
    the logits), and at least two quantization steps."""
    ref = base.log_probs(chunk).astype(np.float64)
    cand = np.asarray(cand, dtype=np.float64)
    margins = tie_margins(ref - ref.mean(axis=1, keepdims=True), profile.logits.get("nmse_max"),
                          profile.top1_tie_margin)
    margins = np.maximum(margins, 2.0 * base.scales[chunk])
    stats = compare_logits(ref, cand, profile.topk, margins)
    with np.errstate(invalid="ignore", over="ignore"):
        lq = cand - cand.max(axis=1, keepdims=True)
        lq = lq - np.log(np.exp(lq).sum(axis=1, keepdims=True))
        kl = np.where(ref > -LOG_RANGE, np.exp(ref) * (ref - lq), 0.0).sum(axis=1)
    finite = np.isfinite(cand).all(axis=1)
    stats.kl = np.where(finite, kl, np.nan)  # may be a little below 0: the base's rounding, inside the allowance
    stats.max_abs = np.full(len(kl), np.nan)
    stats.nmse = np.full(len(kl), np.nan)
    return stats


def merge(base: KlBase, parts: list[LogitStats]) -> BaseLogitStats:
    """The chunks' stats as one, their rows in order."""
    cat = {f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(LogitStats) if f.name != "k"}
    return BaseLogitStats(**cat, k=parts[0].k, n_ctx=base.n_ctx, rows=len(base.positions))


def judged_profile(profile: Profile, kl_allowance: float) -> Profile:
    """The limits a base file can be held to: the profile's KL limits plus ``kl_allowance``, its top-1 and top-k
    limits; no logit max |diff| or NMSE limit (no logits in the file), no hidden-state limit (no hidden states)."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in profile.data.items() if k != "hidden_states"}
    logits = data.setdefault("logits", {})
    for key in ("max_abs_diff", "nmse_max"):
        logits.pop(key, None)
    for key in ("kl_mean", "kl_p99", "kl_max"):
        if logits.get(key) is not None:
            logits[key] = float(logits[key]) + kl_allowance
    return Profile(profile.name, profile.source, data, profile.family)


def _row(base: KlBase, row: int) -> str:
    chunk, at = divmod(row, len(base.positions))
    return f"chunk {chunk} position {base.positions.start + at}"


def phase_stats(name: str, run, base: KlBase, bos: int | None, layerwise: bool, step: int | None, profile: Profile,
                progress) -> tuple[BaseLogitStats, dict | None]:
    """One phase of the candidate over every chunk, each from a fresh cache and compared as it ends (one chunk's
    logits and log-probabilities held at a time): the stats, and the first NaN/Inf (``position``: the scored row)."""
    import torch

    pos = base.positions
    n_layers = len(run.candidate.model.model.layers)
    parts, nonfinite = [], None
    began = time.perf_counter()

    def on_layer(index, *_):
        progress(name, index + 1, n_layers, time.perf_counter() - began)

    run.injected.set_layerwise(layerwise)
    try:
        with torch.no_grad():
            for chunk in range(base.n_chunk):
                ids = torch.tensor([base.prompt(chunk, bos)], dtype=torch.long)
                out = run.candidate.run(ids, step=step, on_layer=on_layer if progress else None)
                cand = out.logits[0, pos.start:pos.stop].to(torch.float32).numpy()
                del out
                if nonfinite is None and (bad := first_nonfinite(cand)) is not None:
                    nonfinite = {"where": "logits", "layer": None, "position": chunk * len(pos) + int(bad[0]),
                                 "index": int(bad[1])}
                parts.append(compare_base(base, chunk, cand, profile))
    finally:
        run.injected.set_layerwise(False)
    return merge(base, parts), nonfinite


def judge(name: str, base: KlBase, stats: BaseLogitStats, nonfinite: dict | None, judged: Profile) -> list[Breach]:
    """The limits of ``judged`` a phase breaks, each placed at its chunk and position."""
    breaches = evaluate(judged, name, stats.summary(), [])
    for b in breaches:  # the summary counts scored rows: say which chunk and position a row is
        b.where = re.sub(r"position (\d+)", lambda m: _row(base, int(m.group(1))), b.where)
    if nonfinite is not None:
        breaches.insert(0, Breach(name, "nonfinite", None, None, "",
                                  f"logits, {_row(base, nonfinite['position'])}, index {nonfinite['index']}"))
    return breaches


def load_base(model_dir: Path, base_path, n_vocab: int, lora) -> tuple[KlBase, int | None]:
    """The base file, checked against the model's vocabulary, and the BOS llama.cpp puts at each chunk's position
    0 for this model (None: its vocabulary adds none, or it has no tokenizer llama.cpp's converter reads)."""
    from ktconvert.imatrix.collect import bos_policy

    if lora is not None:
        raise UsageProblem("--lora needs a golden directory made with `ktconvert golden --lora`: a KL-divergence base "
                           "file records no adapter", fix="pass --golden DIR made with the adapter, or drop --lora")
    base = read_kl_base(base_path, n_vocab=n_vocab)
    try:
        bos = bos_policy(model_dir)
    except InputError:
        bos = None
    return base, bos


def notes(base: KlBase, kl_allowance: float) -> list[str]:
    return [NO_LOCALISATION,
            f"the base's log-probabilities are stored in 16-bit steps (up to {float(base.scales.max()):.3g} nats "
            f"here): the KL limits are widened by {kl_allowance:.3g}, the most |KL| that rounding alone shows at a "
            "row; max |diff| and NMSE of logits are not judged (the file holds log-probabilities, not logits)"]


def golden_record(base: KlBase, bos: int | None, kl_allowance: float) -> dict:
    """The report's ``golden`` for a base file."""
    return {"dir": str(base.path), "name": base.path.name, "positions": base.n_chunk * len(base.positions),
            "kind": KIND, "kl_base": {"n_ctx": base.n_ctx, "n_vocab": base.n_vocab, "n_chunk": base.n_chunk,
                                      "scored_positions": [base.positions.start, base.positions.stop - 1],
                                      "bos": bos, "step_max": float(base.scales.max()), "kl_allowance": kl_allowance}}
