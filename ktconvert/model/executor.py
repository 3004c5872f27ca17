"""Layer-major execution: the one way a reference (or injected) causal LM runs, with its weights resident or streamed.

:class:`LayerMajor` runs a :class:`~ktconvert.model.reference.ReferenceCausalLM` one part at a time: the embedding,
then each decoder layer over **every** position before the next layer starts, then the head (hyper-connection head,
final norm, ``lm_head``). ``step`` says how many positions one call of a layer takes: all of them (prefill), or one
at a time (decode: each position attends to the cache the earlier positions of *that layer* wrote). This is exact:
a layer's output at position t depends only on that layer's inputs at positions <= t, so running layer L over every
position before layer L + 1 computes the same float operations, on the same shapes, as running every layer for one
position at a time; the results are bit-identical (``tests/test_executor.py``).

Where the weights come from is a *weight provider*:

* :data:`RESIDENT` (:class:`Resident`): everything is already in the model (``build_model`` + ``load_weights``, or
  an injected candidate). ``ReferenceCausalLM.forward`` is this executor with this provider, so the in-memory path
  and the streamed one are the same code.
* :class:`CheckpointWeights`: the model is a skeleton (:func:`~ktconvert.model.reference.build_skeleton`: the
  module tree, its large tensors on the meta device) and each part's weights are read from the checkpoint just
  before the part runs and dropped after. Routed experts are read one expert at a time, only those the tokens pick
  (``RoutedExperts.fetch``). Stored tensors are decoded by :func:`ktconvert.model.weights.stored_tensor`, the same
  function the in-memory loader uses (and, through :mod:`ktconvert.formats.quantized`, the decoder ``quantize``
  uses for FP8 block, MXFP4, NVFP4, RAWINT4 and GPTQ releases).
* :class:`ConvertedWeights`: the same for a converted checkpoint (GGUF, split sets too, or kernel-order
  safetensors) through :class:`~ktconvert.model.ops.source.WeightSource`, as ``inject`` loads a candidate whole.
  Both share :class:`StreamedWeights` (slots, budget, expert cache, :class:`StreamStats`); a new source is a
  subclass with ``part_state`` / ``expert_state`` / ``stored_bytes``. :class:`InjectedWeights` streams an injected
  candidate (``verify --max-memory``): its operators are built per part too. Not yet a source: a kt-amx directory (its
  experts decoded as ``quantize`` reads them, :mod:`ktconvert.convert.kt_amx_io`, everything else from the release).

A provider's ``part(model, kind, layer)`` is a context manager around one part's run (``kind`` is ``embed``,
``layer`` or ``head``); it may set ``fetch`` on the layer's :class:`~ktconvert.model.modules.RoutedExperts`.

Hooks for later users: ``run(..., on_layer=fn)`` calls ``fn(index, hidden_in, hidden_out)`` after each layer;
:func:`run_pairs` runs a reference and a candidate in lockstep (every phase in one pass), the candidate's layer also on the reference's input
(teacher-forced per-layer error, for ``verify --max-memory``);
module forward hooks (``ktconvert imatrix``'s input activations, verify's ``ModuleTap``) fire as usual, because
the module objects stay and only their tensors come and go.
"""

from __future__ import annotations

import mmap
import re
import warnings
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ktconvert.errors import InputError, UsageProblem
from ktconvert.io.heap import return_freed_memory
from ktconvert.io.sizes import format_size
from ktconvert.model.modules import (VOCAB_CHUNK, ChunkedLogits, KVCache, RoutedExperts, VocabEmbedding,
                                     VocabHead)


