"""The child process that holds kt-kernel: ``python -m ktconvert.kernel.child THREADPOOLS THREADS``.

Why a child: importing ``kt_kernel`` flushes subnormal floats to zero for the whole process and some kernel
failures abort it, so nothing exact may share its process and a crash must not take the caller down. One
child runs one method (the loader and worker pool are per-process singletons upstream).

Protocol: one JSON object per line on stdin, one JSON answer per line on a private copy of the original
stdout (fd 1 itself is pointed at stderr, because the C++ side prints its own logs there). Arrays travel as
``.npy`` files in a directory the parent owns. Requests:

* ``{"op": "hello"}`` -> version, variant, the MoE classes compiled into this variant.
* ``{"op": "load", "key", "method", "E", "top_k", "H", "I", "layer", "max_len", ...}`` with, per method,
  ``LLAMAFILE``: ``arrays`` {gate, up, down: npy of the merged ggml blocks [E, rows, row_bytes]} and
  ``types`` {gate, up, down: ggml type id}; ``BF16``: ``arrays`` of uint16 bf16 bits [E, rows, cols];
  ``AMXINT8``/``AMXINT4``: ``dir``, a kt-amx directory, read here by tensor name, and ``scratch``, a folder of the
  parent's where the layer's ``.kt`` files are written for the kernel to read; with ``capacity`` C below E the
  object holds C experts and each forward reads the ones its tokens pick (:meth:`Child._forward_picked`). ``BF16`` with ``sft``
  {``lora``: {gate_a, gate_b, up_a, up_b, down_a, down_b: npy of bf16 bits, the fused ``[E, ., .]`` form},
  ``rank``, ``alpha``}: kt-kernel's SFT class ``AMXBF16_SFT_MOE``, whose forward adds ``alpha/r * B(Ax)`` to
  gate, up and down (verify --lora).
* ``{"op": "forward", "key", "hidden", "ids", "weights", "out"}``: npy paths; writes bf16 bits [T, H] to out
  (a picked layer answers ``loads``: how many times it read picked experts into its object).
* ``{"op": "unload", "key"}``: the layer is done (a streamed verify frees each layer's experts when its part ends);
  answers like ``memory``.
* ``{"op": "memory"}`` -> ``rss``, ``hwm``: this process's VmRSS and VmHWM in bytes.
* ``{"op": "quit"}``.

Memory. kt-kernel's AMX classes (AMXINT8, AMXINT4, BF16) copy the experts into buffers of their own at
``load_weights_task`` and never free those buffers (upstream's destructor is the default one: a freed layer object
leaks its weights). So a layer of those methods is loaded into a *slot*: one MoE object and one staging per shape,
reused by the next layer of that shape once its layer is unloaded. AMXINT8/AMXINT4's staging is the kernel's own
``.kt`` tree of the layer (:class:`_Tree`: written file to file, read by the kernel straight into its buffers, so this
process holds the layer once while it loads), or with a ``capacity`` only the experts each forward picks (the tree
holds the files of the experts picked so far, each written when a group first picks it; the object holds
``capacity`` experts, read from it by the kernel's ``physical_to_logical_map``). BF16's is an anonymous mapping whose addresses the MoE object keeps;
its pages go back to the system (``MADV_DONTNEED``) right after the kernel has copied them (the layer is held twice
while it loads). LLAMAFILE reads the ggml blocks in place at every forward: they stay until ``unload``.

This module imports only the standard library and numpy before kt_kernel, and nothing of ktconvert beyond
:mod:`ktconvert.formats.kt_amx` and :mod:`ktconvert.formats.kt_tree` (their names).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import sys
import traceback

#: methods whose kt-kernel class copies the experts into its own buffers at load (and leaks them when freed)
COPYING = ("AMXINT8", "AMXINT4", "BF16")


def _ptr(a) -> int:
    return int(a.ctypes.data)


def _status() -> dict:
    """This process's VmRSS and VmHWM, bytes."""
    with open("/proc/self/status") as f:
        text = f.read()
    return {k: int(re.search(rf"^{name}:\s+(\d+) kB", text, re.M).group(1)) * 1024
            for k, name in (("rss", "VmRSS"), ("hwm", "VmHWM"))}


