"""llama.cpp's importance matrix from the release, streamed layer by layer (``ktconvert imatrix``).

What ``llama-imatrix`` (llama.cpp ``tools/imatrix/imatrix.cpp``, the version the tests pin) computes, and how this
module computes the same from the Hugging Face release without a GGUF:

* **Tokens.** The text is tokenized with the model's tokenizer, BOS first when llama.cpp's vocabulary adds one
  (``tokenizer.ggml.add_bos_token`` as ``quantize`` writes it, else llama.cpp's default for the pre-tokenizer).
  The tokens are cut into ``n_chunk = len // chunk_size`` chunks of ``chunk_size`` (llama-imatrix's ``-c``; the rest
  is dropped, ``--chunks`` takes the first N); each chunk runs on its own from position 0, its first token replaced
  by BOS when the vocabulary adds one. Every position of every chunk counts.
* **Statistics.** llama-imatrix hooks the input of every matrix multiplication whose weight is a ``blk.*`` tensor
  (``MUL_MAT``) and of every indirect one (``MUL_MAT_ID``, merged experts): per weight, the sum over the tokens of
  each input column's square, and the number of tokens (per expert for merged experts: the (token, slot) pairs
  routed to it). Here a forward hook on each reference module whose weight ``quantize`` writes under a ``blk.*``
  name takes its input: the same numbers, as the reference modules compute the same activations in float32. One
  product llama.cpp splits by rows feeds each part; columns llama.cpp reorders are reordered alike; MLA written as the
  absorbed ``attn_k_b`` / ``attn_v_b`` is probed inside the attention (``MLAttention.latent_probe``). Every chunk
  goes through a layer before the next (``LayerMajor.prefill_layers``): the release is read once.
  ``output.weight`` is not collected (llama-imatrix only with ``--process-output``), nor ``token_embd.weight`` (a
  row lookup, not a product).
* **Chunk count.** ``imatrix.chunk_count`` is the largest count divided by the chunk size, as llama-imatrix tracks
  it; ``imatrix.chunk_size`` the chunk size; ``imatrix.datasets`` the text file as given.

Where ktconvert differs on purpose: llama-imatrix skips a dense product whose micro-batch holds fewer than 16 tokens
(it happens only to a trailing micro-batch of 1 to 15 tokens: 512-token micro-batches over ``2048 // chunk_size``
chunks at a time); ktconvert has no micro-batches and counts every token. llama-imatrix refuses fewer than two
chunks (a leftover of its perplexity run); ktconvert needs one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert.errors import InputError, UsageProblem
from ktconvert.formats.imatrix import ImatrixEntry, imatrix_gguf_bytes
from ktconvert.formats.release import open_release
from ktconvert.formats.transforms import tile_columns

#: llama-imatrix's default ``-c``
DEFAULT_CHUNK_SIZE = 512
#: tokens run through the model at once: llama-imatrix's default batch (``2048 // chunk_size`` chunks at a time)
PASS_TOKENS = 2048
#: pre-tokenizers for which llama.cpp adds BOS unless the GGUF says otherwise (its LLAMA3 group; ktconvert writes
#: these four names: qwen2, deepseek-v3 and gpt-2 add none)
_BOS_BY_DEFAULT = frozenset({"llama-bpe"})
_REFUSE_FIX = "give a longer text, or a smaller --chunk-size"


@dataclass
class ImatrixRun:
    """What :func:`collect_imatrix` computed: the entries (raw sums and counts, llama-imatrix's names), the
    matrices ``quantize`` writes that got no data (``tensors_without``) and the experts no token was routed to
    (``experts_without``: merged tensor name -> expert indices), and what the run read and held."""

    entries: dict[str, ImatrixEntry]
    tensors_without: tuple[str, ...]
    experts_without: dict[str, tuple[int, ...]]
    chunks: int
    chunk_size: int
    chunk_count: int
    datasets: tuple[str, ...]
    stream: dict = field(default_factory=dict)
    out: str | None = None

    def gguf_bytes(self) -> bytes:
        return imatrix_gguf_bytes(self.entries, datasets=self.datasets, chunk_count=self.chunk_count,
                                  chunk_size=self.chunk_size)

    def summary(self) -> dict:
        return {"out": self.out, "entries": len(self.entries), "chunks": self.chunks, "chunk_size": self.chunk_size,
                "tokens": self.chunks * self.chunk_size, "chunk_count": self.chunk_count,
                "datasets": list(self.datasets), "tensors_without_data": list(self.tensors_without),
                "experts_without_data": {k: list(v) for k, v in sorted(self.experts_without.items())},
                "stream": self.stream}


# --- tokens --------------------------------------------------------------------------------------------------------

def bos_policy(model_dir: str | os.PathLike) -> int | None:
    """The BOS id llama.cpp puts first (the whole text's first token, and each chunk's), or ``None`` when the
    vocabulary ``quantize`` writes adds none."""
    from ktconvert.convert.tokenizer import convert_tokenizer

    release = open_release(model_dir)
    cfg = release.config
    vocab = convert_tokenizer(release.path, int(cfg.vocab_size), release.raw)
    if vocab is None:
        return None
    add = vocab.add_special.get("bos", vocab.pre in _BOS_BY_DEFAULT)
    bos = vocab.special_ids.get("bos")
    return int(bos) if add and bos is not None else None


def text_tokens(model_dir: str | os.PathLike, text_file: str | os.PathLike, bos: int | None) -> list[int]:
    """``text_file`` tokenized as llama-imatrix tokenizes it: the model's tokenizer, ``bos`` first unless ``None``
    (:func:`bos_policy`)."""
    from ktconvert.io.files import regular_file_size
    from ktconvert.optional import require

    path = Path(text_file)
    regular_file_size(path, "text file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text (byte {exc.start})", path=str(path),
                         fix="save the calibration text as UTF-8") from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", path=str(path)) from None
    if not text:
        raise InputError("the text file is empty", path=str(path), fix="give a calibration text")
    tj = Path(model_dir) / "tokenizer.json"
    if not tj.is_file():
        raise InputError("no tokenizer.json to tokenize --text-file with", path=str(model_dir),
                         fix="pass --prompt-ids (the text tokenized by llama.cpp) instead")
    tokenizers = require("tokenizers", needed_for="ktconvert imatrix --text-file",
                         install="pip install tokenizers, or pass --prompt-ids")
    try:
        ids = list(tokenizers.Tokenizer.from_file(str(tj)).encode(text, add_special_tokens=False).ids)
    except Exception as exc:  # the tokenizers library's own errors carry no common type
        raise InputError(f"the tokenizer cannot read it: {exc}", path=str(tj),
                         fix="pass --prompt-ids (the text tokenized by llama.cpp) instead") from None
    return ([bos] if bos is not None else []) + ids


def chunk_tokens(tokens: list[int], chunk_size: int, *, bos: int | None, chunks: int | None = None,
                 path: str | None = None, where: str | None = None) -> list[list[int]]:
    """llama-imatrix's chunks: ``len // chunk_size`` of them (at most ``chunks``), each starting with ``bos``
    when there is one. Fewer tokens than one chunk is an :class:`InputError`."""
    if chunk_size < 1:
        raise UsageProblem(f"--chunk-size {chunk_size}: a chunk holds at least one token", where="--chunk-size",
                           fix=f"pass --chunk-size {DEFAULT_CHUNK_SIZE} (llama-imatrix's default)")
    n = len(tokens) // chunk_size
    if n == 0:
        raise InputError(f"{len(tokens)} tokens, shorter than one chunk of {chunk_size}", path=path, where=where,
                         fix=_REFUSE_FIX)
    n = n if chunks is None else min(n, chunks)
    out = [list(tokens[i * chunk_size: (i + 1) * chunk_size]) for i in range(n)]
    if bos is not None:
        for c in out:
            c[0] = bos
    return out


# --- collection ----------------------------------------------------------------------------------------------------

@dataclass
class _Target:
    name: str  # the GGUF tensor
    expert: int | None  # its slice for merged experts
    n_mat: int
    n_in: int


def _targets(model, arch: str, planned: dict[str, tuple[int, ...]]) -> tuple[dict[int, tuple], set[str]]:
    """Every reference module whose weight ``quantize`` writes as ``blk.*`` matrices: ``id -> (module, [target])``
    (one module feeds several GGUF tensors where llama.cpp splits its rows: Qwen3-Next's ``in_proj_qkvz`` into
    ``attn_qkv`` and ``attn_gate``), and every ``blk.*`` tensor written from a product's weight (``expected``: those
    without data are reported)."""
    from ktconvert.formats.naming import naming_map
    from ktconvert.model.modules import RoutedExperts

    nm = naming_map(arch)
    out: dict[int, tuple] = {}
    expected: set[str] = set()
    expert_of: dict[int, tuple[int, int, str]] = {}  # id(projection) -> (layer, expert, projection)
    for path, mod in model.named_modules():
        if isinstance(mod, RoutedExperts):
            layer = int(path.split(".")[2])
            for e, ex in enumerate(mod):
                names = getattr(ex, "_names", ("gate_proj", "up_proj", "down_proj"))
                for proj, attr in zip(("gate", "up", "down"), names):
                    sub = getattr(ex, attr, None)
                    if sub is not None:
                        expert_of[id(sub)] = (layer, e, proj)
    for path, mod in model.named_modules():
        w = mod._parameters.get("weight")
        if w is None or w.dim() != 2:
            continue
        n_in = int(w.shape[1])
        if id(mod) in expert_of:
            layer, e, proj = expert_of[id(mod)]
            name = nm.expert_name("gguf-merged", proj, layer)
            if name not in planned and proj in ("gate", "up"):
                name = nm.expert_name("gguf-merged", "gate_up", layer)
                if proj == "up":
                    continue  # one product of the fused gate_up tensor: its input is the gate's
            found = [(name, e, False)]
        else:
            m = nm.lookup(f"{path}.weight")
            found = [(x.gguf_name, None, x.derived is not None) for x in (nm.hf_siblings(m) if m else [])]
        mine = []
        for name, e, derived in found:
            if not name or not name.startswith("blk.") or name not in planned:
                continue
            expected.add(name)
            shape = planned[name]
            if int(shape[-1]) != n_in or (derived and len(shape) != 2):
                continue  # another product (attn_k_b / attn_v_b cut from kv_b_proj: _latent_targets)
            mine.append(_Target(name, e, int(shape[0]) if e is not None and len(shape) == 3 else 1, n_in))
        if mine:
            out[id(mod)] = (mod, mine)
    return out, expected


def _latent_targets(model, planned: dict[str, tuple[int, ...]]) -> list[tuple[object, str | None, str | None]]:
    """Each MLA attention whose layer ``quantize`` writes as llama.cpp's absorbed ``attn_k_b`` / ``attn_v_b``:
    (module, k_b name or None, v_b name or None)."""
    from ktconvert.model.modules import MLAttention

    out = []
    for path, mod in model.named_modules():
        if isinstance(mod, MLAttention):
            layer = int(path.split(".")[2])
            k_b, v_b = (f"blk.{layer}.attn_{x}_b.weight" for x in ("k", "v"))
            k_b, v_b = (n if n in planned and len(planned[n]) == 3 else None for n in (k_b, v_b))
            if k_b or v_b:
                out.append((mod, k_b, v_b))
    return out


def collect_imatrix(model_dir: str | os.PathLike, chunks: list[list[int]], *, chunk_size: int,
                    max_memory: int | None = None, threads: int | None = None,
                    datasets: tuple[str, ...] = ()) -> ImatrixRun:
    """Run ``chunks`` through the release streamed within ``max_memory`` (``None``: no limit) and return the
    importance matrix (nothing is written)."""
    import torch

    from ktconvert.convert.source import analyze
    from ktconvert.model.executor import CheckpointWeights, LayerMajor
    from ktconvert.model.reference import build_skeleton

    began = time.perf_counter()
    model_dir = open_release(model_dir)  # the release the caller opened, or opened here: handed down
    cfg = model_dir.config
    vocab = int(cfg.vocab_size)
    for i, c in enumerate(chunks):
        bad = next((t for t in c if not 0 <= t < vocab), None)
        if bad is not None:
            raise InputError(f"token id {bad} (chunk {i + 1}) is outside the vocabulary of {vocab}",
                             path=str(model_dir), fix="give token ids of this model's tokenizer")
    src = analyze(model_dir)
    planned = {it.name: tuple(it.shape) for it in src.items}
    weights = CheckpointWeights(model_dir, cfg, budget=max_memory)
    skeleton = build_skeleton(cfg)
    weights.check_budget(skeleton)
    targets, expected = _targets(skeleton, src.arch, planned)
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}

    def add(name: str, row: int, n_mat: int, x) -> None:
        """Row ``row`` of ``name``'s sums takes the squares of ``x [N, n]`` (N tokens), its count N."""
        x = x.detach().reshape(-1, x.shape[-1]).double()
        if name not in sums:  # float32 as llama-imatrix holds them (DeepSeek-V3's experts: 1.2 GiB); each call's
            sums[name] = np.zeros((n_mat, x.shape[1]), dtype=np.float32)  # sum is taken in float64
            counts[name] = np.zeros(n_mat, dtype=np.int64)
        sums[name][row] += (x * x).sum(0).numpy()
        counts[name][row] += x.shape[0]

    def hook(mod, args, _out):
        for t in targets[id(mod)][1]:
            add(t.name, t.expert or 0, t.n_mat, args[0].reshape(-1, t.n_in))

    def probe(k_b, v_b):
        # llama.cpp multiplies each head by its own slice of the 3-D tensor: one count, the heads' columns in a row
        def fn(q_nope, latent_out):
            if k_b:
                add(k_b, 0, 1, q_nope.transpose(1, 2).reshape(-1, q_nope.shape[1] * q_nope.shape[3]))
            if v_b:
                add(v_b, 0, 1, latent_out)
        return fn

    handles = [mod.register_forward_hook(hook) for mod, _ in targets.values()]
    latent = _latent_targets(skeleton, planned)
    expected.update(n for _, k_b, v_b in latent for n in (k_b, v_b) if n)
    for mod, k_b, v_b in latent:
        mod.latent_probe = probe(k_b, v_b)
    per_pass = max(1, PASS_TOKENS // chunk_size)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        with torch.no_grad():  # every chunk through a layer before the next: the release is read once
            LayerMajor(skeleton, weights).prefill_layers(torch.tensor(chunks, dtype=torch.long), per_pass)
    finally:
        torch.set_num_threads(previous)
        for h in handles:
            h.remove()
        for mod, _, _ in latent:
            mod.latent_probe = None
    # a GGUF tensor whose columns llama.cpp reorders (Qwen3.5's ssm_out: value heads grouped -> tiled) gets its
    # sums in that order too
    tiles = {it.name: s.col_tile for it in src.items for s in it.segments if s.col_tile}
    entries = {n: ImatrixEntry((tile_columns(sums[n], tiles[n]) if n in tiles else sums[n]).astype(np.float32),
                               counts[n].astype(np.float32)) for n in sorted(sums)}
    without = tuple(sorted(n for n in expected if n not in entries))
    experts = {n: tuple(int(i) for i in np.flatnonzero(c == 0)) for n, c in counts.items() if c.size > 1 and (c == 0).any()}
    top = max((int(c.max()) for c in counts.values()), default=0)
    st = weights.stats
    stream = {"max_memory": None if max_memory is None else int(max_memory), "peak_resident_weights": int(st.peak),
              "bytes_read": int(st.bytes_read), "experts_loaded": int(st.experts),
              "seconds": round(time.perf_counter() - began, 3)}
    return ImatrixRun(entries, without, experts, len(chunks), chunk_size, top // chunk_size, datasets, stream)


def make_imatrix(model_dir: str | os.PathLike, out: str | os.PathLike, *, text_file: str | os.PathLike | None = None,
                 prompt_ids: list[int] | None = None, prompt_ids_source: str | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, chunks: int | None = None, max_memory: int | None = None,
                 threads: int | None = None, force: bool = False) -> ImatrixRun:
    """Compute the importance matrix of ``text_file`` (or of ``prompt_ids``, the text as llama.cpp tokenizes it,
    BOS included) and write it to ``out`` atomically as llama-imatrix's GGUF. ``prompt_ids_source`` names the ids
    in ``imatrix.datasets`` (default ``prompt-ids``)."""
    from ktconvert.io.atomic import guard_output_file, write_file

    if (text_file is None) == (prompt_ids is None):
        raise UsageProblem("give one of --text-file and --prompt-ids",
                           fix="--text-file calibration.txt, or --prompt-ids 1,2,3 (or a file of ids)")
    model_dir = open_release(model_dir)  # opened once: config, tokenizer, weights and their decoding, handed down
    ins = [model_dir.path] + [Path(p) for p in (text_file, prompt_ids_source) if p is not None and Path(p).exists()]
    out_p = guard_output_file(out, "OUT", inputs=ins, force=force)
    bos = bos_policy(model_dir)
    if text_file is not None:
        tokens, path, where, dataset = text_tokens(model_dir, text_file, bos), str(text_file), None, str(text_file)
        if not tokens:
            raise InputError("the text tokenizes to nothing", path=str(text_file), fix="give a calibration text")
    else:
        if not prompt_ids:
            raise InputError("no prompt ids", path=prompt_ids_source, fix="give the token ids, comma-separated")
        tokens, path, where = list(prompt_ids), prompt_ids_source, "--prompt-ids"
        dataset = prompt_ids_source or "prompt-ids"
    parts = chunk_tokens(tokens, chunk_size, bos=bos, chunks=chunks, path=path, where=where)
    run = collect_imatrix(model_dir, parts, chunk_size=chunk_size, max_memory=max_memory, threads=threads,
                          datasets=(dataset,))
    write_file(out_p, run.gguf_bytes())
    run.out = str(out_p)
    return run


__all__ = ["DEFAULT_CHUNK_SIZE", "ImatrixRun", "bos_policy", "chunk_tokens", "collect_imatrix", "make_imatrix",
           "text_tokens"]