@dataclass
class ForwardOutput:
    """``logits [B, T, V]``; ``hidden_states``: embeddings then each decoder layer's output (num_layers + 1
    tensors ``[B, T, H]``, before the final norm); ``final_hidden``: after the final norm."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]
    final_hidden: torch.Tensor


class Resident:
    """Every weight already in the model: nothing to read or drop."""

    def part(self, model: nn.Module, kind: str, layer: int | None = None):
        return nullcontext()


RESIDENT = Resident()


class LayerMajor:
    """Run ``model`` part by part with ``weights`` (default :data:`RESIDENT`); see the module docstring."""

    def __init__(self, model: nn.Module, weights=None):
        self.model = model
        self.weights = weights if weights is not None else RESIDENT

    def run(self, input_ids: torch.Tensor, cache: KVCache | None = None, *, step: int | None = None,
            on_layer=None) -> ForwardOutput:
        """``input_ids [B, T]`` at positions ``cache.seq_len ..``; each layer takes ``step`` positions per call
        (default: all). Appends to ``cache`` when given; without one, a run of several steps keeps its own, each
        layer's entries dropped once the layer is done with them."""
        ids, t, step, cache, own_cache, past, positions, chunks = self._setup(input_ids, cache, step)
        hidden, states = self.embed(ids, chunks)
        selections: dict[int, list] = {}  # a DSA source layer's selection per chunk, for the layer sharing it
        for index, layer in enumerate(self.model.model.layers):
            out = self.layer(index, hidden, positions, cache, ids, chunks, selections)
            if on_layer is not None:
                on_layer(index, hidden, out)
            hidden = out
            if own_cache:
                cache.drop(layer.layer_idx)
            states.append(self.collapse(hidden))
        logits, final = self.head(hidden, chunks)
        if cache is not None and not own_cache:
            cache.seq_len = past + t
        return ForwardOutput(logits=logits, hidden_states=tuple(states), final_hidden=final)

    def run_many(self, input_ids: torch.Tensor, steps: list[int | None], guards: list | None = None,
                 on_layer=None) -> list[ForwardOutput]:
        """``input_ids`` run once per entry of ``steps`` (``None``: every position in one call, prefill; ``1``:
        decode), all in one pass over the parts: each decoder layer and the head are resident once for every run
        (a streamed golden's prefill and its decode self-check read the checkpoint once, not twice). Each run has
        its own caches and computes what :meth:`run` computes for it alone, bit for bit: the same calls on the same
        operands, only the order of the runs' calls within a part interleaves. ``guards``: per run, a context
        manager factory (or None) entered around every call that run makes (verify switches the candidate's
        operators to the run's phase there); ``on_layer(index)``: called once every run is done with a layer."""
        guards = guards or [None] * len(steps)
        setups = [self._setup(input_ids, None, step) for step in steps]
        runs = []
        for (ids, _, _, cache, _, _, positions, chunks), guard in zip(setups, guards):
            with _entered(guard):
                hidden, states = self.embed(ids, chunks)
            runs.append([hidden, states, cache, {}])
        for index, layer in enumerate(self.model.model.layers):
            jobs = [(r[0], r[2], r[3], guard) for r, guard in zip(runs, guards)]
            outs = self.layer_jobs(index, jobs, [s[6] for s in setups], [s[0] for s in setups], [s[7] for s in setups])
            for r, out in zip(runs, outs):
                r[0] = out
                if r[2] is not None:
                    r[2].drop(layer.layer_idx)
                r[1].append(self.collapse(out))
            if on_layer is not None:
                on_layer(index)
        heads = self.heads([(r[0], s[7]) for r, s in zip(runs, setups)], guards)
        return [ForwardOutput(logits=lg, hidden_states=tuple(r[1]), final_hidden=f) for r, (lg, f) in zip(runs, heads)]

    def _setup(self, input_ids, cache, step):
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        b, t = input_ids.shape
        step = t if step is None else step
        own_cache = cache is None and step < t
        if own_cache:
            cache = KVCache()
        past = cache.seq_len if cache is not None else 0
        positions = (torch.arange(t, device=input_ids.device) + past).unsqueeze(0).expand(b, -1)
        chunks = [(a, min(a + step, t)) for a in range(0, t, step)]
        return input_ids, t, step, cache, own_cache, past, positions, chunks

    def embed(self, input_ids: torch.Tensor, chunks: list[tuple[int, int]] | None = None) -> tuple[torch.Tensor, list]:
        """The embedding part: the first layer's input (every hyper-connection stream starts as the embedding) and
        the recorded states so far (``[embedding]``); one lookup per chunk, as a token-by-token run calls it (the
        values are the same either way; module hooks see the calls of that run)."""
        with self.weights.part(self.model, "embed"):
            parts = [self.model.model.embed_tokens(input_ids[:, a:z]) for a, z in chunks or [(0, input_ids.shape[1])]]
            hidden = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return self.model.residual.widen(hidden), [hidden]

    def collapse(self, hidden: torch.Tensor) -> torch.Tensor:
        """A layer's output as recorded: its streams' mean where there are several (as the goldens record it)."""
        return self.model.residual.collapse(hidden)

    def head(self, hidden: torch.Tensor, chunks: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, final hidden)``, per chunk too: a matmul over 1 row and over T rows round apart."""
        return self.heads([(hidden, chunks)])[0]

    def heads(self, runs: list[tuple[torch.Tensor, list[tuple[int, int]]]],
              guards: list | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`head` of several runs (``(last layer output, chunks)`` each) with the head resident once;
        ``guards``: per run, a context manager factory (or None) entered around that run's module calls."""
        model = self.model
        lm = model.lm_head
        finals = []  # per run, per chunk
        guards = guards or [None] * len(runs)
        with self.weights.part(model, "head"):
            for (hidden, chunks), guard in zip(runs, guards):
                finals.append([])
                with _entered(guard):
                    for a, z in chunks:
                        h = hidden[:, a:z]
                        finals[-1].append(model.model.norm(model.residual.final(model.model, h)))
            # several chunks (decode, several runs): each vocabulary chunk of lm_head (the reference's VocabHead, or
            # the op an injected lm_head runs) is read once for all of them, then the module is called per chunk as
            # before (hooks see those calls) and hands out what was computed
            flat = [f for run in finals for f in run]
            op = _chunked_logits(lm)
            if op is not None and len(flat) > 1:
                op.ready = (flat, op.chunked(flat))
            try:
                logits = []
                for run, guard in zip(finals, guards):
                    with _entered(guard):
                        logits.append([lm(f) for f in run])
            finally:
                if op is not None:
                    op.ready = None
        return [(lg[0], fs[0]) if len(fs) == 1 else (torch.cat(lg, 1), torch.cat(fs, 1)) for lg, fs in zip(logits, finals)]

    def layer(self, index: int, hidden: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None,
              input_ids: torch.Tensor, chunks: list[tuple[int, int]] | None = None,
              selections: dict[int, list] | None = None) -> torch.Tensor:
        """Decoder layer ``index`` over every position of ``hidden``, ``chunks`` of positions per call (default:
        one call), its weights resident for the whole of it."""
        return self.layer_jobs(index, [(hidden, cache, selections)], position_ids, input_ids, chunks)[0]

    def layer_jobs(self, index: int, jobs: list[tuple], position_ids: torch.Tensor | list, input_ids: torch.Tensor | list,
                   chunks: list[tuple[int, int]] | None = None, then=None) -> list[torch.Tensor]:
        """Decoder layer ``index`` over several inputs while its weights are resident once: ``jobs`` are
        ``(hidden, cache, selections[, guard])``, each with a cache (and DSA selections) of its own (a verify runs
        the candidate's layer on its own input and on the reference's, :func:`run_pair`); ``guard``: a context
        manager factory entered around that job (verify's module tap looks away from the teacher-forced job);
        ``then(layer)``: called once the jobs are done, the layer's weights still resident.
        ``position_ids`` / ``input_ids``: shared by the jobs, or a list with each job's (:meth:`prefill_layers`);
        ``chunks``: shared, or a list with each job's (a list of lists: :meth:`run_many`)."""
        layer = self.model.model.layers[index]
        mixer = layer.mixer
        source = getattr(mixer, "selection_source", None)
        outs = []
        with self.weights.part(self.model, "layer", index):
            for j, (hidden, cache, selections, *guard) in enumerate(jobs):
                pos = position_ids[j] if isinstance(position_ids, list) else position_ids
                ids = input_ids[j] if isinstance(input_ids, list) else input_ids
                selections = selections if selections is not None else {}
                mine = chunks[j] if chunks and isinstance(chunks[0], list) else chunks
                parts = []
                with guard[0]() if guard and guard[0] is not None else nullcontext():
                    for c, (a, z) in enumerate(mine or [(0, hidden.shape[1])]):
                        if source is not None and id(source) in selections:
                            source.last_selection = selections[id(source)][c]  # the source layer's, same chunk
                        parts.append(layer(hidden[:, a:z], pos[:, a:z], cache, ids[:, a:z]))
                        if hasattr(mixer, "last_selection"):
                            selections.setdefault(id(mixer), []).append(mixer.last_selection)
                outs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
            if then is not None:
                then(layer)
        return outs

    def prefill_layers(self, input_ids: torch.Tensor, batch: int) -> torch.Tensor:
        """``input_ids [N, T]``, N independent sequences, through the embedding and every decoder layer, ``batch``
        sequences per call of a layer, each part resident once for all N (the weights are read once, however many
        sequences); the head is not run. Returns the last layer's output. For what sees the layers' inputs only
        (``ktconvert imatrix``'s hooks); each batch computes what :meth:`run` computes on it alone."""
        ids, _, _, _, _, _, positions, chunks = self._setup(input_ids, None, None)
        hidden, _ = self.embed(ids, chunks)
        spans = [(a, min(a + batch, ids.shape[0])) for a in range(0, ids.shape[0], batch)]
        hs = [hidden[a:z] for a, z in spans]
        selections = [{} for _ in spans]  # each batch's DSA selections, for the layers sharing a source layer's
        for index in range(len(self.model.model.layers)):
            jobs = [(h, None, sel) for h, sel in zip(hs, selections)]
            hs = self.layer_jobs(index, jobs, [positions[a:z] for a, z in spans],
                                 [ids[a:z] for a, z in spans], chunks)
        return torch.cat(hs)


