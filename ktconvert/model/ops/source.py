"""Weights as the injected operators read them: one checkpoint, HF safetensors or GGUF.

Two views, because upstream operators read weights two ways: :meth:`WeightSource.tensor` gives any tensor
dequantized to float32 in the reference model's shape (what ``load_gguf_tensor`` hands the default modules,
``KLinearTorch`` and ``KExpertsTorch``); :meth:`WeightSource.expert_blocks` gives a layer's expert tensors as
stored, ggml blocks and all (what ``KExpertsCPU`` maps and the llamafile kernel reads).

GGUF files follow llama.cpp's conventions and are read the way ktransformers' loader reads them: names through
``rules/naming``, a naming map's value transforms undone (:mod:`ktconvert.formats.transforms`), attention q/k rows of the ``llama`` architecture (Mixtral) un-permuted, ``kv_b_proj`` rebuilt
from ``attn_k_b``/``attn_v_b`` where a newer DeepSeek GGUF stores it split, Qwen3-Next's ``in_proj_qkvz`` from
``attn_qkv``/``attn_gate``. Safetensors checkpoints are loaded
whole (per-expert, fused and Mixtral spellings through :mod:`ktconvert.model.weights`); that is fine for the
models verify can run on a CPU.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ktconvert import quant
from ktconvert.errors import InputError, UsageProblem
from ktconvert.families.config import MoeConfig
from ktconvert.formats import naming_map, transforms
from ktconvert.formats.checkpoint import COMPANION
from ktconvert.formats.kt_amx import NAME_RE as KT_AMX_NAME
from ktconvert.formats.lora_delta import EXPERT_WEIGHT, lora_delta
from ktconvert.formats.release import Release, open_release
from ktconvert.io.dtypes import TORCH_NAMES
from ktconvert.io.files import ReadBuffer
from ktconvert.model.executor import VOCAB_NAMES, VOCAB_PARTS
from ktconvert.model.weights import read_tensors

PROJECTIONS = ("gate", "up", "down")


@dataclass
class Blocks:
    """One projection of one layer's experts as stored: ``data`` is uint8 ``[E, rows, row_bytes]``."""

    qtype: str  # ggml type name
    data: np.ndarray
    shape: tuple[int, int, int]  # elements: [E, rows, cols]
    names: tuple[str, ...]  # the stored tensor(s) it came from
    lora: tuple | None = None  # verify --lora: per expert, the adapter's lora tuple (or None), added on decoding
    in_memory: bool = False  # data is a copy in memory (read from safetensors, or stacked), not a view of a mapped file
    # a view of a mapped file: where :meth:`expert` reads an expert's bytes instead, with pread
    # (Checkpoint.read_rows into a reused buffer): (checkpoint, stored name, flat rows per expert, its first row in
    # one expert). Pages touched through the map would stay in the process's RSS until the layer is done (a real
    # layer's picked Q8_0 experts: 220 MiB of mapped file pages outside every budget, docs/measurements.md)
    stored: tuple | None = None
    buf: ReadBuffer | None = None

    def raw(self, e: int) -> np.ndarray:
        """Expert ``e``'s stored bytes ``[rows, row bytes]`` (read from the file where :attr:`stored` says where; valid
        until the buffer's next read)."""
        if self.stored is None:
            return self.data[e]
        ck, name, per, first = self.stored
        r0 = e * per + first
        return _as_bytes(ck.read_rows(name, r0, r0 + self.shape[1], self.buf))

    def expert(self, e: int) -> np.ndarray:
        """Expert ``e`` dequantized to float32 ``[rows, cols]`` (each expert is whole blocks: rows hold them), plus
        ``alpha/r * B @ A`` when an adapter is applied."""
        w = quant.dequantize(self.raw(e), self.qtype, name=self.names[0]).reshape(self.shape[1:])
        if self.lora is not None and self.lora[e] is not None:
            w = w + lora_delta(self.lora[e])
        return w


