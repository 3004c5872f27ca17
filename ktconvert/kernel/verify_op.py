"""``verify --kernel kt-kernel|both``: the CPU experts operator computed by the real kt-kernel.

:class:`KernelRuntime` belongs to one verify run: it picks the method that reads the weights (LLAMAFILE for a
GGUF, BF16 for HF bf16 experts, AMXINT8/AMXINT4 for a kt-amx directory given as ``kt_weights``), starts one
child per method, loads each layer once and feeds batches over the pipe. With ``both`` every forward also
runs the emulation, and the runtime keeps emulation-vs-kernel agreement per layer and phase
(‖kernel − emulation‖ / ‖emulation‖ over the whole phase); the kernel's output is what flows on.

A layer goes into the child when its operator first runs, and leaves it when the operator is released
(:meth:`KernelExperts.release`: a streamed verify, ``--max-memory``, releases each layer's operators when the
layer's part ends); :meth:`KernelExperts.resident_bytes` is what the child holds for it at most, which the streamed
run's budget counts.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ktconvert.formats.kt_amx_dir import scan_ktamx_dir
from ktconvert.kernel.runner import (
    KernelRefused,
    KernelSession,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
)

from ktconvert.kernel.methods import FP8_BLOCK, LOADER_NAMES, METHODS, RELEASE_METHOD

MODES = ("emulate", "kt-kernel", "both")


class KernelRuntime:
    #: a streamed run loads an AMXINT8/AMXINT4 layer of at most this many bytes whole, a larger one as the experts
    #: each forward picks (:meth:`capacity`)
    WHOLE_LAYER_BYTES = 2**30

    def __init__(self, mode: str, *, kt_weights=None, threads: int = 1, streamed: bool = False):
        if mode not in MODES[1:]:
            raise KernelRefused(f"unknown kernel mode {mode!r}", fix="use emulate, kt-kernel or both")
        self.mode = mode
        self.threads = threads
        self.kt_weights = kt_weights
        self._ktamx = None
        if kt_weights is not None:

            self._ktamx = scan_ktamx_dir(kt_weights)
        self.sessions: dict[tuple[str, int], KernelSession] = {}
        self._started: dict[tuple[str, int], int] = {}  # each child's RSS when it started (held_now)
        self.rows: dict[str, dict] = {}  # module path @ source -> its row (a streamed run wraps a layer once per part)
        self.streamed = streamed  # verify --max-memory: layers are loaded and freed part by part
        self.lora = None  # verify --lora: the loaded adapter (convert.lora_merge.LoadedLora), run by the SFT class

    @property
    def reads_own_files(self) -> bool:
        """The kernel reads its experts from ``kt_weights`` and nothing runs the emulation beside it: the candidate's
        stored experts are never decoded, so they need not be read (``WeightSource.expert_shapes``)."""
        return self._ktamx is not None and self.mode == "kt-kernel"

    def auto_profile(self, cfg) -> str | None:
        """``--tolerance auto`` for a kt-amx ``kt_weights`` run: the profile measured for its method (the
        experts of ``--weights`` do not say what the kernel reads)."""
        if self._ktamx is None:
            return None
        bits = self._ktamx.bits(cfg.hidden_size, cfg.mlp.moe_intermediate_size)
        return {8: "kt-amxint8", 4: "kt-amxint4"}.get(bits)

    def _session(self, method: str, parts: int) -> KernelSession:
        key = (method, parts)
        if key not in self.sessions:
            s = self.sessions[key] = KernelSession(method, threadpools=parts, threads=max(self.threads, parts))
            self._started[key] = s.memory()["rss"]  # the child before any layer: interpreter, torch, kt_kernel
        return self.sessions[key]

    def held_now(self) -> int:
        """Bytes the kernel children hold now beyond what they held before their first layer, measured (their RSS):
        the slots kt-kernel keeps between layers and the working buffers it sizes by the layer's shape, which the
        plan's count of the packed experts (:meth:`kept_between_layers`) does not see (measured 39 MiB beside a
        576 MiB Qwen3-30B-A3B AMXINT8 layer)."""
        return sum(max(0, s.memory()["rss"] - self._started.get(key, 0)) for key, s in self.sessions.items())

    def choose(self, source, blocks, cfg) -> tuple[str, int]:
        """The method (and threadpool count) for this layer's weights, or a refusal saying what would fit."""
        if self._ktamx is not None:
            d = self._ktamx
            la = d.layers.get(blocks.layer)
            if la is None:
                raise KernelRefused(f"the kt-amx directory has no layer {blocks.layer}", fix="pass the whole conversion")
            bits = d.bits(cfg.hidden_size, cfg.mlp.moe_intermediate_size)
            if bits is None:
                raise KernelRefused("kt-amx tensor sizes fit neither INT8 nor INT4 for this config's H and I",
                                    fix="pass the kt-amx directory written from this --model")
            parts = la.parts
            missing = d.missing(blocks.layer, cfg.num_experts, parts)
            if missing:
                raise KernelRefused(f"the kt-amx directory lacks {len(missing)} tensor(s) of layer {blocks.layer}, "
                                    f"first {missing[0]}", fix="the conversion is incomplete: write it again")
            return ("AMXINT8" if bits == 8 else "AMXINT4"), parts
        if source.container == "gguf":
            return "LLAMAFILE", 1
        fmts = getattr(source, "release_formats", ())
        if source.container == "safetensors" and fmts:  # a release: the method that reads it as released
            method = RELEASE_METHOD.get(fmts[0]) if len(fmts) == 1 else None
            if method is None:
                raise KernelRefused(f"kt-kernel has no method for {'/'.join(fmts)} experts as released",
                                    fix="convert the release (ktconvert quantize) and verify that, or --kernel emulate")
            blocks_fp8 = getattr(source, "fp8_blocks", ())
            if method == "FP8" and blocks_fp8 != ((FP8_BLOCK, FP8_BLOCK),):
                raise KernelRefused(f"kt-kernel's FP8 method reads {FP8_BLOCK}x{FP8_BLOCK} blocks; this release's "
                                    f"experts have {', '.join(f'{a}x{b}' for a, b in blocks_fp8)}",
                                    fix="convert the release (ktconvert quantize) and verify that, or --kernel emulate")
            want = LOADER_NAMES.get(method)
            if want and not any(want[0] in n for n in source.expert_names):
                raise KernelRefused(f"kt-kernel's {method} loader finds experts only under {want[1]}; this release "
                                    "names them otherwise", fix="verify the release as published, or --kernel emulate")
            return method, 1
        types = set(blocks.types().values())
        if source.container == "safetensors" and types == {"BF16"}:
            return "BF16", 1
        if source.container == "safetensors":
            raise KernelRefused(f"kt-kernel has no method for {'/'.join(sorted(types))} HF experts (layer "
                                f"{blocks.layer}); BF16 reads bf16 releases",
                                fix="verify a GGUF (LLAMAFILE), bf16 safetensors (BF16) or pass --kt-weights KT_AMX_DIR")
        raise KernelRefused("kt-kernel does not read ktconvert's kernel-order safetensors (LLAMAFILE reads .gguf)",
                            fix="convert with ktconvert quantize --to gguf, or verify with --kernel emulate")

    def wrap(self, emulation: nn.Module, source, blocks, cfg, path: str) -> "KernelExperts":
        method, parts = self.choose(source, blocks, cfg)
        if self.lora is not None and method != "BF16":
            raise KernelRefused(
                f"--lora with --kernel: kt-kernel 0.7.2 applies a MoE LoRA only in its SFT classes, and ktconvert "
                f"drives the one for BF16 experts (AMXBF16_SFT_MOE); {method} weights (layer {blocks.layer}) have no "
                "SFT path here (AMXINT8/INT4_SFT read kt-kernel's own .kt trees, a GGUF none at all)",
                fix="verify HF bf16 experts (quantize --to hf --type BF16) with --lora, or --kernel emulate")
        if self.streamed and (METHODS[method].release or self.lora is not None):
            what = f"{method} releases" if METHODS[method].release else "--lora (its SFT class)"
            raise KernelRefused(f"--kernel kt-kernel/both does not stream {what} yet: kt-kernel frees no layer it "
                                f"loaded that way (layer {blocks.layer}), so the child would keep every layer",
                                fix="verify with --kernel emulate under --max-memory, or on a machine it fits")
        s = self._session(method, parts)
        key = f"{path}@{id(source)}"
        top_k = cfg.num_experts_per_tok
        lora = None
        if method == "BF16":
            lora = _fused_lora_bits(self.lora, blocks.layer) if self.lora is not None else None
            if lora is not None and "AMXBF16_SFT_MOE" not in s.info.classes:
                raise KernelRefused(f"kt-kernel's {s.info.variant} variant has no AMXBF16_SFT_MOE (its LoRA path)",
                                    fix="verify --lora with --kernel emulate")
            s._check(hidden=cfg.hidden_size, inter=cfg.mlp.moe_intermediate_size, types=None, where=f"layer {blocks.layer}")
        elif method == "LLAMAFILE":
            e, i, h = blocks.gate.shape
            s._check(hidden=h, inter=i, types=blocks.types(), where=f"layer {blocks.layer}")
        else:
            s._check(hidden=cfg.hidden_size, inter=cfg.mlp.moe_intermediate_size, types=None, where=f"layer {blocks.layer}")

        capacity = self.capacity(method, cfg, blocks.layer)

        def load() -> None:  # when the layer first runs: a streamed run loads it part by part
            if method == "LLAMAFILE":
                s.load_gguf_layer(key, blocks, top_k)
            elif method == "BF16":
                bits = {p: getattr(blocks, p).data.view(np.uint16).reshape(getattr(blocks, p).shape)
                        for p in ("gate", "up", "down")}
                sft = {"lora": lora, "rank": self.lora.adapter.rank, "alpha": float(self.lora.alpha)} if lora else {}
                s.load_bf16_layer(key, blocks.layer, bits["gate"], bits["up"], bits["down"], top_k, **sft)
            elif METHODS[method].release:
                s.load_release_layer(key, source.path, blocks.layer, experts=cfg.num_experts, top_k=top_k,
                                     hidden=cfg.hidden_size, inter=cfg.mlp.moe_intermediate_size)
            else:
                s.load_ktamx_layer(key, self.kt_weights, blocks.layer, experts=cfg.num_experts, top_k=top_k,
                                   hidden=cfg.hidden_size, inter=cfg.mlp.moe_intermediate_size,
                                   capacity=capacity)

        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = {
                "module": path, "layer": blocks.layer, "kernel": "kt-kernel", "version": s.info.version,
                "method": "AMXBF16_SFT" if lora is not None else method, "variant": s.info.variant,
                "threadpools": parts, "weights": "kt-amx " + str(self.kt_weights) if self._ktamx is not None
                else source.path, "agreement": {} if self.mode == "both" else None}
        return KernelExperts(self, s, key, emulation, row, load, self._child_bytes(method, blocks, lora, capacity))

    def capacity(self, method: str, cfg, layer: int) -> int | None:
        """How many experts the child's object holds for an AMXINT8/AMXINT4 layer: None, the whole layer loaded once,
        unless the run is streamed and the layer is over :attr:`WHOLE_LAYER_BYTES`; then ``2 * top_k`` (one token's
        picks and as many again), each forward reading only the experts its tokens pick. Neither depends on the
        budget, so the minimum a refusal names is a budget that runs (a switch to the whole layer at a larger budget
        would raise the need past it)."""
        if not self.streamed or method not in ("AMXINT8", "AMXINT4"):
            return None
        if self._layer_bytes(layer) <= self.WHOLE_LAYER_BYTES:
            return None
        cap = 2 * int(cfg.num_experts_per_tok)
        return cap if cap < int(cfg.num_experts) else None

    def kept_between_layers(self, cfg) -> int:
        """What the child keeps between the candidate's layers: kt-kernel never frees an AMX class's buffers, so the
        slot a kt-amx layer was loaded into stays allocated after its part ends (the largest such layer, or its
        picked-experts capacity). 0 without ``kt_weights`` (LLAMAFILE maps its blocks and frees them)."""
        if self._ktamx is None:
            return 0
        method = "AMXINT8" if self._ktamx.bits(cfg.hidden_size, cfg.mlp.moe_intermediate_size) == 8 else "AMXINT4"
        return max((self._held_bytes(layer, self.capacity(method, cfg, layer)) for layer in self._ktamx.layers),
                   default=0)

    def _layer_bytes(self, layer: int) -> int:
        return sum(n for _dtype, n, _f in self._ktamx.layers[layer].tensors.values())

    def _held_bytes(self, layer: int, capacity: int | None) -> int:
        """What the child's object holds of a kt-amx layer: all of it, or ``capacity`` of its experts."""
        size = self._layer_bytes(layer)
        return size if capacity is None else size // self._ktamx.layers[layer].experts * capacity

    def _child_bytes(self, method: str, blocks, lora, capacity: int | None = None) -> int:
        """The most the child holds for one layer: LLAMAFILE maps the ggml blocks and reads them in place;
        AMXINT8/AMXINT4 hold the layer once (kt-kernel reads the layer's ``.kt`` files, written file to file from
        the kt-amx directory, straight into its buffers), or ``capacity`` of its experts when it holds picked ones;
        BF16 holds it twice while it loads (read into the staging, and kt-kernel's own copy), then once."""
        if method in ("AMXINT8", "AMXINT4"):
            return self._held_bytes(blocks.layer, capacity)
        stored = sum(getattr(blocks, p).data.nbytes for p in ("gate", "up", "down"))
        if lora is not None:
            stored += sum(a.nbytes for a in lora.values())
        return stored if method == "LLAMAFILE" else 2 * stored

    def summary(self) -> dict:
        layers = []
        for r in self.rows.values():
            out = {k: v for k, v in r.items() if not k.startswith("_")}
            if r["agreement"] is not None:
                out["agreement"] = {ph: (float(np.sqrt(d / n)) if n > 0 else 0.0)
                                    for ph, (d, n) in sorted(r["agreement"].items())}
            layers.append(out)
        peak = max((s.memory()["hwm"] for s in self.sessions.values()), default=None)
        return {"mode": self.mode, "layers": layers, "child_peak_rss": peak}

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()
        self._started.clear()


