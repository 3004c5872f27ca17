"""kt-kernel's own packer and AMX MoE as the kt-amx tests and the kernel check use them, on top of
:class:`ktconvert.kernel.runner.KernelSession` (the one child-process driver; this process never imports
kt-kernel)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ktconvert.kernel.kttree import read_kt_tree
from ktconvert.kernel.runner import KernelSession, bf16_bits_to_f32, f32_to_bf16_bits, probe_kernel


def probe() -> str | None:
    """Why kt-kernel cannot run here (one line), or ``None`` when a child process imports it."""
    info = probe_kernel()
    return None if info["available"] else info["error"]


def kernel_pack(layers: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], *, method: str, parts: int,
                workdir: Path, threads: int | None = None, top_k: int = 2) -> dict[str, np.ndarray]:
    """kt-kernel's own packer, driven as upstream's converter drives it, on ``{layer: (gate, up, down)}`` (float32
    arrays of bf16 values ``[E,I,H]``, ``[E,I,H]``, ``[E,H,I]``): ``{kt-amx tensor name: array}`` read back from
    the ``.kt`` tree it saves, named as upstream's merge step names them."""
    tree = Path(workdir) / "kt"
    tree.mkdir(parents=True, exist_ok=True)
    with KernelSession(method, threadpools=parts, threads=threads or parts) as s:
        for layer, (gate, up, down) in layers.items():
            s.quantize_ktamx_layer(tree, layer, *(f32_to_bf16_bits(np.asarray(a, np.float32)) for a in (gate, up, down)),
                                   top_k)
    out: dict[str, np.ndarray] = {}
    for tensors in read_kt_tree(tree).values():
        out.update(tensors)
    return out


def kernel_moe(kt_dir: Path, *, layer: int, method: str, parts: int, x: np.ndarray, ids: np.ndarray,
               weights: np.ndarray, E: int, H: int, I: int, workdir: Path | None = None,
               threads: int | None = None) -> np.ndarray:
    """kt-kernel's ``method`` MoE forward on one layer of the kt-amx directory ``kt_dir`` (loaded by pointer, as
    upstream's loader does): ``x`` ``[T, H]`` (bf16 values), ``ids``/``weights`` ``[T, k]``; float32 ``[T, H]``."""
    with KernelSession(method, threadpools=parts, threads=threads or parts) as s:
        s.load_ktamx_layer("L", kt_dir, layer, experts=E, top_k=int(ids.shape[1]), hidden=H, inter=I,
                           max_len=max(64, int(ids.shape[0])))
        y = s.forward("L", f32_to_bf16_bits(np.asarray(x, np.float32)), ids, weights)
    return bf16_bits_to_f32(y)
