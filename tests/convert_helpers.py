"""Shared pieces of the conversion tests: tiny checkpoints, and what a correct GGUF must hold, derived independently.

The expected GGUF tensors are computed from the Hugging Face tensors with gguf-py's own name tables
(``gguf.get_tensor_name_map``, never ktconvert's naming maps), ``np.stack`` for the experts and
convert_hf_to_gguf's q/k permutation for llama-arch Mixtral, so the conversion is checked against an independent
statement of llama.cpp's conventions. GGUF output is read back with ``gguf.GGUFReader``, not ktconvert's reader.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2")
ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama", "deepseek_v2": "deepseek2",
        "deepseek_v3": "deepseek2", "glm4_moe": "glm4moe", "minimax_m2": "minimax-m2"}
_TINY: dict[str, Path] = {}


def tiny(root: Path, family: str) -> Path:
    """The deterministic tiny HF checkpoint of ``family`` (written once per session under ``root``)."""
    if family not in _TINY:
        from ktconvert.model.tiny import write_tiny_model

        out = root / f"tiny-{family}"
        write_tiny_model(family, out)
        _TINY[family] = out
    return _TINY[family]


def hf_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint as float32 numpy (BF16 widened exactly), read by the safetensors package."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(f).items()})
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: HF rotate-half q/k rows into llama.cpp's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_gguf(model_dir: Path, family: str) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array (numpy order) a correct conversion of ``model_dir`` holds."""
    import json

    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == ARCH[family])
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    tensors = hf_tensors(model_dir)
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str, str], dict[int, np.ndarray]] = {}
    for name, arr in tensors.items():
        parts = name.split(".")
        if "experts" in parts and "shared_experts" not in parts:
            i = parts.index("experts")
            layer, e, proj = int(parts[2]), int(parts[i + 1]), parts[i + 2]
            experts.setdefault((layer, parts[3], proj), {})[e] = arr  # parts[3]: the block (mlp / block_sparse_moe)
            continue
        key = name.replace("e_score_correction_bias", "e_score_correction.bias")
        g = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert g is not None, name
        a = arr.astype(np.float32)
        if family == "mixtral" and g.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg["num_attention_heads"] if g.endswith("attn_q.weight") else cfg["num_key_value_heads"]
            a = _permute(a, heads)
        if g.endswith("ffn_gate_inp_shexp.weight"):
            a = a.reshape(-1)
        out[g] = a
    for (layer, block, proj), per in experts.items():
        merged = f"model.layers.{layer}.{block}.experts.{proj}"
        g = names.get_name(merged, try_suffixes=(".weight",))
        assert g is not None, merged
        out[g + ".weight"] = np.stack([per[e] for e in range(len(per))]).astype(np.float32)
    return out


def read_gguf(path: Path) -> dict:
    """``name -> (ggml type, raw data as GGUFReader gives it)`` and the reader (for its fields)."""
    import gguf

    r = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type, np.array(t.data)) for t in r.tensors}, r


def field_bytes(reader, key: str) -> bytes:
    """A KV pair exactly as stored (GGUFReader keeps every part of it)."""
    return b"".join(p.tobytes() for p in reader.fields[key].parts)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# The compiled quantizers finish the tiny model's units within the first journal sync, so the run to be killed
# is slowed down instead: a sitecustomize (imported by the process and by each spawned --jobs worker) wraps
# every kernel call in a few milliseconds of sleep. The bytes written are unchanged.
_SLOW_SITE = """
import time
import ktconvert.quant._api as _api
_real = _api._kernel
def _slow_kernel(name):
    k = _real(name)
    def slow(*args):
        time.sleep(0.002)
        return k(*args)
    return slow
_api._kernel = _slow_kernel
"""


def slow_quantizer_env(site: Path) -> dict:
    """The environment of a ``python -m ktconvert`` child whose quantizer calls each take ~2 ms longer."""
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SLOW_SITE)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def assert_q8_0_matches_llama_quantize(model: Path, f32: Path, tmp_path: Path) -> None:
    """ktconvert's Q8_0 of ``model`` equals llama_model_quantize of the F32 GGUF ``f32``, tensor for tensor: the
    same names, types and bytes (needs the llama_built fixture)."""
    from gguf import GGUFReader

    import llamacpp_runner
    from ktconvert.convert import convert

    ours = convert(model, tmp_path / "q8", type="Q8_0").out / "model.gguf"
    theirs = tmp_path / "llama-q8.gguf"
    llamacpp_runner.quantize(f32, theirs, 7)  # LLAMA_FTYPE_MOSTLY_Q8_0
    a = {t.name: t for t in GGUFReader(ours).tensors}
    b = {t.name: t for t in GGUFReader(theirs).tensors}
    assert set(a) == set(b)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert a[name].data.tobytes() == b[name].data.tobytes(), name