def _fused_lora_bits(loaded, layer: int) -> dict[str, np.ndarray] | None:
    """The adapter's expert LoRA of ``layer`` as kt-kernel's fused bf16 tensors (``{proj}_{a|b}`` ``[E, ., .]``),
    whatever form it was read from (F32 is rounded to BF16, as sglang-kt does), or None if it does not adapt it."""
    slots = loaded.adapter.slots
    if (layer, "gate", "a") not in slots:
        return None
    return {f"{p}_{ab}": f32_to_bf16_bits(np.stack([x.float32() for x in slots[(layer, p, ab)]]))
            for p in ("gate", "up", "down") for ab in ("a", "b")}


class KernelExperts(nn.Module):
    """``forward(hidden [N, H], topk_ids [N, K], topk_weights [N, K])`` computed by kt-kernel."""

    emulation = "kt-kernel"

    def __init__(self, runtime: KernelRuntime, session: KernelSession, key: str, emulation: nn.Module, row: dict,
                 load, child_bytes: int):
        super().__init__()
        self.runtime, self.session, self.key, self.row = runtime, session, key, row
        self.emulated_op = emulation  # kept for ``both`` and for describe()
        self._load, self.loaded, self.child_bytes = load, False, child_bytes

    def resident_bytes(self) -> int:
        """The most the kernel child holds for this layer, and what this process keeps for it: the stored experts
        where they are in memory, and with ``both`` the emulation's decoded expert too."""
        op = self.emulated_op
        return self.child_bytes + (op.resident_bytes() if self.runtime.mode == "both" else op.stored_bytes())

    def release(self) -> None:
        """Free the layer in the child (a streamed run is done with it); the next forward loads it again."""
        if self.loaded:
            self.loaded = False
            self.session.unload(self.key)

    def describe(self) -> str:
        r = self.row
        both = "; emulation also run for agreement" if self.runtime.mode == "both" else ""
        return (f"kt-kernel {r['version']} {r['method']} ({r['variant']} variant, {r['threadpools']} threadpool(s)); "
                f"emulation would be: {self.emulated_op.describe()}{both}")

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if not self.loaded:
            self._load()
            self.loaded = True
        x = hidden.detach().to(torch.float32).reshape(-1, hidden.shape[-1]).numpy()
        ids = topk_ids.detach().to(torch.int64).numpy()
        w = topk_weights.detach().to(torch.float32).numpy()
        out = bf16_bits_to_f32(self.session.forward(self.key, f32_to_bf16_bits(x), ids, w))
        result = torch.from_numpy(out.copy()).reshape(hidden.shape)
        if self.runtime.mode == "both":
            emu = self.emulated_op(hidden, topk_ids, topk_weights).to(torch.float32)
            phase = "decode" if ids.shape[0] == 1 else "prefill"
            d, n = self.row["agreement"].get(phase, (0.0, 0.0))
            diff = (result - emu).double()
            self.row["agreement"][phase] = (d + float((diff * diff).sum()), n + float((emu.double() ** 2).sum()))
        return result.to(hidden.dtype)
