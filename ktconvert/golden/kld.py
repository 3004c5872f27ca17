"""llama.cpp's KL-divergence base file (``llama-perplexity --kl-divergence-base FILE``), written from a golden and
read as one, so llama.cpp's own runs can be measured against the release and ktconvert against llama.cpp's base.

The layout, as llama.cpp's ``tools/perplexity/perplexity.cpp`` writes and reads it (little-endian):

* ``_logits_`` (8 bytes), ``n_ctx`` (uint32), ``n_vocab`` (int32), ``n_chunk`` (int32);
* the evaluated tokens, ``n_chunk * n_ctx`` int32, as tokenized (llama.cpp puts BOS at each chunk's position 0 at
  run time when the vocabulary adds one; the file keeps the token it replaced);
* per chunk, one row per position ``p`` of ``n_ctx // 2 .. n_ctx - 2`` (the distribution of token ``p + 1``,
  computed with a fresh cache per chunk): ``nv = 2 * ((n_vocab + 1) // 2) + 4`` uint16, of which the first four
  hold two float32, ``scale`` and ``min_log_prob``, then ``n_vocab`` quantized log-probabilities:
  ``log p[i] = scale * q[i] + min_log_prob``, where ``min_log_prob`` is the row's least logit (clamped to 16
  below the largest) minus the log-sum-exp, ``scale`` the clamped range / 65535, ``q[i]`` the logit's distance
  above the least in steps of ``scale``, rounded to nearest even, and 0 at or below it.

A golden (one prompt, one sequence) is written as one chunk with ``n_ctx`` the prompt's length.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert.errors import InputError

MAGIC = b"_logits_"
HEADER = struct.Struct("<8sIii")
#: llama.cpp keeps log-probabilities down to this far below the row's largest logit (the rest quantize to it)
LOG_RANGE = 16.0
#: the fewest positions a base file can score: n_ctx // 2 .. n_ctx - 2 is empty below 3
MIN_CTX = 3


def row_width(n_vocab: int) -> int:
    """uint16 per row: two float32 (scale, min_log_prob) then the vocabulary, padded to an even count."""
    return 2 * ((n_vocab + 1) // 2) + 4


def scored_positions(n_ctx: int) -> range:
    """The positions of a chunk whose next-token distribution the file holds."""
    return range(n_ctx // 2, n_ctx - 1)


def quantize_rows(logits: np.ndarray) -> np.ndarray:
    """``[rows, n_vocab]`` float32 logits -> ``[rows, row_width]`` uint16 rows, as llama.cpp's ``log_softmax``
    writes them (float32 arithmetic, the exponent sum in double, rounding half to even)."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    rows, n_vocab = logits.shape
    out = np.zeros((rows, row_width(n_vocab)), dtype=np.uint16)
    for r, row in enumerate(logits):
        top = row.max()
        low = np.maximum(row.min(), np.float32(top - np.float32(LOG_RANGE)))
        sum_exp = float(np.sum(np.exp(row - top).astype(np.float64)))
        log_sum_exp = np.float32(np.log(sum_exp))
        min_log_prob = np.float32(np.float32(low - top) - log_sum_exp)
        scale = np.float32(np.float32(top - low) / np.float32(65535.0))
        out[r, :4] = np.array([scale, min_log_prob], dtype=np.float32).view(np.uint16)
        if scale:
            inv = np.float32(np.float32(1.0) / scale)
            q = np.rint(inv * (row - low)).astype(np.int64)
            out[r, 4:4 + n_vocab] = np.where(row > low, q, 0).astype(np.uint16)
    return out