@dataclass
class PairOutput:
    """:func:`run_pair`'s result: both models' outputs, and the candidate's layers run on the reference's input
    (``forced[i + 1]``: candidate layer i's output given reference layer i's input, as recorded; ``forced[0]`` is
    the candidate's own embedding), indexed like ``hidden_states``."""

    reference: ForwardOutput
    candidate: ForwardOutput
    forced: tuple[torch.Tensor, ...]


@dataclass
class PairPhase:
    """One phase of :func:`run_pairs`: ``step`` positions per call of a layer (None: all, prefill; 1: decode);
    ``on_layer(index)``, called once both models are done with layer ``index``; ``forced_guard``, a context manager
    factory entered around the candidate's teacher-forced job (see :meth:`LayerMajor.layer_jobs`); ``probe``, which
    looks inside each layer of both models (verify's per-expert error, :mod:`ktconvert.verify.experts`):
    ``probe.reference(index, layer)`` is a context manager around the reference's layer, ``probe.candidate(index,
    layer)`` is called while the candidate's layer is still resident, after its jobs; ``guard``, a context manager
    factory entered around every call this phase makes of either model (verify switches the candidate's operators
    to the phase's and points its module tap at the phase there)."""

    step: int | None = None
    on_layer: object = None
    forced_guard: object = None
    probe: object = None
    guard: object = None


def _entered(factory):
    """The context manager ``factory()`` makes, or a null one for None."""
    return factory() if factory is not None else nullcontext()


def _both(first, second):
    """A context manager factory entering ``first``'s and then ``second``'s (either may be None)."""
    if first is None or second is None:
        return first if second is None else second

    @contextmanager
    def enter():
        with ExitStack() as stack:
            stack.enter_context(first())
            stack.enter_context(second())
            yield
    return enter


def run_pairs(reference: LayerMajor, candidate: LayerMajor, input_ids: torch.Tensor,
              phases: list[PairPhase]) -> list[PairOutput]:
    """Reference and candidate in lockstep, one layer of each resident at a time, for every phase in one pass: each
    layer runs on its own model's previous output (free-running, where error compounds) and the candidate's layer
    also on the reference's input (teacher-forced: the error that layer alone adds, which names the faulty layer at
    scale). Each phase's three streams keep their own per-layer caches; every cache entry of a layer is dropped when
    the layer is done. Each layer's weights (and the head's) are read once for all the phases (verify's prefill and
    decode: once, not twice); each phase's outputs are bit-identical to two separate :meth:`LayerMajor.run` calls
    with that phase's step: the same calls on the same operands, only the order of the phases' calls within a part
    interleaves."""
    runs = []
    for ph in phases:
        ids, t, step, _, _, _, positions, chunks = reference._setup(input_ids, None, ph.step)
        with _entered(ph.guard):
            rh, ref_states = reference.embed(ids, chunks)
            ch, cand_states = candidate.embed(ids, chunks)
        runs.append({"ph": ph, "ids": ids, "positions": positions, "chunks": chunks, "rh": rh, "ch": ch,
                     "caches": [KVCache() if step < t else None for _ in range(3)],  # reference, candidate, forced
                     "sel": [{}, {}, {}], "ref": ref_states, "cand": cand_states, "forced": [cand_states[0]]})
    per = lambda key, n=1: [r[key] for r in runs for _ in range(n)]  # noqa: E731
    for index, layer in enumerate(reference.model.model.layers):
        ref_jobs = [(r["rh"], r["caches"][0], r["sel"][0], _both(r["ph"].guard, None if r["ph"].probe is None else
                                                                 (lambda p=r["ph"].probe: p.reference(index, layer))))
                    for r in runs]
        r_outs = reference.layer_jobs(index, ref_jobs, per("positions"), per("ids"), per("chunks"))
        cand_jobs = [job for r in runs for job in ((r["ch"], r["caches"][1], r["sel"][1], r["ph"].guard),
                                                   (r["rh"], r["caches"][2], r["sel"][2],
                                                    _both(r["ph"].guard, r["ph"].forced_guard)))]

        def then(c, index=index):
            for r in runs:
                if r["ph"].probe is not None:
                    with _entered(r["ph"].guard):
                        r["ph"].probe.candidate(index, c)

        outs = candidate.layer_jobs(index, cand_jobs, per("positions", 2), per("ids", 2), per("chunks", 2),
                                    then=then if any(r["ph"].probe is not None for r in runs) else None)
        for k, r in enumerate(runs):
            for cache in r["caches"]:
                if cache is not None:
                    cache.drop(layer.layer_idx)
            r["rh"], r["ch"] = r_outs[k], outs[2 * k]
            r["ref"].append(reference.collapse(r["rh"]))
            r["cand"].append(candidate.collapse(r["ch"]))
            r["forced"].append(candidate.collapse(outs[2 * k + 1]))
        for r in runs:
            if r["ph"].on_layer is not None:
                r["ph"].on_layer(index)
    guards = [r["ph"].guard for r in runs]
    r_heads = reference.heads([(r["rh"], r["chunks"]) for r in runs], guards)
    c_heads = candidate.heads([(r["ch"], r["chunks"]) for r in runs], guards)
    return [PairOutput(ForwardOutput(rl, tuple(r["ref"]), rf), ForwardOutput(cl, tuple(r["cand"]), cf),
                       tuple(r["forced"])) for r, (rl, rf), (cl, cf) in zip(runs, r_heads, c_heads)]


def run_pair(reference: LayerMajor, candidate: LayerMajor, input_ids: torch.Tensor, *,
             step: int | None = None, on_layer=None, forced_guard=None, probe=None) -> PairOutput:
    """:func:`run_pairs` of one phase (see :class:`PairPhase` for the arguments)."""
    return run_pairs(reference, candidate, input_ids, [PairPhase(step, on_layer, forced_guard, probe)])[0]


