"""Drive kt-kernel in a child process: one method per child, layers loaded once, batches fed over a pipe.

The calling process never imports kt_kernel (it flushes subnormals process-wide and some of its failures
abort); :class:`KernelSession` starts ``python -m ktconvert.kernel.child``, refuses before loading what the
kernel cannot run (:mod:`ktconvert.kernel.methods`), and turns a child killed by a signal into one
:class:`KernelCrashed` naming the signal and what it was doing.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ktconvert.errors import EnvironmentProblem, KtError, UsageProblem
from ktconvert.kernel.methods import METHODS, runs_here, shape_problems, type_problems
from ktconvert.quant import as_qtype
from ktconvert.quant._legacy import bf16_bits


class KernelUnavailable(EnvironmentProblem):
    """kt-kernel cannot be imported in a child process here (exit 3)."""


class KernelRefused(UsageProblem):
    """A method that cannot run these weights or this shape on this machine, refused before loading (exit 2)."""


class KernelCrashed(KtError):
    """The kernel child died (a signal or an exit) or failed a request (exit 3)."""


@dataclass(frozen=True)
class KernelInfo:
    version: str | None
    variant: str | None
    int8_kernel: str | None
    classes: tuple[str, ...]

    def methods(self) -> list[str]:
        return [m for m in METHODS if runs_here(m, self.classes)]

    def as_dict(self) -> dict:
        return {"version": self.version, "variant": self.variant, "int8_kernel": self.int8_kernel,
                "methods": self.methods()}


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even, as torch's ``.to(bfloat16)``."""

    x = np.ascontiguousarray(x, dtype=np.float32)
    out = bf16_bits(x).astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0  # bf16_bits is for finite input; a broken model's NaN stays NaN
    return out


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