def dequantize_rows(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """``[rows, row_width]`` uint16 -> ``[rows, n_vocab]`` float32 log-probabilities, as llama.cpp reads them."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)
    scale, min_log_prob = head[:, :1], head[:, 1:2]
    return (scale * rows[:, 4:4 + n_vocab].astype(np.float32) + min_log_prob).astype(np.float32)


def encode(tokens: list[int], logits: np.ndarray) -> bytes:
    """The base file of one chunk: ``tokens`` (the prompt, ``n_ctx`` of them) and its prefill ``logits``
    ``[n_ctx, n_vocab]``."""
    logits = np.asarray(logits, dtype=np.float32)
    n_ctx, n_vocab = logits.shape
    if len(tokens) != n_ctx:
        raise InputError(f"{len(tokens)} tokens but logits for {n_ctx} positions")
    if n_ctx < MIN_CTX:
        raise InputError(f"a KL-divergence base file needs a prompt of at least {MIN_CTX} tokens, this one has {n_ctx}",
                         fix=f"use a prompt of at least {MIN_CTX} tokens (llama.cpp scores positions n_ctx/2..n_ctx-2)")
    pos = scored_positions(n_ctx)
    head = HEADER.pack(MAGIC, n_ctx, n_vocab, 1) + np.asarray(tokens, dtype="<i4").tobytes()
    return head + quantize_rows(logits[pos.start:pos.stop]).astype("<u2").tobytes()


def write_kl_base(path: str | os.PathLike, tokens: list[int], logits: np.ndarray) -> Path:
    """Write :func:`encode`'s bytes to ``path`` atomically (whole or not at all)."""
    from ktconvert.io.atomic import write_file

    write_file(path, encode(tokens, logits))
    return Path(path)


@dataclass
class KlBase:
    """A KL-divergence base file read back: ``tokens`` ``[n_chunk, n_ctx]`` as stored, and each chunk's
    log-probabilities at ``positions`` (:meth:`log_probs`), dequantized from the memory-mapped file when asked for,
    so a base file of any size is read one chunk at a time."""

    path: Path
    n_ctx: int
    n_vocab: int
    tokens: np.ndarray
    rows: np.ndarray = field(repr=False)  # [n_chunk * len(positions), row_width] uint16, memory-mapped
    scales: np.ndarray = field(default=None)  # [n_chunk, len(positions)]: each row's 16-bit step, in nats

    def log_probs(self, chunk: int) -> np.ndarray:
        """``[len(positions), n_vocab]`` float32: ``chunk``'s log-probabilities, as llama.cpp reads them."""
        n = len(self.positions)
        return dequantize_rows(self.rows[chunk * n:(chunk + 1) * n], self.n_vocab)

    @property
    def n_chunk(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def positions(self) -> range:
        return scored_positions(self.n_ctx)

    def prompt(self, chunk: int, bos: int | None = None) -> list[int]:
        """The ids llama.cpp evaluated for ``chunk``: its tokens, with ``bos`` at position 0 when the model's
        vocabulary adds one (llama.cpp substitutes it at run time; the file keeps the token it replaced)."""
        ids = [int(t) for t in self.tokens[chunk]]
        if bos is not None:
            ids[0] = int(bos)
        return ids


def read_kl_base(path: str | os.PathLike, *, n_vocab: int | None = None) -> KlBase:
    """Read and check a base file: magic, counts against the file's size (checked before anything is allocated),
    token ids inside the vocabulary, finite scales; ``n_vocab``: the model's vocabulary, which the file must have
    been made with (a base file of another model is refused)."""
    from ktconvert.io.files import regular_file_size

    p = Path(path)
    shown = str(p)
    size = regular_file_size(p, "KL-divergence base file")
    with open(p, "rb") as fh:
        head = fh.read(HEADER.size)
        if len(head) < HEADER.size or head[:8] != MAGIC:
            raise InputError("not a llama.cpp KL-divergence base file (no _logits_ header)", path=shown,
                             fix="pass a file written by llama-perplexity --kl-divergence-base or ktconvert golden --kl-base, "
                                     "or a golden directory (manifest.yaml + golden.safetensors)")
        _, n_ctx, vocab, n_chunk = HEADER.unpack(head)
        if n_ctx < MIN_CTX or vocab < 1 or n_chunk < 1:
            raise InputError(f"n_ctx {n_ctx}, n_vocab {vocab}, n_chunk {n_chunk}: not a usable base file", path=shown,
                             where="header", fix=f"a base file has n_ctx >= {MIN_CTX}, n_vocab >= 1 and n_chunk >= 1")
        rows = len(scored_positions(n_ctx))
        want = HEADER.size + 4 * n_chunk * n_ctx + 2 * n_chunk * rows * row_width(vocab)
        if size != want:
            raise InputError(f"{size} bytes, but n_ctx {n_ctx}, n_vocab {vocab} and n_chunk {n_chunk} make {want}",
                             path=shown, where="header", fix="the file is truncated or not a base file: write it again")
        if n_vocab is not None and vocab != n_vocab:
            raise InputError(f"made for a vocabulary of {vocab} tokens, the model has {n_vocab}: the base file of "
                             "another model", path=shown, where="n_vocab",
                             fix="pass the base file made from this model (llama-perplexity --kl-divergence-base)")
        tokens = np.frombuffer(fh.read(4 * n_chunk * n_ctx), dtype="<i4").reshape(n_chunk, n_ctx)
    raw = np.memmap(p, dtype="<u2", mode="r", offset=HEADER.size + 4 * n_chunk * n_ctx,
                    shape=(n_chunk * rows, row_width(vocab)))
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab))
    if bad.size:
        raise InputError(f"token id {int(tokens.flat[bad[0]])} at position {int(bad[0])} is outside the vocabulary "
                         f"of {vocab}", path=shown, where="tokens", fix="the file is damaged: write it again")
    head = np.ascontiguousarray(raw[:, :4]).view(np.float32)
    if not np.isfinite(head).all() or (head[:, 0] < 0).any():
        r = int(np.flatnonzero(~np.isfinite(head).all(axis=1) | (head[:, 0] < 0))[0])
        raise InputError(f"row {r} has scale {head[r, 0]} and min_log_prob {head[r, 1]}", path=shown,
                         where=f"chunk {r // rows}", fix="the file is damaged: write it again")
    return KlBase(path=p, n_ctx=int(n_ctx), n_vocab=int(vocab), tokens=tokens.astype(np.int64), rows=raw,
                  scales=head[:, 0].reshape(n_chunk, rows).copy())


def compare(base: KlBase, chunk: int, logits: np.ndarray) -> dict:
    """``logits`` ``[n_ctx, n_vocab]`` of ``chunk``'s prompt against the base file as llama.cpp's
    ``--kl-divergence`` scores them: per scored position KL(base || logits) over the log-probabilities above
    -16, and whether both put the same token on top; plus the largest |log p difference| where the base keeps
    a value (above its clamped floor)."""
    logits = np.asarray(logits, dtype=np.float64)
    pos = base.positions
    got = logits[pos.start:pos.stop]
    got = got - got.max(axis=1, keepdims=True)
    got = got - np.log(np.exp(got).sum(axis=1, keepdims=True))
    ref = base.log_probs(chunk).astype(np.float64)
    keep = ref > -LOG_RANGE
    kl = np.where(keep, np.exp(ref) * (ref - got), 0.0).sum(axis=1)
    floor = ref.min(axis=1, keepdims=True)
    kept = ref > floor
    return {"positions": len(pos), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agreement": float(np.mean(ref.argmax(axis=1) == got.argmax(axis=1))),
            "max_abs_log_prob_diff": float(np.abs(np.where(kept, ref - got, 0.0)).max())}