# --- the streaming provider ----------------------------------------------------------------------------------------

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FUSED = re.compile(r"^model\.layers\.\d+\.[a-z_]+\.experts\.(?:gate_up_proj|down_proj)(?:_bias)?(?:\.weight)?$")
#: the reference names of the tensors read by rows (VocabEmbedding, VocabHead) -> their part
VOCAB_NAMES = {"model.embed_tokens.weight": "embed", "lm_head.weight": "head"}
#: the same, part -> reference name
VOCAB_PARTS = {v: k for k, v in VOCAB_NAMES.items()}
_EXPERT = re.compile(r"^model\.layers\.\d+\.[a-z_]+\.experts\.(\d+)\.")


def _chunked_logits(lm: nn.Module) -> ChunkedLogits | None:
    """What computes ``lm_head``'s logits by vocabulary chunks: the module itself, or the op an injected one (a
    :class:`~ktconvert.model.ops.switch.PhaseSwitch`) runs in its mode; None for anything else."""
    ops = getattr(lm, "ops", None)
    op = ops.get(lm.mode) if isinstance(ops, dict) else lm
    return op if isinstance(op, ChunkedLogits) else None


def _slots(root: nn.Module, prefix: str, skip: set[int]):
    """Every parameter and buffer slot under ``root`` (``(module, table, attr, state name or None, tensor)``; the
    name is None for a non-persistent buffer), modules in ``skip`` (by id) left out."""
    for path, mod in root.named_modules(remove_duplicate=False):
        if id(mod) in skip:
            continue
        for table in (mod._parameters, mod._buffers):
            for attr, t in table.items():
                if t is None:
                    continue
                persistent = table is mod._parameters or attr not in mod._non_persistent_buffers_set
                yield mod, table, attr, (prefix + (f"{path}." if path else "") + attr) if persistent else None, t


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class Pending:
    """A stored tensor a source has not decoded yet: its reference ``shape`` (what the strict check reads), the bytes
    its decoding holds while it is copied into its slot (``cost``), and ``load()``, which decodes it. A source whose
    state is pending decodes one tensor at a time, so a part holds its float32 weights plus one tensor's decoding,
    never every stored copy at once (a DeepSeek-V3 FP8 release's dense layer decoded whole beside its float32 slots
    was 4.35 GiB of a 4 GiB budget)."""

    __slots__ = ("shape", "cost", "_load", "mapped")

    def __init__(self, shape: tuple, cost: int, load, mapped: bool = False):
        self.shape, self.cost, self._load = tuple(shape), int(cost), load
        self.mapped = mapped  # load() gives a read-only view of the file's memory map (to be copied, never written)

    def load(self) -> torch.Tensor:
        return self._load()


def resolve(value):
    """A state value as a tensor of its own (a :class:`Pending` one decoded; a mapped one copied out of the map)."""
    if not isinstance(value, Pending):
        return value
    return value.load().clone() if value.mapped else value.load()


#: a streamed run's weights get all of ``--max-memory`` but this fraction (1/RESERVE_DIVISOR), kept for what the
#: weights' count does not see: activations, logits of a vocabulary chunk, decoders' and kernels' scratch, and the
#: allocators' slack. Measured at real width, that was 14 to 55 MiB above the tiny models' fixed overhead under
#: budgets of 1 and 4 GiB (docs/measurements.md); a sixteenth is 64 and 256 MiB there.
RESERVE_DIVISOR = 16


def weights_budget(max_memory: int) -> int:
    """The bytes a streamed run's weights may hold within ``max_memory`` (see :data:`RESERVE_DIVISOR`)."""
    return max_memory - max_memory // RESERVE_DIVISOR


def max_memory_for(weights: int) -> int:
    """The least ``--max-memory`` whose :func:`weights_budget` holds ``weights`` bytes."""
    m = weights + weights // (RESERVE_DIVISOR - 1)
    while weights_budget(m) < weights:
        m += 1
    return m


@dataclass
class StreamStats:
    """What a streaming provider did: bytes read from disk (stored), bytes of float32 weights resident now and at
    most (with the stored copies being decoded), parts and experts loaded."""

    bytes_read: int = 0
    resident: int = 0
    peak: int = 0
    parts: int = 0
    experts: int = 0