def _trim() -> None:
    """Give freed heap memory back to the system (glibc keeps it otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _Layer:
    """A loaded MoE layer and every buffer whose pointer the C++ side holds (kept alive here)."""

    def __init__(self, moe, keep, spec):
        self.moe = moe
        self.keep = keep
        self.spec = spec


class _Staging:
    """Arrays over one anonymous mapping, at addresses that stay while their pages come and go."""

    def __init__(self, np, layout: dict):
        total = sum(_aligned(np.dtype(dt).itemsize * _count(shape)) for shape, dt in layout.values())
        self.buf = mmap.mmap(-1, max(total, 1))
        self.layout = dict(layout)
        self.arrays, at = {}, 0
        for key, (shape, dt) in layout.items():
            n = _count(shape)
            self.arrays[key] = np.frombuffer(self.buf, dtype=dt, count=n, offset=at).reshape(shape)
            at += _aligned(np.dtype(dt).itemsize * n)

    def release(self) -> None:
        """The pages back to the system; the next write faults in zeroed ones at the same addresses."""
        self.buf.madvise(mmap.MADV_DONTNEED)


class _Tree:
    """The staging of an AMXINT8/AMXINT4 slot: kt-kernel's own ``.kt`` tree of one layer, in the parent's scratch
    folder. Its MoE object is built without weight pointers, so ``load_weights`` opens each
    ``_layer_L/_numa_n/{INT8|INT4}_{proj}_{e}_{S}Byte_{quant|scale}_.kt`` and reads it straight into its own buffer
    (``AMX_MOE_TP::load_weights``, its ``config_.load`` branch, kt-kernel ``operators/amx/moe.hpp``). The files are
    written by ``sendfile`` from the kt-amx safetensors, file to file in the OS: no page of the layer passes through
    this process, which holds the layer once (the kernel's copy) instead of twice. ``L`` is the layer the slot's
    object was built for (it keeps that prefix). The next layer of the slot overwrites the same files in place (same
    names, same sizes: creating a few hundred files per layer cost ten times the copy); the parent removes the
    folder when the session closes."""

    def __init__(self, root: str, layer: int, tag: str):
        self.root, self.layer, self.tag = root, layer, tag

    def write(self, sources) -> None:
        """Each kt-amx tensor ``(proj, expert, part, kind) -> (file, offset, bytes)`` as the ``.kt`` file the
        kernel opens for it."""
        from ktconvert.formats.kt_tree import file_name

        by_file: dict[str, list] = {}
        for key, (f, off, nbytes) in sources.items():
            by_file.setdefault(f, []).append((off, nbytes, key))
        for f, items in by_file.items():
            with open(f, "rb") as src:
                for off, nbytes, (proj, x, n, kind) in sorted(items):
                    dest = os.path.join(self.root, f"_layer_{self.layer}", f"_numa_{n}",
                                        file_name(proj, x, nbytes, kind, self.tag))
                    fd = os.open(dest, os.O_WRONLY | os.O_CREAT, 0o600)  # its size is in its name: never shorter
                    try:
                        done = 0
                        while done < nbytes:
                            sent = os.sendfile(fd, src.fileno(), off + done, nbytes - done)
                            if sent == 0:
                                raise ValueError(f"{f} ends inside a tensor of {nbytes} bytes at offset {off} "
                                                 "(truncated)")
                            done += sent
                    finally:
                        os.close(fd)

    def release(self) -> None:
        """Nothing to give back: the files stay for the slot's next layer (the OS caches their pages)."""


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


class _Slot(_Layer):
    """A MoE object of a copying method and its staging, reused layer after layer of one shape (``sig``)."""

    def __init__(self, moe, keep, spec, staging: _Staging, sig):
        super().__init__(moe, keep, spec)
        self.staging = staging
        self.sig = sig
        self.key: str | None = None  # the layer loaded now, None when free
        self.held: tuple | None = None  # a picked slot: the layer's experts its object holds now, by position
        self.sources: dict = {}  # a picked slot: where each kt-amx tensor of its layer is, (proj, expert, part, kind)
        self.written: set[int] = set()  # a picked slot: the experts whose files hold this layer's bytes


class Child:
    def __init__(self, threadpools: int, threads: int):
        import numpy as np

        self.np = np
        self.threadpools = threadpools
        self.threads = threads
        self.layers: dict[str, _Layer] = {}
        self.slots: list[_Slot] = []
        self._indexes: dict[str, dict[str, tuple]] = {}
        self.cpu = None
        import kt_kernel  # selects the variant for this CPU and registers kt_kernel_ext

        self.kt_kernel = kt_kernel
        import kt_kernel_ext

        self.ext = kt_kernel_ext

    def hello(self, req):
        moe = self.ext.moe
        return {"version": getattr(self.kt_kernel, "__version__", None),
                "variant": getattr(self.kt_kernel, "__cpu_variant__", None),
                "int8_kernel": getattr(self.kt_kernel, "__int8_kernel__", None),
                "int8_layout": getattr(self.kt_kernel, "__int8_weight_layout__", None),
                "classes": sorted(n for n in dir(moe) if not n.startswith("_"))}

    def _pool(self):
        if self.cpu is None:
            cfg = self.ext.WorkerPoolConfig()
            p, n = self.threadpools, self.threads
            cfg.subpool_count = p
            cfg.subpool_numa_map = [0] * p  # one NUMA node here; the map only pins memory
            cfg.subpool_thread_count = [n // p + (1 if i < n % p else 0) for i in range(p)]
            self.cpu = self.ext.CPUInfer(cfg)
        return self.cpu

    def load(self, req):
        np = self.np
        moe_mod = self.ext.moe
        method = req["method"]
        e, k, h, i = int(req["E"]), int(req["top_k"]), int(req["H"]), int(req["I"])
        cap = int(req.get("capacity") or e)  # AMXINT8/AMXINT4: the experts the object holds (picked per forward)
        if cap < e and method not in ("AMXINT8", "AMXINT4"):
            raise ValueError(f"{method} loads whole layers only (capacity {cap} of {e} experts asked)")
        mask = np.zeros(cap, dtype=np.bool_)  # every expert on the CPU
        cfg = moe_mod.MOEConfig(cap, k, h, i, _ptr(mask))
        cfg.layer_idx = int(req["layer"])
        cfg.pool = self._pool().backend_
        max_len = int(req.get("max_len", 64))
        cfg.max_len = max_len
        keep = [mask]
        if req.get("sft"):
            return self._load_sft(req, mask)
        if method in COPYING and not req.get("save"):
            return self._load_slot(req, cfg, mask)
        if req.get("release"):
            moe = self._release(cfg, req, keep)
        elif method == "LLAMAFILE":  # read in place at every forward: mapped, only the picked experts' pages come in
            arrays = {p: np.ascontiguousarray(np.load(req["arrays"][p], mmap_mode="r")) for p in ("gate", "up", "down")}
            keep += list(arrays.values())
            cfg.m_block = 32
            cfg.group_min_len = 10
            cfg.group_max_len = max_len
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = (_ptr(arrays[p]) for p in ("gate", "up", "down"))
            types = req["types"]
            gt = self.ext.kvcache.ggml_type
            by_id = {int(getattr(gt, n)): getattr(gt, n) for n in dir(gt) if not n.startswith("_") and n[0].isupper()}
            unknown = sorted({int(types[p]) for p in ("gate", "up", "down")} - set(by_id))
            if unknown:
                raise ValueError(f"kt-kernel's ggml_type enum has no type id {unknown[0]}")
            cfg.gate_type, cfg.up_type, cfg.down_type = (by_id[int(types[p])] for p in ("gate", "up", "down"))
            cfg.hidden_type = gt.BF16
            moe = moe_mod.MOE(cfg)
        elif method in ("AMXINT8", "AMXINT4") and req.get("save"):  # the kernel's own quantizer writes a .kt tree
            arrays = {p: np.ascontiguousarray(np.load(req["arrays"][p])) for p in ("gate", "up", "down")}
            keep += list(arrays.values())
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = (_ptr(arrays[p]) for p in ("gate", "up", "down"))
            cfg.save = True
            cfg.load = False
            for n in range(self.threadpools):  # the C++ writer opens files in these folders, it does not make them
                os.makedirs(os.path.join(req["save"], f"_layer_{cfg.layer_idx}", f"_numa_{n}"), exist_ok=True)
            cfg.path = req["save"]
            moe = getattr(moe_mod, "AMXInt8_MOE" if method == "AMXINT8" else "AMXInt4_MOE")(cfg)
        else:
            raise ValueError(f"method {method} is not driven by this runner")
        ident = np.arange(e, dtype=np.int64)  # the C++ reads it as uint64
        keep.append(ident)
        self._pool().submit(moe.load_weights_task(_ptr(ident)))
        self._pool().sync()
        self.layers[req["key"]] = _Layer(moe, keep, req)
        return {"loaded": req["key"], **_status()}

    def _load_sft(self, req, mask):
        """BF16 experts plus the adapter's fused LoRA through ``AMXBF16_SFT_MOE``, as kt-kernel's SFT wrapper
        (``kt_kernel/sft/amx.py``) configures it for a forward without backward."""
        np = self.np
        moe_mod = self.ext.moe
        cls = getattr(moe_mod, "AMXBF16_SFT_MOE", None)
        if cls is None:
            raise ValueError("AMXBF16_SFT_MOE is not compiled into this kt-kernel variant")
        e, k, h, i = int(req["E"]), int(req["top_k"]), int(req["H"]), int(req["I"])
        arrays = {p: np.ascontiguousarray(np.load(req["arrays"][p])) for p in ("gate", "up", "down")}
        sft = req["sft"]
        lora = {n: np.ascontiguousarray(np.load(f)) for n, f in sft["lora"].items()}
        ident = np.arange(e, dtype=np.int64)
        cfg = moe_mod.MOESFTConfig()
        cfg.expert_num, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size = e, k, h, i
        cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout = int(sft["rank"]), float(sft["alpha"]), 0.0
        cfg.max_cache_depth = 1
        cfg.max_len = int(req.get("max_len", 64))
        cfg.layer_idx = int(req["layer"])
        cfg.physical_to_logical_map = _ptr(ident)
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = (_ptr(arrays[p]) for p in ("gate", "up", "down"))
        for p in ("gate", "up", "down"):
            for ab in ("a", "b"):
                setattr(cfg, f"{p}_lora_{ab}", _ptr(lora[f"{p}_{ab}"]))
        cfg.pool = self._pool().backend_
        moe = cls(cfg)
        self._pool().submit(moe.load_weights_task())
        self._pool().sync()
        self.layers[req["key"]] = _Layer(moe, [mask, ident, arrays, lora], req)
        return {"loaded": req["key"], "class": "AMXBF16_SFT_MOE"}

    def _release(self, cfg, req, keep):
        """A release read as released: kt-kernel's own loader for the method, its scale conversions, quant config
        and backend choice (``KT_*_BACKEND``), as its NativeMoEWrapper sets them up."""
        import torch
        from kt_kernel.utils import amx as kta

        method = req["method"]
        w = kta.NativeMoEWrapper._create_loader(method, req["release"]).load_experts(req["base"])
        f32 = method in ("FP8", "FP8_PERCHANNEL", "GPTQ_INT4")
        scales = {p: [(t.to(torch.float32) if f32 else t).contiguous() for t in w[p + "_scale"]]
                  for p in ("gate", "up", "down")}
        weights = {p: [t.contiguous() for t in w[p]] for p in ("gate", "up", "down")}
        keep += [weights, scales]
        for p in ("gate", "up", "down"):
            setattr(cfg, f"{p}_projs", [[t.data_ptr() for t in weights[p]]])
            setattr(cfg, f"{p}_scales", [[t.data_ptr() for t in scales[p]]])
        q = cfg.quant_config
        q.zero_point = False
        h = int(req["H"])
        moe = self.ext.moe
        if method == "FP8_PERCHANNEL":
            q.bits, q.per_channel = 8, True
            return moe.AMXFP8PerChannel_MOE(cfg)
        if method == "FP8":  # 128x128 blocks are the only ones its kernels take (the runner refuses others first)
            q.bits, q.group_size = 8, 128
            cls = getattr(moe, "AMXFP8_MOE", None) or getattr(moe, "AVX2FP8_MOE", None)
            if cls is None:
                raise RuntimeError("kt-kernel selects no FP8 backend on this CPU")
            return cls(cfg)
        if method == "GPTQ_INT4":
            q.bits, q.group_size = 4, h // scales["gate"][0].shape[0]
            cls = kta._select_gptq_int4_backend(q.group_size)
        else:
            q.group_size = h // scales["gate"][0].shape[1]
            q.bits = 8 if method == "MXFP8" else 4
            cls = {"RAWINT4": lambda: kta._select_rawint4_backend(q.group_size), "MXFP4": kta._select_mxfp4_backend,
                   "NVFP4": kta._select_mxfp4_backend, "MXFP8": kta._select_mxfp8_backend}[method]()
        if cls is None:
            raise RuntimeError(f"kt-kernel selects no {method} backend on this CPU")
        return cls(cfg)

    def _load_slot(self, req, cfg, mask):
        """AMXINT8/AMXINT4 (a kt-amx directory, read here by name) or BF16 (bf16 bits in npy files) through a slot
        of this shape: a free one when there is one, else a new MoE object over a new staging area."""
        np = self.np
        method = req["method"]
        e, layer = int(req["E"]), int(req["layer"])
        if method == "BF16":
            sources = {p: np.load(req["arrays"][p], mmap_mode="r") for p in ("gate", "up", "down")}
            layout = {p: (tuple(a.shape), "<u2") for p, a in sources.items()}
        else:
            parts = int(req["parts"])
            sources = self._ktamx_layer(req["dir"], layer, e, parts)
            layout = {key: ((nbytes,), "u1") for key, (_f, _off, nbytes) in sources.items()}
        cap = int(cfg.expert_num)
        sig = (method, e, cap, int(req["top_k"]), int(req["H"]), int(req["I"]), cfg.max_len, int(req.get("parts", 1)),
               tuple(layout.items()))
        slot = next((s for s in self.slots if s.key is None and s.sig == sig), None)
        if slot is None:
            if method == "BF16":
                staging = _Staging(np, layout)
                arrays = staging.arrays
                ptrs = {p: [[_ptr(a) + x * a.strides[0] for x in range(e)]] for p, a in arrays.items()}
                cfg.gate_projs, cfg.up_projs, cfg.down_projs = ptrs["gate"], ptrs["up"], ptrs["down"]
                zeros = [[0] * e]
                cfg.gate_scales, cfg.up_scales, cfg.down_scales = zeros, zeros, zeros
                moe = (getattr(self.ext.moe, "AMXBF16_MOE", None) or getattr(self.ext.moe, "AVX2BF16_MOE"))(cfg)
            else:  # no gate_projs: the kernel reads its .kt files itself, straight into its buffers
                tree = os.path.join(req["scratch"], f"slot{len(self.slots)}")
                for n in range(int(req["parts"])):  # its constructor refuses a prefix that does not exist
                    os.makedirs(os.path.join(tree, f"_layer_{layer}", f"_numa_{n}"), exist_ok=True)
                cfg.load = True
                cfg.path = tree
                moe = getattr(self.ext.moe, "AMXInt8_MOE" if method == "AMXINT8" else "AMXInt4_MOE")(cfg)
                staging = _Tree(tree, layer, "INT8" if method == "AMXINT8" else "INT4")
            slot = _Slot(moe, [mask, np.arange(cap, dtype=np.int64)], req, staging, sig)  # the C++ reads uint64 ids
            self.slots.append(slot)
        slot.held = None  # nothing of this layer in the object yet
        slot.sources, slot.written = ({}, set()) if cap == e else (sources, set())
        try:
            if method == "BF16":
                for p, a in sources.items():
                    slot.staging.arrays[p][...] = a
            elif cap == e:
                slot.staging.write(sources)
            # else a picked slot: each expert's files are written when a group first picks it (_forward_picked);
            # a DeepSeek-V3-shaped layer is 5.6 GB of AMXINT4, and a prompt's tokens pick a fraction of its experts
            if cap == e:  # the whole layer, now; a picked slot loads the experts each forward picks
                self._pool().submit(slot.moe.load_weights_task(_ptr(slot.keep[1])))
                self._pool().sync()
        finally:
            slot.staging.release()  # copied by the kernel (or failed): the staging's pages are not needed
        slot.key, slot.spec = req["key"], req
        self.layers[req["key"]] = slot
        return {"loaded": req["key"], **_status()}

    def _ktamx_layer(self, directory, layer, e, parts):
        """``{(proj, expert, part, kind): (file, offset, bytes)}`` of one layer of a kt-amx directory, from the
        safetensors headers (indexed once per directory; no tensor data is read here)."""
        from pathlib import Path

        from ktconvert.formats.kt_amx import tensor_name

        index = self._indexes.get(directory)
        if index is None:  # name -> where, once per directory (real conversions have a shard per layer)
            index = self._indexes[directory] = {}
            for f in sorted(Path(directory).rglob("*.safetensors")):
                with open(f, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    head = json.loads(fh.read(n))
                for name, info in head.items():
                    if name != "__metadata__":
                        start, end = info["data_offsets"]
                        index[name] = (str(f), 8 + n + start, end - start)
        want = {(p, x, n, kind): tensor_name(layer, p, x, n, kind)
                for p in ("gate", "up", "down") for x in range(e) for n in range(parts) for kind in ("weight", "scale")}
        missing = [name for name in want.values() if name not in index]
        if missing:
            raise KeyError(f"{len(missing)} kt-amx tensor(s) missing, first {missing[0]}")
        return {key: index[name] for key, name in want.items()}

    def unload(self, req):
        """The layer ``key`` is done: a slot becomes free for the next layer of its shape, anything else is freed."""
        import gc

        layer = self.layers.pop(req["key"], None)
        if isinstance(layer, _Slot):
            layer.key = None
        del layer
        gc.collect()
        _trim()
        return _status()

    def memory(self, req):
        return _status()

    def forward(self, req):
        np = self.np
        layer = self.layers[req["key"]]
        hidden = np.ascontiguousarray(np.load(req["hidden"]), dtype=np.uint16)
        ids = np.ascontiguousarray(np.load(req["ids"]), dtype=np.int64)
        w = np.ascontiguousarray(np.load(req["weights"]), dtype=np.float32)
        if isinstance(layer, _Slot) and layer.sig[2] < layer.sig[1]:
            out, loads = self._forward_picked(layer, hidden, ids, w)
            np.save(req["out"], out)
            return {"tokens": int(ids.shape[0]), "loads": loads}
        out = self._run(layer, hidden, ids, w)
        np.save(req["out"], out)
        return {"tokens": int(ids.shape[0])}

    def _run(self, layer, hidden, ids, w):
        """One kernel forward of these tokens (bf16 bits in and out)."""
        np = self.np
        t, k = ids.shape
        out = np.zeros_like(hidden)
        bsz = np.array([t], dtype=np.int32)
        fwd = layer.moe.forward_sft_task if layer.spec.get("sft") else layer.moe.forward_task
        task = fwd(_ptr(bsz), k, _ptr(ids), _ptr(w), _ptr(hidden), _ptr(out), False)  # no incremental / no backward
        self._pool().submit(task)
        self._pool().sync()
        return out

    def _forward_picked(self, slot, hidden, ids, w):
        """A picked slot holds ``C`` of the layer's ``E`` experts: the call's tokens go in groups whose picks fit
        ``C`` (in token order; a token's ``K`` experts always in one group, so the kernel sums them in one go), and
        each group's experts are read from the layer's ``.kt`` files into positions ``0..n-1`` (the
        ``physical_to_logical_map`` of the ``config_.load`` branch names the file of each position; the other
        positions keep experts the object held before, else repeat the group's first one, as every position is read)
        before its forward runs on ids renumbered to those positions; a group whose picks the object holds already
        reads nothing. Returns the output and how many loads it took."""
        np = self.np
        cap = slot.sig[2]
        out = np.zeros_like(hidden)
        loads, start = 0, 0
        t = ids.shape[0]
        while start < t:
            picked: dict[int, None] = {}
            end = start
            while end < t:
                more = [int(x) for x in ids[end] if int(x) not in picked]
                if len(picked) + len(set(more)) > cap:
                    break
                picked.update(dict.fromkeys(more))
                end += 1
            if end == start:
                raise ValueError(f"token {start} picks {len(set(ids[start].tolist()))} experts, more than the "
                                 f"slot's capacity {cap}")
            held = slot.held
            if held is None or not set(picked) <= set(held):  # else the object holds them already: no read
                keep = [x for x in dict.fromkeys(held or ()) if x not in picked]  # the next group may want them
                held = sorted(picked) + keep[:cap - len(picked)]
                held += [held[0]] * (cap - len(held))
                slot.held = None  # a failed load leaves the object holding nothing known
                fresh = set(held) - slot.written
                if fresh:  # this layer's files of the experts not picked before (the rest hold another layer's)
                    slot.staging.write({k: v for k, v in slot.sources.items() if k[1] in fresh})
                    slot.written |= fresh
                slot.keep[1][...] = np.asarray(held, dtype=np.int64)
                self._pool().submit(slot.moe.load_weights_task(_ptr(slot.keep[1])))
                self._pool().sync()
                slot.held = held = tuple(held)
                loads += 1
            position = {x: held.index(x) for x in picked}
            local = np.ascontiguousarray(np.vectorize(position.__getitem__, otypes=[np.int64])(ids[start:end]))
            out[start:end] = self._run(slot, np.ascontiguousarray(hidden[start:end]), local,
                                       np.ascontiguousarray(w[start:end]))
            start = end
        return out, loads


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    threadpools, threads = int(argv[0]), int(argv[1])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the kernel's own prints go to stderr, never into the protocol
    sys.stdout = sys.stderr

    def answer(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        child = Child(threadpools, threads)
    except Exception as exc:  # kt-kernel missing or unloadable: say so, then exit
        answer({"ok": False, "error": f"{type(exc).__name__}: {exc}", "fatal": True})
        return 3
    answer({"ok": True, "ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        if op == "quit":
            answer({"ok": True})
            return 0
        try:
            result = getattr(child, op)(req)
            answer({"ok": True, **result})
        except Exception as exc:
            traceback.print_exc()
            answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