@dataclass
class ExpertBlocks:
    layer: int
    gate: Blocks
    up: Blocks
    down: Blocks

    def types(self) -> dict[str, str]:
        return {p: getattr(self, p).qtype for p in PROJECTIONS}


class MissingTensor(InputError):
    """The checkpoint lacks a tensor an operator or module reads; ``names`` are the stored names looked for."""

    def __init__(self, message: str, names: list[str], **kw):
        self.names = list(names)
        super().__init__(message, **kw)


def _missing(path: str, names: list[str], what: str) -> MissingTensor:
    more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    return MissingTensor(f"{what}: no tensor {', '.join(names[:3])}{more}", names, path=path,
                         fix="the checkpoint lacks tensors this model needs; list them with ktconvert inspect")


def _as_bytes(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape(*a.shape[:-1], -1).view(np.uint8) if a.dtype != np.uint8 else a


def _fit(name: str, arr: np.ndarray, shape: tuple[int, ...] | None, path: str) -> np.ndarray:
    """Reshape a tensor to the reference shape when they differ only by size-1 axes (llama.cpp stores some
    ``[1, H]`` gates as ``[H]``); any other difference is an error naming both shapes."""
    if shape is None or tuple(arr.shape) == tuple(shape):
        return arr
    if [d for d in arr.shape if d != 1] == [d for d in shape if d != 1]:
        return arr.reshape(shape)
    raise InputError(f"shape {list(arr.shape)} does not fit the model's {list(shape)}", path=path, where=name,
                     fix="is config.json the one these weights were converted from?")


class WeightSource:
    """A checkpoint the injected model reads from (``--weights``, ``--prefill-weights`` or the model directory, as
    the :class:`~ktconvert.formats.release.Release` the run opened)."""

    def __init__(self, path: str | os.PathLike | Release, cfg: MoeConfig):
        self.path = str(path)
        self.cfg = cfg
        p = Path(path)
        if not p.exists():
            raise InputError("weights not found", path=self.path,
                             fix="pass a .gguf file, a .safetensors file or a checkpoint directory")
        if p.is_dir():
            gguf = not any(p.glob("*.safetensors*")) and any(p.glob("*.gguf"))
            if not gguf and not any(p.glob("*.safetensors*")):
                raise InputError("no .gguf or .safetensors files", path=self.path,
                                 fix="pass a checkpoint file or directory")
        else:
            gguf = p.suffix == ".gguf"
        self.release = open_release(path)
        if gguf:
            self.container = "gguf"
            self._ck = self.release.checkpoint
            self._init_ggml_named()
        else:
            ck = self.release.checkpoint
            if any(KT_AMX_NAME.match(n) for n in ck):  # kt-kernel's expert blobs: the kernel reads them, not the model
                raise UsageProblem("this is a kt-amx directory (kt-kernel's AMX expert blobs, no other weights)",
                                   path=self.path, fix="pass it as --kt-weights (with --kernel kt-kernel), and the "
                                   "model's own weights or a GGUF/safetensors conversion as --weights")
            if any(n.endswith(COMPANION) for n in ck):  # llama.cpp names, ggml blocks, types beside them
                self.container = "kernel-safetensors"
                self._ck = ck
                self._init_ggml_named()
            else:
                self.container = "safetensors"
                self._init_safetensors()
        self._blocks: dict[int, ExpertBlocks] = {}
        self._buf = ReadBuffer()  # what experts and vocabulary rows are read into from the file (pread, reused)
        self.lora: dict[str, tuple] = {}

    def apply_lora(self, deltas: dict[str, tuple]) -> None:
        """Read every weight the adapter adapts as ``W + alpha/r * B @ A`` in float32 (``deltas``: HF name ->
        lora tuple, :func:`ktconvert.convert.lora_merge.load_lora`), as a served adapter changes what the model
        computes. The stored blocks stay as they are: only the float32 views change."""
        self.lora = dict(deltas)
        self._blocks.clear()

    # --- safetensors ------------------------------------------------------------------------------------------
    def _init_safetensors(self) -> None:
        self.arch = self.cfg.family
        self._state = _PartStates(self.release, self.cfg)  # read part by part as asked, as the streamed reference reads
        # quantized release formats of the experts (read here decoded; kt-kernel reads them as released)
        qmap = self._state.reader.qmap
        self.release_formats = tuple(sorted({w.fmt for n, w in qmap.weights.items() if ".experts." in n}))
        self.expert_names = tuple(n for n in qmap.weights if ".experts." in n)
        # FP8 block shapes of the experts (kt-kernel's FP8 method reads 128x128 only)
        self.fp8_blocks = tuple(sorted({tuple(w.block) for n, w in qmap.weights.items()
                                        if ".experts." in n and w.fmt == "FP8"}))

    # --- llama.cpp-named: GGUF, or kernel-order safetensors (ktransformers' "hybrid" form) -------------------
    def _init_ggml_named(self) -> None:
        """Index every stored tensor's ggml type and element shape. Kernel-order safetensors store ggml blocks
        as uint8 rows with the type in a ``NAME.ggml_type`` scalar beside each tensor (what ktransformers'
        SafeTensorLoader reads); ``formats.checkpoint`` decodes those, here only their presence is required."""
        ck = self._ck
        self._types: dict[str, str] = {}
        self._shapes: dict[str, tuple] = {}
        if self.container == "gguf":
            self.arch = ck.architecture
        else:
            self.arch = ck.metadata.get("architecture") or naming_map(self.cfg.family).arch
        for name, info in ck.items():
            if self.container != "gguf":
                if name.endswith(COMPANION):
                    continue
                base = name[: -len(".weight")] if name.endswith(".weight") else name
                if base + COMPANION not in ck:
                    raise InputError(f"tensor has no {COMPANION} beside it", path=self.path, where=name,
                                     fix=f"kernel-order safetensors carry NAME{COMPANION} for every tensor")
            # the checkpoint already presents kernel-order U8 rows as their ggml type and element shape
            self._types[name], self._shapes[name] = info.dtype, tuple(info.shape)
        want = naming_map(self.cfg.family)
        if self.arch != want.arch:
            raise InputError(f"{self.container} architecture {self.arch!r} is not {want.arch!r}, which the config's "
                             f"{self.cfg.family} needs", path=self.path,
                             fix="pass the weights converted from this --model")
        self._naming = want

    def _kv_int(self, key: str, default: int) -> int:
        value = self._ck.metadata.get(f"{self.arch}.{key}")
        return int(value) if isinstance(value, (int, np.integer)) else default

    def _read_gguf(self, gname: str) -> np.ndarray:
        qtype, shape = self._types[gname], self._shapes[gname]
        raw = self._ck.read(gname)
        if qtype in ("F32", "F16"):
            out = np.array(raw, dtype=np.float32)
        elif qtype in ("I8", "I16", "I32"):  # an index table (DeepSeek-V4's tid2eid): ids as they are
            out = np.array(raw, dtype=np.int64)
        else:
            out = quant.dequantize(raw, qtype, name=gname)
        return out.reshape(shape)

    def _gguf_tensor(self, name: str) -> np.ndarray:
        m = self._naming.lookup(name)
        if m is None or m.gguf_name is None:
            raise MissingTensor(f"no llama.cpp name for {name}", [name], path=self.path, where=name,
                                fix="rules/naming has no entry for this tensor")
        if m.group == "experts":  # a per-expert HF name: slice the merged tensor
            blocks = self.expert_blocks(m.layer)
            return getattr(blocks, m.projection).expert(m.expert)
        gname = m.gguf_name
        if m.group == "expert_biases" and m.expert is not None:  # one expert's row of the merged [E, rows] bias
            if gname not in self._types:
                raise _missing(self.path, [gname], f"tensor for {name}")
            return self._read_gguf(gname)[m.expert]
        if dict(m.transform).get("kv_b_split"):  # an architecture that stores kv_b_proj only split (glm-dsa)
            return self._kv_b_from_split(gname.replace(".attn_k_b.", ".attn_kv_b.").replace(".attn_v_b.", ".attn_kv_b."), name)
        if dict(m.transform).get("qkvz_split"):  # Qwen3-Next's in_proj_qkvz, stored as attn_qkv + attn_gate
            return self._qkvz_from_split(m, name)
        if gname not in self._types and gname.endswith(".attn_kv_b.weight"):
            return self._kv_b_from_split(gname, name)
        if gname not in self._types:
            raise _missing(self.path, [gname], f"tensor for {name}")
        arr = self._read_gguf(gname)
        if m.transform:  # what llama.cpp's converter did to the values (norm + 1, -exp(A_log), tiled value heads)
            arr = transforms.undo(arr, dict(m.transform), self.cfg.attention.linear, f"tensor {gname}")
        if self.arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            heads = self._kv_int("attention.head_count" if ".attn_q." in gname else "attention.head_count_kv",
                                 self.cfg.num_attention_heads if ".attn_q." in gname else self.cfg.num_key_value_heads)
            arr = unpermute_rope_rows(arr, heads)
        return arr

    def _kv_b_from_split(self, gname: str, name: str) -> np.ndarray:
        """``kv_b_proj`` from llama.cpp's split form: ``attn_k_b [heads, rank, nope]`` (transposed per head) and
        ``attn_v_b [heads, v, rank]``, interleaved back per head as ``[nope + v]`` rows."""
        k_name, v_name = gname.replace("attn_kv_b", "attn_k_b"), gname.replace("attn_kv_b", "attn_v_b")
        missing = [n for n in (gname, k_name, v_name) if n not in self._types]
        if k_name in missing or v_name in missing:
            raise _missing(self.path, missing, f"tensor for {name}")
        cfg = self.cfg
        heads, nope, vdim, rank = cfg.num_attention_heads, cfg.attention.mla.qk_nope_head_dim, cfg.attention.mla.v_head_dim, cfg.attention.mla.kv_lora_rank
        k_b = self._read_gguf(k_name).reshape(heads, rank, nope).transpose(0, 2, 1)
        v_b = self._read_gguf(v_name).reshape(heads, vdim, rank)
        return np.concatenate([k_b, v_b], axis=1).reshape(heads * (nope + vdim), rank)

    def _qkvz_from_split(self, m, name: str) -> np.ndarray:
        """``in_proj_qkvz`` from llama.cpp's ``attn_qkv`` (every q, k, value head) and ``attn_gate`` (every z),
        interleaved back per key head."""
        parts = {dict(s.transform)["qkvz_split"]: s.gguf_name for s in self._naming.hf_siblings(m)}
        missing = [g for g in parts.values() if g not in self._types]
        if missing:
            raise _missing(self.path, missing, f"tensor for {name}")
        return transforms.join_qkvz(self._read_gguf(parts["qkv"]), self._read_gguf(parts["z"]), self.cfg.attention.linear,
                                    f"tensor {parts['qkv']}")

    def _gguf_experts(self, layer: int) -> ExpertBlocks:
        cfg = self.cfg
        e, i, h = cfg.num_experts, cfg.mlp.moe_intermediate_size, cfg.hidden_size
        want = {"gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)}
        nm, ck = self._naming, self._types
        out: dict[str, Blocks] = {}
        merged = {p: nm.expert_name("gguf-merged", p, layer) for p in PROJECTIONS}
        fused = nm.expert_name("gguf-merged", "gate_up", layer)
        tried: list[str] = []
        for p in PROJECTIONS:
            name = merged[p]
            if name in ck:
                out[p] = self._merged_blocks(name, ck[name])
                continue
            tried.append(name)
            if p in ("gate", "up") and fused and fused in ck:
                whole = self._merged_blocks(fused, ck[fused])
                half = whole.data.shape[1] // 2
                part = whole.data[:, :half] if p == "gate" else whole.data[:, half:]
                out[p] = Blocks(whole.qtype, part, (whole.shape[0], half, whole.shape[2]), (fused,),
                                stored=(self._ck, fused, 2 * half, 0 if p == "gate" else half), buf=self._buf)
                continue
            split = [nm.expert_name("gguf-split", p, layer, x) for x in range(e)]
            if all(s in ck for s in split):
                parts = [self._merged_blocks(s, ck[s]) for s in split]
                types = {b.qtype for b in parts}
                if len(types) != 1:
                    raise InputError(f"per-expert tensors of one projection have different types {sorted(types)}",
                                     path=self.path, where=split[0])
                data = np.stack([b.data for b in parts])
                out[p] = Blocks(parts[0].qtype, data, (e, *parts[0].shape), tuple(split), in_memory=True)
                continue
            tried.append(split[0])
        if tried and len(out) < 3:
            raise _missing(self.path, tried, f"experts of layer {layer}")
        for p, b in out.items():
            if tuple(b.shape) != want[p]:
                raise InputError(f"{p} experts have shape {list(b.shape)} (numpy order), the config needs {list(want[p])} "
                                 f"([E, I, H] for gate/up, [E, H, I] for down; ggml's ne lists the reverse)",
                                 path=self.path, where=b.names[0],
                                 fix="the tensor was written in the wrong axis order or for another config")
        return ExpertBlocks(layer, out["gate"], out["up"], out["down"])

    def _merged_blocks(self, name: str, qtype: str) -> Blocks:
        """A stored expert tensor as bytes: ``[E, rows, cols]`` merged, or ``[rows, cols]`` for one expert of
        the legacy split form (the caller stacks those)."""
        shape = self._shapes[name]
        if len(shape) not in (2, 3):
            raise InputError(f"expert tensor has {len(shape)} axes, expected 3 ([E, rows, cols])", path=self.path, where=name)
        stored = (self._ck, name, shape[1], 0) if len(shape) == 3 else None
        return Blocks(qtype, _as_bytes(np.asarray(self._ck.read(name))), shape, (name,), stored=stored, buf=self._buf)

    # --- public ----------------------------------------------------------------------------------------------
    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor holding reference parameter ``name``, dequantized to float32 (``shape``: the parameter's)."""
        if self.container == "safetensors":
            t = self._state.get(name)
            if t is None:
                raise _missing(self.path, [name], "tensor")
            arr = t.to(torch.float32).numpy()
        else:
            arr = self._gguf_tensor(name)  # an expert's slice comes from expert_blocks, the adapter already added
        d = self.lora.get(name)
        if d is not None and (self.container == "safetensors" or not EXPERT_WEIGHT.match(name)):
            arr = _fit(name, arr, shape, self.path) + lora_delta(d)
        return _fit(name, arr, shape, self.path)

    def vocab_name(self, name: str) -> str | None:
        """The stored tensor :meth:`rows` reads for reference tensor ``name`` (``model.embed_tokens.weight`` or
        ``lm_head.weight``; a tied ``lm_head`` without ``output.weight`` reads the embedding), None when ``name``
        cannot be read by rows (a value transform, an adapter): then it is read whole."""
        if name in self.lora:
            return None
        if self.container == "safetensors":
            return name if name in self._state else None
        m = self._naming.lookup(name)
        if m is None or m.gguf_name is None or m.transform:
            return None
        if m.gguf_name not in self._types and name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return self.vocab_name("model.embed_tokens.weight")
        return m.gguf_name if m.gguf_name in self._types and len(self._shapes[m.gguf_name]) == 2 else None

    def rows(self, name: str, ids: np.ndarray | None = None, span: tuple[int, int] | None = None) -> np.ndarray:
        """Rows ``ids`` or ``span`` ``(a, z)`` of reference tensor ``name`` (:meth:`vocab_name`), float32, decoded as
        :meth:`tensor` decodes the whole (ggml blocks run along a row, so a row decodes alone) and reading only those
        rows of the file."""
        stored = self.vocab_name(name)
        sel = ids if ids is not None else slice(*span)
        if self.container == "safetensors":
            by_rows = getattr(self._state, "rows", None)  # streamed: only these rows read, never the whole table
            if by_rows is not None and stored in VOCAB_NAMES:
                return by_rows(stored, ids, span)
            return self._state[stored][torch.from_numpy(np.asarray(sel)) if ids is not None else sel].to(
                torch.float32).numpy()
        qtype, cols = self._types[stored], self._shapes[stored][-1]
        # a span: its rows read with pread (no mapped pages left behind); chosen rows (an embedding's): picked from
        # the map
        raw = np.array(self._ck.read(stored)[sel]) if ids is not None else self._ck.read_rows(stored, *span, self._buf)
        if qtype in ("F32", "F16"):
            return raw.astype(np.float32)
        return quant.dequantize(raw, qtype, name=stored).reshape(raw.shape[0], cols)

    def stored_type(self, name: str) -> str:
        """How ``name``'s tensor is stored (ggml type name, or the safetensors dtype), for the report."""
        if self.container == "safetensors":
            known = getattr(self._state, "stored_dtype", None)  # streamed: a vocabulary table's from its header
            got = known(name) if known is not None else None
            if got is not None:
                return got
            t = self._state.get(name)
            return str(t.dtype).replace("torch.", "") if t is not None else "?"
        m = self._naming.lookup(name)
        gname = m.gguf_name if m else None
        if gname and gname not in self._types and gname.endswith(".attn_kv_b.weight"):
            gname = gname.replace("attn_kv_b", "attn_k_b")
        return self._types.get(gname, "?") if gname else "?"

    def expert_blocks(self, layer: int) -> ExpertBlocks:
        """The experts of ``layer`` as stored (GGUF blocks, or stacked F32/F16/BF16 safetensors rows)."""
        found = self._blocks.get(layer)
        if found is None:
            found = self._blocks[layer] = (self._st_experts(layer) if self.container == "safetensors"
                                           else self._gguf_experts(layer))
            if self.lora:
                names = dict(zip(PROJECTIONS, self.cfg.expert_proj_names))
                prefix = f"model.layers.{layer}.{self.cfg.moe_block_name}.experts"
                for p in PROJECTIONS:
                    per = tuple(self.lora.get(f"{prefix}.{e}.{names[p]}.weight") for e in range(self.cfg.num_experts))
                    if any(d is not None for d in per):
                        getattr(found, p).lora = per
        return found

    def expert_shapes(self, layer: int) -> ExpertBlocks:
        """The experts of ``layer`` as their type and shapes only, with no data: what an operator that never decodes
        them needs (the real kernel reading its own kt-amx files, which would otherwise hold a safetensors layer's
        stacked copy beside its own). A GGUF's blocks are views of the mapped file already, and a safetensors layer
        of mixed types is read as :meth:`expert_blocks` reads it."""
        dtypes = getattr(self._state, "expert_dtypes", None) if self.container == "safetensors" else None
        qtype = dtypes(layer) if dtypes is not None else None
        if qtype is None or self.lora:
            return self.expert_blocks(layer)
        cfg = self.cfg
        e, i, h = cfg.num_experts, cfg.mlp.moe_intermediate_size, cfg.hidden_size
        names = dict(zip(PROJECTIONS, cfg.expert_proj_names))
        prefix = f"model.layers.{layer}.{cfg.moe_block_name}.experts.0"
        shapes = {"gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)}
        return ExpertBlocks(layer, *(Blocks(qtype, np.empty(0, np.uint8), shapes[p], (f"{prefix}.{names[p]}.weight",))
                                     for p in PROJECTIONS))

    def _st_experts(self, layer: int) -> ExpertBlocks:
        cfg = self.cfg
        names = dict(zip(PROJECTIONS, cfg.expert_proj_names))
        prefix = f"model.layers.{layer}.{cfg.moe_block_name}.experts"
        out = {}
        for p in PROJECTIONS:
            keys = [f"{prefix}.{x}.{names[p]}.weight" for x in range(cfg.num_experts)]
            missing = [k for k in keys if k not in self._state]
            if missing:
                raise _missing(self.path, missing, f"experts of layer {layer}")
            first = self._state[keys[0]]
            stacked = torch.empty((len(keys), *first.shape), dtype=first.dtype)
            for x, k in enumerate(keys):  # each expert's read copy dropped once in the stack: not both held whole
                stacked[x] = self._state.pop(k)
            qtype = {TORCH_NAMES[st]: st for st in ("F32", "F16", "BF16")}.get(str(stacked.dtype)[len("torch."):])
            if qtype is None:
                raise InputError(f"experts stored as {stacked.dtype}; the CPU experts kernel reads F32, F16 or BF16 "
                                 "safetensors only (upstream SafeTensorLoader)", path=self.path, where=keys[0],
                                 fix="convert the experts to a GGUF type first (ktconvert quantize)")
            raw = stacked.view(torch.uint16) if qtype == "BF16" else stacked
            out[p] = Blocks(qtype, _as_bytes(raw.contiguous().numpy()), tuple(stacked.shape), (keys[0],),
                            in_memory=True)
        self._state.forget_experts(layer)  # the stacked blocks hold them now
        return ExpertBlocks(layer, out["gate"], out["up"], out["down"])

    @property
    def raw(self) -> dict:
        """Every tensor of a safetensors checkpoint, read whole (the in-memory reference of a resident verify)."""
        return read_safetensors(self.release)

    def forget(self, part: int | str) -> None:
        """Drop what :meth:`expert_blocks` keeps of layer ``part`` and the tensors read for it (``"embed"`` or
        ``"head"``: those parts' tensors); a layer-major run is done with it."""
        self._blocks.pop(part, None)
        self._buf.release()
        if self.container == "safetensors":
            self._state.forget(part)

    def expert_types(self) -> dict[int, dict[str, str]]:
        """``{layer: {projection: ggml type}}`` for every MoE layer (reads headers, not data, for GGUF and for
        safetensors experts of one float dtype)."""
        out = {}
        for layer in sorted(self.cfg.mlp.moe_layers):
            types = self._state.expert_dtypes(layer) if self.container == "safetensors" else None
            out[layer] = {p: types for p in PROJECTIONS} if types else self.expert_blocks(layer).types()
        return out


class _PartStates:
    """A Hugging Face checkpoint's reference state (name -> tensor, stored dtype; quantized releases decoded to
    float32), read one part at a time when a name of it is first asked for: a layer's own weights, its routed
    experts, the embedding, the head; each kept until :meth:`forget`. Grouped and decoded by
    :class:`~ktconvert.model.executor.CheckpointWeights`, as the streamed reference reads the same release."""

    def __init__(self, path: str | Release, cfg: MoeConfig):
        from ktconvert.model.executor import CheckpointWeights

        self.cfg = cfg
        self.reader = CheckpointWeights(path, cfg)
        self.parts: dict[tuple, dict] = {}

    @staticmethod
    def _key(name: str) -> tuple:
        m = _LAYER_NAME.match(name)
        if m is not None:
            return ("experts" if ".experts." in name else "layer", int(m.group(1)))
        return ("embed",) if name.startswith("model.embed_tokens.") else ("head",)

    def _part(self, key: tuple) -> dict:
        from ktconvert.model.executor import Pending

        got = self.parts.get(key)
        if got is None:
            r = self.reader
            if key[0] == "experts":
                got = {}
                for e in range(self.cfg.num_experts):
                    got.update(r.expert_state(key[1], e, None)[0])
            else:
                got = r.part_state(key[0], key[1] if key[0] == "layer" else None, None)[0]
                if key[0] in VOCAB_PARTS and r.has_rows(key[0]):  # the table the streamed reference reads by rows
                    name = r.vocab[key[0]]
                    w = r.qmap.weights.get(name)
                    rows = int(w.shape[0]) if w is not None else int(r.ck[name].shape[0])
                    # read when asked for, not when its name is looked up: the streamed candidate's vocabulary
                    # modules read rows, and a whole table held here would sit beside every later part
                    got = {**got, VOCAB_PARTS[key[0]]: Pending(
                        (rows, self.cfg.hidden_size), 0,
                        lambda kind=key[0], rows=rows: r.rows_state(kind, None, (0, rows))[0])}
            self.parts[key] = got
        return got

    def get(self, name: str, default=None):
        return self[name] if name in self else default

    def __contains__(self, name: str) -> bool:
        return name in self._part(self._key(name))

    def __getitem__(self, name: str):
        from ktconvert.model.executor import resolve

        part = self._part(self._key(name))
        got = part[name] = resolve(part[name])  # decoded when first asked for (the reader's tensors are pending)
        return got

    def pop(self, name: str):
        """``name``'s tensor, no longer kept here (the caller holds it now)."""
        from ktconvert.model.executor import resolve

        return resolve(self._part(self._key(name)).pop(name))

    def rows(self, name: str, ids: np.ndarray | None, span: tuple[int, int] | None) -> np.ndarray:
        """Rows ``ids`` (any order, repeats allowed) or ``span`` of a vocabulary table (a :data:`VOCAB_PARTS` name),
        float32, read from the file alone: the same values as the whole table's rows, without holding the table."""
        kind = VOCAB_NAMES[name]
        if ids is None:
            return self.reader.rows_state(kind, None, span)[0].to(torch.float32).numpy()
        distinct, back = np.unique(np.asarray(ids), return_inverse=True)
        got = self.reader.rows_state(kind, torch.from_numpy(distinct), None)[0]
        return got.to(torch.float32).numpy()[back.reshape(-1)]

    def stored_dtype(self, name: str) -> str | None:
        """The dtype a vocabulary table (a :data:`VOCAB_PARTS` name read by rows) reads as, from its header and
        without reading it (torch's name: ``bfloat16``; a quantized release's decodes to ``float32``); None for
        any other name."""
        kind = VOCAB_NAMES.get(name)
        r = self.reader
        if kind is None or not r.has_rows(kind):
            return None
        stored = r.vocab[kind]
        return "float32" if stored in r.qmap.weights else TORCH_NAMES.get(r.ck[stored].dtype)

    def forget_experts(self, layer: int) -> None:
        self.parts.pop(("experts", layer), None)

    def forget(self, part: int | str) -> None:
        for key in ((("layer", part), ("experts", part)) if isinstance(part, int) else ((part,),)):
            self.parts.pop(key, None)

    def expert_dtypes(self, layer: int) -> str | None:
        """The one float type every stored expert tensor of ``layer`` reads as (a quantized release's: F32, its
        decoding), from the headers; None when there are several or another (the caller reads the layer)."""
        r = self.reader
        names = [n for k, v in r.groups.items() if k[0] == "expert" and k[1] == layer for n in v]
        names += r.fused.get(layer, [])
        types = {"F32" if n in r.qmap.weights else r.ck[n].dtype for n in names}
        return types.pop() if len(types) == 1 and types <= {"F32", "F16", "BF16"} else None


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def read_safetensors(path: str | os.PathLike | Release) -> dict:
    """Every tensor of a safetensors checkpoint (through :mod:`ktconvert.formats`, small files read whole)."""
    return read_tensors(path)


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its rope pairs adjacent rows; HF's rotates halves), per head."""
    rows = w.shape[0]
    if heads <= 0 or rows % (2 * heads):
        raise InputError(f"cannot split {rows} rows into {heads} rope heads", where="attention q/k")
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation for the ``llama`` architecture (the inverse of :func:`unpermute_rope_rows`)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