class StreamedWeights:
    """What every streaming provider shares: parts and experts put into the skeleton's slots and dropped after,
    the budget (``None``: no limit; below what the largest part needs is refused up front by :meth:`check_budget`,
    naming that minimum), the expert cache of a running layer, and :class:`StreamStats`.

    A source says what a part holds (:meth:`part_state`, :meth:`expert_state`: reference state-dict name -> tensor
    for the names asked, and the bytes read for them) and what it costs to decode (:meth:`stored_bytes`).
    """

    def __init__(self, path, cfg, budget: int | None = None):
        self.path = str(path)
        self.cfg = cfg
        self.max_memory = budget  # what the run gives this provider; its weights get :func:`weights_budget` of it
        self.budget = None if budget is None else weights_budget(budget)
        self.stats = StreamStats()
        self._kept: dict[int, tuple] = {}
        self.lora: dict[str, tuple] = {}  # reference name -> LoRA tuple: W + alpha/r * B @ A, added in float32
        #: keep dropped weights' memory for the next parts within the budget (:meth:`_take`); the one provider of a
        #: run turns it on (``golden --engine stream``): verify's two providers each hold the whole budget today
        self.reuse = False
        self._free: list[torch.Tensor] = []  # dropped weights' tensors kept for the next part's slots, oldest first
        self._pooled = 0  # their bytes
        return_freed_memory()

    # --- what a source provides -------------------------------------------------------------------------------
    def part_state(self, kind: str, layer: int | None, expected: dict[str, tuple]) -> tuple[dict, int]:
        raise NotImplementedError

    def expert_state(self, layer: int, e: int, expected: dict[str, tuple]) -> tuple[dict, int]:
        raise NotImplementedError

    def stored_bytes(self, kind: str, layer: int | None, expert: bool = False, weights: int = 0) -> int:
        """Bytes of stored copies held while a part (or its largest expert, ``expert``) is decoded; ``weights``: the
        float32 bytes it takes resident."""
        return 0

    def part_done(self, kind: str, layer: int | None) -> None:
        """A part's run is over (a source may free what it cached for it)."""

    def part_extra(self, kind: str, layer: int | None) -> int:
        """Bytes a part needs resident beyond its own weights' slots (an injected candidate's operators)."""
        return 0

    def has_rows(self, kind: str) -> bool:
        """Whether this source reads the embedding (``kind`` ``embed``) or ``lm_head`` (``head``) by rows."""
        return False

    def rows_state(self, kind: str, ids: torch.Tensor | None, span: tuple[int, int] | None) -> tuple[torch.Tensor, int]:
        """Rows ``ids`` (sorted, distinct) or ``span`` ``(a, z)`` of the embedding table / ``lm_head`` weight, decoded
        as the whole tensor is (any float dtype: they are copied into the module's dtype), and the bytes of stored
        copies held meanwhile."""
        raise NotImplementedError

    def rows_stored_bytes(self, kind: str, rows: int) -> int:
        """Bytes of stored copies held while ``rows`` rows are decoded."""
        return 0

    def extra_note(self, kind: str, layer: int | None) -> str:
        """What :meth:`part_extra` holds, for the refusal of a budget below the minimum ('' when nothing to say)."""
        return ""

    # --- budget ---------------------------------------------------------------------------------------------------
    def minimum(self, model: nn.Module) -> tuple[int, str]:
        """The most bytes one part needs resident at once (its float32 weights, the stored copies being decoded,
        and the largest expert of a layer with the same), and which part that is."""
        best = (0, "")
        for kind, index, roots, skip, experts in self._parts(model):
            weights = sum(_bytes(s[4]) for r, _ in roots for s in _slots(r, "", skip) if s[3] is not None)
            extra = self.part_extra(kind, index)
            need = weights + self.stored_bytes(kind, index, weights=weights) + extra
            vocab = self._vocab(model, kind)
            if vocab is not None:  # one chunk of rows at a time (VOCAB_CHUNK), however large the vocabulary
                rows = min(VOCAB_CHUNK, vocab.weight.shape[0])
                need += rows * vocab.weight.shape[1] * vocab.weight.element_size() + self.rows_stored_bytes(kind, rows)
            if experts is not None:
                one = max((sum(_bytes(p) for p in ex.parameters()) for ex in experts), default=0)
                need += one + self.stored_bytes(kind, index, expert=True, weights=one)
            if need > best[0]:
                where = _largest(f"layer {index}" if kind == "layer" else kind, roots, skip)
                note = self.extra_note(kind, index)
                best = (need, f"{where} ({note}: {format_size(extra)} of it)" if note and extra else where)
        return best

    def check_budget(self, model: nn.Module) -> None:
        """Refuse a budget below :meth:`minimum`, naming the minimum and the part that needs it."""
        if self.budget is None:
            return
        need, where = self.minimum(model)
        if self.budget < need:
            least = max_memory_for(need)
            raise UsageProblem(f"--max-memory {format_size(self.max_memory)} is below the minimum {format_size(least)} "
                               f"({least} bytes): {where} needs {format_size(need)} resident (its float32 weights, one "
                               f"expert or {VOCAB_CHUNK} vocabulary rows, and the stored copies being decoded), and "
                               f"1/{RESERVE_DIVISOR} of the budget is kept for activations and scratch", path=self.path,
                               fix=f"pass --max-memory {least} or more")

    # --- parts ----------------------------------------------------------------------------------------------------
    def _vocab(self, model: nn.Module, kind: str):
        """The part's :class:`VocabEmbedding` / :class:`VocabHead` when this source reads it by rows, else None
        (it is then loaded whole, as any module: an injected operator in ``lm_head``'s place)."""
        module = {"embed": model.model.embed_tokens, "head": model.lm_head}.get(kind)
        if not isinstance(module, (VocabEmbedding, VocabHead)) or not self.has_rows(kind):
            return None
        return module

    def _parts(self, model: nn.Module):
        """``(kind, layer, [(module, state prefix)], skip ids, routed experts or None)`` for every part."""
        embed = self._vocab(model, "embed")
        yield "embed", None, [(model.model.embed_tokens, "model.embed_tokens.")], {id(embed)} if embed else set(), None
        for index, layer in enumerate(model.model.layers):
            experts = next((m for m in layer.modules() if isinstance(m, RoutedExperts)), None)
            skip = {id(m) for ex in (experts or ()) for m in ex.modules()}
            yield "layer", index, [(layer, f"model.layers.{index}.")], skip, experts
        head = [(model.model.norm, "model.norm."), (model.lm_head, "lm_head.")]
        if hasattr(model.model, "hc_head"):
            head.append((model.model.hc_head, "model.hc_head."))
        lm = self._vocab(model, "head")
        yield "head", None, head, {id(lm)} if lm else set(), None

    @contextmanager
    def part(self, model: nn.Module, kind: str, layer: int | None = None):
        roots, skip, experts = next((r, s, e) for k, i, r, s, e in self._parts(model) if k == kind and i == layer)
        slots = [s for r, p in roots for s in _slots(r, p, skip)]
        state, stored = self.part_state(kind, layer, _expected(slots))
        held = self._load(slots, state, stored)
        if experts is not None:
            prefix = next(f"model.layers.{layer}.{p}." for p, m in model.model.layers[layer].named_modules()
                          if m is experts)
            experts.fetch = lambda e: self._expert(layer, experts[e], f"{prefix}{e}.", e)
        vocab = self._vocab(model, kind)
        if vocab is not None:
            vocab.fetch_rows = ((lambda ids: self._rows(kind, vocab, ids, None)) if kind == "embed" else
                                (lambda a, z: self._rows(kind, vocab, None, (a, z))))
        self._kept = {}  # this layer's experts still resident, least recently used first
        self.stats.parts += 1
        try:
            yield
        finally:
            if experts is not None:
                experts.fetch = None
            if vocab is not None:
                vocab.fetch_rows = None
            for kept in self._kept.values():
                self._drop(kept)
            self._kept = {}
            self._drop(held)
            self.part_done(kind, layer)

    @contextmanager
    def _expert(self, layer: int, module: nn.Module, prefix: str, e: int):
        """Expert ``e`` resident for the block. It stays while its layer runs (decode fetches it again at every
        position), until the budget needs the room: then the least recently used experts go first."""
        kept = self._kept
        if e in kept:
            kept[e] = kept.pop(e)  # most recently used last
            yield
            return
        slots = list(_slots(module, prefix, set()))
        if self.budget is not None:
            one = sum(_bytes(s[4]) for s in slots if s[3] is not None)
            need = one + self.stored_bytes("layer", layer, True, one)
            while kept and self.stats.resident + need > self.budget:
                self._drop(kept.pop(next(iter(kept))))
        state, stored = self.expert_state(layer, e, _expected(slots))
        kept[e] = self._load(slots, state, stored)
        self.stats.experts += 1
        yield

    @contextmanager
    def _rows(self, kind: str, module: nn.Module, ids: torch.Tensor | None, span: tuple[int, int] | None):
        """Vocabulary rows resident for the block, in the module's dtype (copied as :meth:`_load` copies a whole
        tensor, so each row holds what the whole table's row would), counted in the stats, dropped after."""
        st = self.stats
        got, stored = self.rows_state(kind, ids, span)
        new = self._take((got.shape[0], module.weight.shape[1]), module.weight.dtype, st.resident + stored).copy_(got)
        del got
        st.peak = max(st.peak, st.resident + _bytes(new) + stored + self._pooled)
        st.resident += _bytes(new)
        try:
            yield new
        finally:
            st.resident -= _bytes(new)
            self._recycle(new)
            del new

    def _load(self, slots: list, state: dict, stored: int):
        """Check ``state`` strictly against ``slots`` and put it there; return what to drop after."""
        from ktconvert.model.weights import check_state

        groups: dict[int, list] = {}  # slots sharing one tensor (a gate's view of its block's score bias)
        for slot in slots:
            groups.setdefault(id(slot[4]), []).append(slot)
        check_state(_expected(slots), state, self.path, self.cfg.family)
        held, weights, st = [], 0, self.stats
        st.peak = max(st.peak, st.resident + stored)
        with torch.no_grad():
            for group in groups.values():
                name = next((s[3] for s in group if s[3] is not None), None)
                if name is None:
                    continue  # a non-persistent buffer computed from the config (rotary tables): already real
                old = group[0][4]
                value = state[name]
                pending = isinstance(value, Pending)
                cost = value.cost if pending else 0
                new = self._take(old.shape, old.dtype, st.resident + weights + stored + cost)
                src = value.load() if pending else value
                new.copy_(src)  # as load_weights copies
                del src  # a pending tensor's decoding goes before the next one is decoded
                if name in self.lora:  # verify --lora's reference: the delta added as to the resident model
                    from ktconvert.formats.lora_delta import lora_delta

                    new.add_(torch.from_numpy(lora_delta(self.lora[name])).to(new.dtype))
                weights += _bytes(new)
                # while a pending tensor is copied in: what is in so far, this tensor and its decoding (eager
                # sources' stored copies are all held until the part is in)
                st.peak = max(st.peak, st.resident + weights + stored + cost + self._pooled)
                for mod, table, attr, _, _ in group:
                    table[attr] = nn.Parameter(new, requires_grad=False) if table is mod._parameters else new
                held.append(group)
        st.resident += weights
        return held, weights

    def _drop(self, held) -> None:
        groups, weights = held
        for group in groups:
            old = group[0][4]
            meta = torch.empty(old.shape, dtype=old.dtype, device="meta")
            real = group[0][1][group[0][2]]
            for mod, table, attr, _, _ in group:
                table[attr] = nn.Parameter(meta, requires_grad=False) if table is mod._parameters else meta
            self._recycle(real)
            del real
        self.stats.resident -= weights

    # --- reusing dropped weights' memory --------------------------------------------------------------------------
    # A tensor of a new part in memory just freed by the last one: freshly mapped pages fault in one by one as they
    # are first written (glibc maps every tensor of 128 KiB or more on its own, ktconvert.io.heap.return_freed_memory), which made
    # the widening copy of a BF16 weight 10-30x slower than a copy into pages already in memory (docs/measurements.md).
    # With `reuse` on and a budget, dropped tensors are kept and handed to the next slot of the same shape and
    # dtype (layers and experts repeat their shapes); what is kept counts in the peak, and is freed, oldest first,
    # before anything new would pass the budget. Every slot is overwritten whole before it is read, so the numbers are the same.

    def _take(self, shape, dtype: torch.dtype, busy: int) -> torch.Tensor:
        """An uninitialised tensor for a slot: a kept one of that shape and dtype, else a new one. ``busy``: the
        bytes held besides the pool meanwhile (what is resident, being loaded and decoded)."""
        shape = tuple(shape)
        for i in range(len(self._free) - 1, -1, -1):
            t = self._free[i]
            if t.dtype == dtype and tuple(t.shape) == shape:
                del self._free[i]
                self._pooled -= _bytes(t)
                self._shrink(busy + _bytes(t))
                return t
        self._shrink(busy + _prod(shape) * torch.empty((), dtype=dtype).element_size())
        return torch.empty(shape, dtype=dtype)

    def _shrink(self, busy: int) -> None:
        """Free kept tensors, oldest first, until they and ``busy`` fit the budget."""
        while self._free and (self.budget is None or self._pooled + busy > self.budget):
            self._pooled -= _bytes(self._free.pop(0))

    def _recycle(self, t: torch.Tensor) -> None:
        """Keep a dropped tensor for reuse when nothing else holds its memory (a view or a reference kept by a
        hook would see it overwritten: such a tensor is left to be freed as before), there is a budget
        and :attr:`reuse` is on."""
        use = getattr(torch._C, "_storage_Use_Count", None)
        if not self.reuse or self.budget is None or use is None or t.device.type != "cpu" or t.is_meta:
            return
        if use(t.untyped_storage()._cdata) != 2 or t.untyped_storage().nbytes() != _bytes(t) or t.requires_grad:
            return  # 2: this tensor and the probe's storage object
        self._free.append(t.detach())
        self._pooled += _bytes(t)