class KernelSession:
    """One kt-kernel child for one method. ``load_*`` a layer once, then :meth:`forward` batches through it.

    ``threadpools``: subpools of the kernel's worker pool (= numa parts a kt-amx directory was written for);
    ``threads``: worker threads in all.
    """

    def __init__(self, method: str | None, *, threadpools: int = 1, threads: int = 1, env: dict | None = None,
                 timeout: float = 600.0):
        """``method=None`` starts a child that only answers what kt-kernel is (``info``); ``timeout``: seconds
        one request may take before the child is killed and reported."""
        self.timeout = timeout
        if method is not None and method not in METHODS:
            raise KernelRefused(f"unknown kt-kernel method {method!r}", fix=f"use one of {', '.join(METHODS)}")
        if method is not None and not (METHODS[method].driven or METHODS[method].release):
            raise KernelRefused(f"{method} is not driven by ktconvert's kernel runner yet",
                                fix="use LLAMAFILE (GGUF), BF16 (HF bf16) or AMXINT8/AMXINT4 (kt-amx)")
        self.method = method
        self.threadpools = threadpools
        self.threads = max(threads, threadpools)
        self._dir = Path(tempfile.mkdtemp(prefix="ktconvert-kernel-"))
        self._err = open(self._dir / "stderr.log", "w+b")
        full_env = dict(os.environ, **(env or {}))
        full_env.setdefault("OMP_NUM_THREADS", "1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "ktconvert.kernel.child", str(threadpools), str(self.threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=full_env, text=True)
        self._n = 0
        self.loaded: dict[str, dict] = {}
        self.expert_loads = 0  # picked experts read into the child's object at forwards (a capacity below E)
        try:
            self._start(method)
        except BaseException:
            self.close()  # no stray child, temp dir or open log, whatever the reason
            raise

    def _start(self, method: str | None) -> None:
        first = self._read("starting kt-kernel")
        if not first.get("ok"):
            raise KernelUnavailable(f"kt-kernel cannot be loaded in a child process: {first.get('error')}",
                                    fix="pip install --no-deps kt-kernel==0.7.2 (see docs/kt-kernel.md)")
        hello = self._call({"op": "hello"}, "asking kt-kernel what it is")
        self.info = KernelInfo(hello.get("version"), hello.get("variant"), hello.get("int8_kernel"),
                               tuple(hello.get("classes", ())))
        if method is not None and not runs_here(method, self.info.classes):
            variant = self.info.variant
            raise KernelRefused(f"{method} has no kernel in kt-kernel's {variant} variant on this CPU",
                                fix="run on a CPU whose variant has it (ktconvert doctor lists the methods that run)")

    # --- protocol ---------------------------------------------------------------------------------------------
    def _stderr_tail(self) -> str:
        try:
            self._err.flush()
            self._err.seek(0)
            lines = self._err.read().decode(errors="replace").strip().splitlines()
            return lines[-1] if lines else ""
        except (OSError, ValueError):
            return ""

    def _read(self, doing: str) -> dict:

        ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout)
        if not ready:  # a hung kernel: kill it rather than wait forever
            self._proc.kill()
            self._proc.wait()
            raise KernelCrashed(f"the kt-kernel child ({self.method}) gave no answer within {self.timeout:.0f} s while "
                                f"{doing}; it was killed", fix="rerun with fewer tokens or threads, or report it")
        line = self._proc.stdout.readline()
        if line:
            return json.loads(line)
        rc = self._proc.wait(timeout=30)
        tail = self._stderr_tail()
        how = f"was killed by {_signal_name(rc)}" if rc < 0 else f"exited with status {rc}"
        raise KernelCrashed(f"the kt-kernel child ({self.method}) {how} while {doing}"
                            + (f"; its last words: {tail[-200:]}" if tail else ""),
                            fix="a kernel abort means inputs it cannot run; report the command with ktconvert doctor -o json")

    def _call(self, req: dict, doing: str) -> dict:
        if self._proc.poll() is not None:
            return self._read(doing)
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass
        ans = self._read(doing)
        if not ans.get("ok"):
            raise KernelCrashed(f"kt-kernel ({self.method}) failed while {doing}: {ans.get('error')}")
        return ans

    def _save(self, arr: np.ndarray) -> str:
        self._n += 1
        path = self._dir / f"a{self._n}.npy"
        np.save(path, arr)
        return str(path)

    # --- layers -----------------------------------------------------------------------------------------------
    def _check(self, *, hidden: int, inter: int, types: dict[str, str] | None, where: str) -> None:
        problems = shape_problems(self.method, hidden=hidden, inter=inter, parts=self.threadpools)
        problems += type_problems(self.method, types or {}, {"gate": hidden, "up": hidden, "down": inter})
        if problems:
            raise KernelRefused(f"{self.method} cannot run {where}: {problems[0].message}", fix=problems[0].fix)

    def load_gguf_layer(self, key: str, blocks, top_k: int, *, max_len: int = 64, check_types: bool = True) -> None:
        """LLAMAFILE on one layer's merged ggml blocks (:class:`ktconvert.model.ops.source.ExpertBlocks`).
        ``check_types=False`` loads types the measured table does not list as running: only the measurement of that
        table (:mod:`ktconvert.kernel.llamafile_measure`) does, in a child of its own per type."""

        gate = blocks.gate
        e, i, h = gate.shape
        types = blocks.types()
        self._check(hidden=h, inter=i, types=types if check_types else None, where=f"layer {blocks.layer}")
        req = {"op": "load", "key": key, "method": self.method, "E": e, "top_k": top_k, "H": h, "I": i,
               "layer": blocks.layer, "max_len": max_len,
               "arrays": {p: self._save(np.ascontiguousarray(getattr(blocks, p).data)) for p in ("gate", "up", "down")},
               "types": {p: int(as_qtype(t).value) for p, t in types.items()}}
        self._call(req, f"loading layer {blocks.layer} ({'/'.join(types.values())})")
        self.loaded[key] = {"layer": blocks.layer, "H": h, "E": e, "types": types, "max_len": max_len}

    def load_bf16_layer(self, key: str, layer: int, gate: np.ndarray, up: np.ndarray, down: np.ndarray, top_k: int,
                        *, max_len: int = 64, lora: dict[str, np.ndarray] | None = None, rank: int = 0,
                        alpha: float = 0.0) -> None:
        """BF16 on HF experts given as bf16 bits (uint16): gate/up ``[E, I, H]``, down ``[E, H, I]``. With ``lora``
        (verify --lora) the experts run in kt-kernel's SFT class ``AMXBF16_SFT_MOE`` with the adapter: bf16 bits in
        the fused form, ``{gate,up}_a [E, r, H]``, ``{gate,up}_b [E, I, r]``, ``down_a [E, r, I]``, ``down_b [E, H,
        r]``; the kernel scales by ``alpha / rank``."""
        if lora is not None and "AMXBF16_SFT_MOE" not in self.info.classes:
            raise KernelRefused(f"kt-kernel's {self.info.variant} variant has no AMXBF16_SFT_MOE (its LoRA path)",
                                fix="verify --lora with --kernel emulate")
        e, i, h = gate.shape
        self._check(hidden=h, inter=i, types=None, where=f"layer {layer}")
        req = {"op": "load", "key": key, "method": self.method, "E": e, "top_k": top_k, "H": h, "I": i,
               "layer": layer, "max_len": max_len,
               "arrays": {p: self._save(np.ascontiguousarray(a, dtype=np.uint16))
                          for p, a in (("gate", gate), ("up", up), ("down", down))}}
        what = "BF16"
        if lora is not None:
            req["sft"] = {"rank": int(rank), "alpha": float(alpha),
                          "lora": {n: self._save(np.ascontiguousarray(a, dtype=np.uint16)) for n, a in lora.items()}}
            what = "BF16 with LoRA, AMXBF16_SFT_MOE"
        self._call(req, f"loading layer {layer} ({what})")
        self.loaded[key] = {"layer": layer, "H": h, "E": e, "types": {"gate": "BF16", "up": "BF16", "down": "BF16"},
                            "max_len": max_len}

    def load_ktamx_layer(self, key: str, directory, layer: int, *, experts: int, top_k: int, hidden: int, inter: int,
                         max_len: int = 64, capacity: int | None = None) -> None:
        """AMXINT8/AMXINT4 on one layer of a kt-amx directory written for ``threadpools`` parts. ``capacity`` below
        ``experts``: the child's object holds that many experts, and each forward reads only the experts its tokens
        pick (in groups of tokens whose picks fit); at least ``top_k``."""
        self._check(hidden=hidden, inter=inter, types=None, where=f"layer {layer}")
        if capacity is not None and not top_k <= capacity:
            raise KernelRefused(f"a capacity of {capacity} experts cannot hold one token's {top_k} picks",
                                fix=f"give at least {top_k}")
        req = {"op": "load", "key": key, "method": self.method, "E": experts, "top_k": top_k, "H": hidden,
               "I": inter, "layer": layer, "max_len": max_len, "dir": str(directory), "parts": self.threadpools,
               "scratch": str(self._dir),  # the child writes the layer's .kt files there for the kernel to read
               "capacity": min(capacity or experts, experts)}
        self._call(req, f"loading layer {layer} of {directory}")
        self.loaded[key] = {"layer": layer, "H": hidden, "E": experts, "types": {}, "max_len": max_len}

    def load_release_layer(self, key: str, directory, layer: int, *, experts: int, top_k: int, hidden: int,
                           inter: int, base: str | None = None, max_len: int = 64) -> None:
        """A release-format method (RAWINT4, MXFP4, ...) on one layer of a release directory as released: the
        child reads it with kt-kernel's own loader (``base``: the layer's key prefix, ``model.layers.L`` unless the
        release names it otherwise) and picks the backend as kt-kernel does (``KT_*_BACKEND`` honoured)."""
        self._check(hidden=hidden, inter=inter, types=None, where=f"layer {layer}")
        req = {"op": "load", "key": key, "method": self.method, "E": experts, "top_k": top_k, "H": hidden,
               "I": inter, "layer": layer, "max_len": max_len, "release": str(directory),
               "base": base or f"model.layers.{layer}"}
        self._call(req, f"loading layer {layer} of {directory} ({self.method})")
        self.loaded[key] = {"layer": layer, "H": hidden, "E": experts, "types": {}, "max_len": max_len}

    def forward(self, key: str, hidden_bf16: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """One MoE forward: hidden states (bf16 bits ``[T, H]``), expert ids ``[T, k]``, routing weights
        ``[T, k]`` -> output bf16 bits ``[T, H]``."""
        info = self.loaded[key]
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if ids.size and not (0 <= ids.min() and ids.max() < info["E"]):
            raise KernelRefused(f"expert ids {ids.min()}..{ids.max()} outside 0..{info['E'] - 1}")
        step = info["max_len"]
        if ids.shape[0] > step:  # the kernel's buffers hold max_len tokens
            return np.concatenate([self.forward(key, hidden_bf16[a:a + step], ids[a:a + step], weights[a:a + step])
                                   for a in range(0, ids.shape[0], step)])
        out = self._dir / "out.npy"
        ans = self._call({"op": "forward", "key": key, "hidden": self._save(np.ascontiguousarray(hidden_bf16, dtype=np.uint16)),
                    "ids": self._save(ids), "weights": self._save(np.ascontiguousarray(weights, dtype=np.float32)),
                    "out": str(out)}, f"running layer {info['layer']} on {ids.shape[0]} token(s)")
        res = np.load(out)
        self.expert_loads += int(ans.get("loads", 0))
        for f in self._dir.glob("a*.npy"):  # inputs of this call; loaded weights live in the child already
            f.unlink()
        return res

    def unload(self, key: str) -> dict:
        """Free layer ``key`` in the child (a streamed verify is done with it); the child's ``{"rss", "hwm"}`` after."""
        info = self.loaded.pop(key, None)
        if info is None:
            return self.memory()
        ans = self._call({"op": "unload", "key": key}, f"freeing layer {info['layer']}")
        return {"rss": int(ans["rss"]), "hwm": int(ans["hwm"])}

    def memory(self) -> dict:
        """The child's resident bytes now (``rss``) and at most so far (``hwm``, its VmHWM)."""
        ans = self._call({"op": "memory"}, "reporting its memory")
        return {"rss": int(ans["rss"]), "hwm": int(ans["hwm"])}

    def quantize_ktamx_layer(self, tree_dir, layer: int, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                             top_k: int) -> None:
        """Have kt-kernel's own AMX quantizer write one layer (bf16 bits, HF orientation) as a ``.kt`` tree under
        ``tree_dir`` (``_layer_L/_numa_N/``), the path upstream's converter takes before merging to safetensors.
        The quantized layer stays loaded in the child as ``save{layer}`` (its forward is the layer as the kernel
        quantized it in memory: the reference a load from the written files must equal)."""
        if self.method not in ("AMXINT8", "AMXINT4"):
            raise KernelRefused(f"{self.method} has no quantizer", fix="use an AMXINT8 or AMXINT4 session")
        e, i, h = gate.shape
        self._check(hidden=h, inter=i, types=None, where=f"layer {layer}")
        req = {"op": "load", "key": f"save{layer}", "method": self.method, "E": e, "top_k": top_k, "H": h, "I": i,
               "layer": layer, "max_len": 64, "save": str(tree_dir),
               "arrays": {p: self._save(np.ascontiguousarray(a, dtype=np.uint16))
                          for p, a in (("gate", gate), ("up", up), ("down", down))}}
        self._call(req, f"quantizing layer {layer} to {self.method}")
        self.loaded[f"save{layer}"] = {"layer": layer, "H": h, "E": e, "types": {}, "max_len": 64}

    def close(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                proc.stdin.flush()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        try:
            self._err.close()
        except (AttributeError, OSError):
            pass
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_PROBE: dict | None = None


def probe_kernel(refresh: bool = False) -> dict:
    """What kt-kernel is here, asked of a child process: ``{"available", "version", "variant", "methods",
    "error"}``. Cached for the process."""
    global _PROBE
    if _PROBE is not None and not refresh:
        return _PROBE
    try:
        with KernelSession(None) as s:
            _PROBE = {"available": True, **s.info.as_dict(), "error": None}
    except KtError as exc:
        _PROBE = {"available": False, "version": None, "variant": None, "methods": [], "error": exc.message}
    return _PROBE