def _largest(part: str, roots, skip: set[int]) -> str:
    """``part`` and its largest module's float32 weights (what to look at when a budget cannot hold it)."""
    sizes = []
    for root, prefix in roots:
        for name, child in root.named_children():
            if id(child) not in skip:
                sizes.append((sum(_bytes(s[4]) for s in _slots(child, "", skip) if s[3] is not None), prefix + name))
    size, name = max(sizes, default=(0, ""))
    return f"{part} (largest module {name}: {format_size(size)})" if size else part


def _expected(slots) -> dict[str, tuple]:
    return {s[3]: tuple(s[4].shape) for s in slots if s[3] is not None}


class CheckpointWeights(StreamedWeights):
    """A Hugging Face safetensors release (plain or any quantized format :mod:`ktconvert.formats.quantized` reads),
    read part by part through :func:`~ktconvert.model.weights.stored_tensor` and
    :func:`~ktconvert.model.weights.to_reference_state`, as the in-memory loader reads it whole."""

    def __init__(self, model_dir, cfg, budget: int | None = None):
        from ktconvert.formats import open_release

        super().__init__(model_dir, cfg, budget)
        release = open_release(model_dir)  # the run's one opened release (headers, decoding), or opened here
        ck = release.checkpoint
        if ck.container != "safetensors":
            raise InputError(f"a {ck.container} checkpoint, not Hugging Face safetensors", path=self.path,
                             fix="pass the Hugging Face checkpoint directory")
        self.ck = ck
        self.qmap = release.qmap
        self.files = tuple(Path(f) for f in ck.files)
        sp = cfg.spec
        self.groups: dict[tuple, list[str]] = {}  # ("embed",) / ("head",) / ("layer", L) / ("expert", L, e)
        self.fused: dict[int, list[str]] = {}  # layer -> its stacked expert tensors (read one expert's slab each)
        self.vocab: dict[str, str] = {}  # "embed" / "head" -> the stored embedding table / lm_head (read by rows)
        self._expert_cost: dict[int, int] = {}  # layer -> stored_bytes of one expert
        block = cfg.moe_block_name
        for name in ck:
            if name in self.qmap.scales or name.startswith(sp.ignore_prefixes):
                continue
            key = sp.canonical_name(name)
            m = _LAYER.match(key)
            if key in VOCAB_NAMES:
                self.vocab[VOCAB_NAMES[key]] = name
                continue
            if m is None:
                self.groups.setdefault(("embed",) if key.startswith("model.embed_tokens.") else ("head",), []).append(name)
                continue
            layer = int(m.group(1))
            if layer >= cfg.num_hidden_layers or key.endswith("rotary_emb.inv_freq"):
                continue  # to_reference_state skips these too (multi-token prediction, rotary tables)
            key = re.sub(r"^(model\.layers\.\d+)\.mlp\.", rf"\1.{block}.", key)
            if _FUSED.match(key):
                self.fused.setdefault(layer, []).append(name)
            elif (x := _EXPERT.match(key)) is not None:
                self.groups.setdefault(("expert", layer, int(x.group(1))), []).append(name)
            else:
                self.groups.setdefault(("layer", layer), []).append(name)
        if cfg.tie_word_embeddings and "head" not in self.vocab and "embed" in self.vocab:
            self.vocab["head"] = self.vocab["embed"]  # lm_head is the embedding: the head reads its rows too

    def _bytes_of(self, names) -> int:
        return sum(self.ck[n].nbytes for n in names)

    def _mapped(self, name: str) -> torch.Tensor:
        """Stored tensor ``name`` as :func:`~ktconvert.model.weights.stored_tensor` gives it (a quantized weight
        decoded), a plain one as a read-only view of its memory map, to be copied once, straight into its slot (not
        first into a stored copy: fresh pages cost more than the copy, docs/measurements.md); its pages are asked for
        at once, so the kernel reads them ahead in large requests rather than one fault at a time."""
        from ktconvert.model.weights import as_torch, stored_tensor

        if name in self.qmap.weights:
            return stored_tensor(self.ck, self.qmap, name)
        view = self.ck.read(name)
        mm = getattr(view, "_mmap", None)
        if mm is not None and hasattr(mmap, "MADV_WILLNEED"):
            mm.madvise(mmap.MADV_WILLNEED)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns of a read-only array: it is only read
            return as_torch(view, self.ck[name].dtype, name)

    def _cost(self, name: str) -> int:
        """Bytes held while stored tensor ``name`` is decoded: the stored bytes read, and a quantized weight's float32
        decoding (4 bytes an element, whatever its stored width: an FP8 weight decodes to 4x its size)."""
        w = self.qmap.weights.get(name)
        return self.ck[name].nbytes + (4 * int(np.prod(w.shape)) if w is not None else 0)

    def stored_bytes(self, kind: str, layer: int | None, expert: bool = False, weights: int = 0) -> int:
        """A part's (or one expert's) tensors are decoded one at a time (:class:`Pending`): the largest one's
        decoding; a fused layer's expert slabs are decoded together (a gate_up and a down make an expert): all of them."""
        if not expert:
            return max(map(self._cost, self.groups.get(("layer", layer) if kind == "layer" else (kind,), [])), default=0)
        if layer not in self._expert_cost:  # asked at every expert fetch: the layer's experts scanned once
            split = max((self._cost(n) for k, v in self.groups.items() if k[0] == "expert" and k[1] == layer
                         for n in v), default=0)
            self._expert_cost[layer] = max(split, sum(map(self._cost, self.fused.get(layer, []))) // self.cfg.num_experts)
        return self._expert_cost[layer]

    def part_state(self, kind, layer, expected):
        names = self.groups.get(("layer", layer) if kind == "layer" else (kind,), [])
        return self._state(names, None)

    def has_rows(self, kind: str) -> bool:
        return kind in self.vocab

    def rows_state(self, kind, ids, span):
        from ktconvert.formats import quantized
        from ktconvert.model.weights import as_torch

        name = self.vocab[kind]
        info, w = self.ck[name], self.qmap.weights.get(name)
        rows = len(ids) if ids is not None else span[1] - span[0]
        if w is not None:  # a quantized release's table: decoded as quantize decodes it, only these rows
            got = torch.from_numpy(quantized.read_row_ids(self.ck, w, ids.numpy()) if ids is not None else
                                   quantized.read_rows(self.ck, w, *span))
        else:
            view = self.ck.read(name)
            got = as_torch(np.array(view[ids.numpy()] if ids is not None else view[span[0]:span[1]]), info.dtype, name)
        self.stats.bytes_read += self._row_bytes(kind) * rows
        return got, _bytes(got)

    def _row_bytes(self, kind: str) -> int:
        name = self.vocab[kind]
        w = self.qmap.weights.get(name)
        if w is not None:  # codes and scales of a row take less than its float32 decoding
            return 4 * int(w.shape[-1])
        return self.ck[name].nbytes // self.ck[name].shape[0]

    def rows_stored_bytes(self, kind: str, rows: int) -> int:
        """The stored rows, and (a quantized table) their float32 decoding before the rows asked are picked."""
        name = self.vocab[kind]
        decoded = 4 * rows * int(self.qmap.weights[name].shape[-1]) if name in self.qmap.weights else 0
        return self._row_bytes(kind) * rows + decoded

    def expert_state(self, layer, e, expected):
        fused = self.fused.get(layer)
        return self._state(fused if fused else self.groups.get(("expert", layer, e), []), e if fused else None)

    def _state(self, names: list[str], expert: int | None) -> tuple[dict, int]:
        from ktconvert.model.weights import stored_tensor, to_reference_state

        if expert is None:  # each tensor decoded when its slot is filled (renaming needs no data: meta tensors)
            state = {}
            for n in names:
                w = self.qmap.weights.get(n)
                meta = torch.empty(w.shape if w is not None else self.ck[n].shape, device="meta")
                for key, t in to_reference_state(self.cfg, {n: meta}).items():
                    state[key] = Pending(t.shape, self._cost(n), lambda n=n, key=key: to_reference_state(
                        self.cfg, {n: self._mapped(n)})[key], mapped=w is None)
            self.stats.bytes_read += self._bytes_of(names)
            return state, 0
        tensors = {n: stored_tensor(self.ck, self.qmap, n, expert=expert) for n in names}
        stored = sum(_bytes(t) for t in tensors.values())
        self.stats.bytes_read += sum(self._bytes_of([n]) // (1 if expert is None else self.cfg.num_experts)
                                     for n in names)
        return to_reference_state(self.cfg, tensors, expert=expert), stored


class ConvertedWeights(StreamedWeights):
    """A converted checkpoint (a GGUF, split sets too, or kernel-order safetensors) read part by part through
    :class:`ktconvert.model.ops.source.WeightSource`, each reference tensor dequantized as the in-memory candidate
    loader (``inject``'s default loading) dequantizes it; an expert's ggml blocks are a memory map, so only the
    picked experts' bytes are touched."""

    def __init__(self, source, cfg, budget: int | None = None):
        super().__init__(source.path, cfg, budget)
        self.source = source

    def part_state(self, kind, layer, expected):
        return self._state(expected)

    def expert_state(self, layer, e, expected):
        return self._state(expected)

    def _state(self, expected: dict[str, tuple]) -> tuple[dict, int]:
        state = {n: torch.from_numpy(np.ascontiguousarray(self.source.tensor(n, shape))) for n, shape in expected.items()}
        self.stats.bytes_read += sum(_bytes(t) for t in state.values())  # float32 handed over (stored is smaller)
        return state, sum(_bytes(t) for t in state.values())

    def stored_bytes(self, kind: str, layer: int | None, expert: bool = False, weights: int = 0) -> int:
        return weights  # the dequantized float32 copies, before they go into the slots

    def has_rows(self, kind: str) -> bool:
        return self.source.vocab_name(VOCAB_PARTS[kind]) is not None

    def rows_state(self, kind, ids, span):
        got = torch.from_numpy(self.source.rows(VOCAB_PARTS[kind], None if ids is None else ids.numpy(), span))
        self.stats.bytes_read += _bytes(got)  # float32 handed over, as for whole tensors
        return got, _bytes(got)

    def rows_stored_bytes(self, kind: str, rows: int) -> int:
        return 8 * rows * self.cfg.hidden_size  # the stored rows (at most float32) and their float32 decoding

    def part_done(self, kind, layer):
        self.source.forget(layer if kind == "layer" else kind)


class _ExpertCache(dict):
    """A CPU-experts operator's decoded experts (``CpuExpertsGGML._cache``) held within the provider's budget:
    adding one drops the least recently used first while the budget is short (each is used as soon as it is
    fetched, so dropping it costs a decode again, never a wrong number)."""

    def __init__(self, provider: "StreamedWeights"):
        super().__init__()
        self.provider = provider

    def get(self, key, default=None):
        w = super().pop(key, None)
        if w is None:
            return default
        super().__setitem__(key, w)  # most recently used last
        return w

    def __setitem__(self, key, w) -> None:
        st, budget, need = self.provider.stats, self.provider.budget, _bytes(w)
        while self and budget is not None and st.resident + need > budget:
            st.resident -= _bytes(self.pop(next(iter(self))))
        super().__setitem__(key, w)
        st.resident += need
        st.peak = max(st.peak, st.resident)

    def release(self) -> None:
        self.provider.stats.resident -= sum(_bytes(w) for w in self.values())
        self.clear()


class InjectedWeights(ConvertedWeights):
    """An injected candidate streamed: the weights its modules keep (``inject``'s default loading) come part by part
    as :class:`ConvertedWeights` reads them, and the operators ``inject(..., lazy=True)`` left unbuilt (the wrapper
    operators' generate and prefill ops: CPU experts, dequantized linears) are built when their part starts and
    released when it ends, from the same sources and with the same numerics as when ``inject`` builds them at once.
    What the built operators hold counts in :class:`StreamStats` ``peak``."""

    def __init__(self, source, cfg, switches: dict, budget: int | None = None):
        super().__init__(source, cfg, budget)
        self.switches = switches  # path -> PhaseSwitch

    @staticmethod
    def _part_of(path: str) -> tuple[str, int | None]:
        m = _LAYER.match(path + ".")
        if m is not None:
            return "layer", int(m.group(1))
        return ("embed", None) if path.startswith("model.embed_tokens") else ("head", None)

    def _mine(self, kind: str, layer: int | None) -> list:
        return [s for p, s in self.switches.items() if self._part_of(p) == (kind, layer)]

    def part_extra(self, kind: str, layer: int | None) -> int:
        """The least the part's operators hold while they run (``resident_bytes`` of each op ``inject`` built;
        the real kernel's: what its child process holds for the layer's experts)."""
        return sum(d.resident_bytes for d in self._ops(kind, layer))

    def extra_note(self, kind: str, layer: int | None) -> str:
        kernel = [d for d in self._ops(kind, layer) if d.emulation == "kt-kernel"]
        return ("its operators, the kt-kernel child holding its packed experts among them (twice while the BF16 class "
                "copies them in)") if kernel else ""

    def _ops(self, kind: str, layer: int | None) -> list:
        return list({id(d): d for s in self._mine(kind, layer) for d in s.described.values() if d is not None}.values())

    @contextmanager
    def part(self, model: nn.Module, kind: str, layer: int | None = None):
        mine = self._mine(kind, layer)
        with super().part(model, kind, layer):
            held, caches = 0, []
            st = self.stats
            try:
                for switch in mine:
                    switch.load()
                    for op in {id(o): o for o in switch.ops.values() if o is not None}.values():
                        if isinstance(getattr(op, "_cache", None), dict):  # decodes experts as tokens pick them
                            op._cache = _ExpertCache(self)
                            caches.append(op._cache)
                            # the stored experts it keeps in memory (safetensors experts) count before its cache
                            # does, so the cache's least recently used go first when the budget is short
                            held += op.stored_bytes() if hasattr(op, "stored_bytes") else 0
                        else:  # holds its dequantized weights (or the kernel child its layer) from the start
                            held += op.resident_bytes() if hasattr(op, "resident_bytes") else 0
                        inner = getattr(op, "emulated_op", None)  # --kernel both: the emulation runs beside it
                        if isinstance(getattr(inner, "_cache", None), dict):
                            inner._cache = _ExpertCache(self)
                            caches.append(inner._cache)  # its stored experts: in the kernel op's resident_bytes
                st.resident += held
                st.peak = max(st.peak, st.resident)
                yield
            finally:
                for cache in caches:
                    cache.release()
                st.resident -= held
                for switch in mine:
                    switch.release()
