"""Test-only converter: a GGUF of a tiny model with llama.cpp names and chosen ggml types, optionally broken.

Correct conversions in the tests come from ``ktconvert quantize`` (:meth:`Workspace.converted`); this writer
makes the broken ones, which the real converter cannot. It follows llama.cpp's conventions
(merged ``*_exps`` experts ``[E, rows, cols]``, F32 norms and routers, ``llama``-architecture q/k rows
permuted for ggml's rope, a tensor whose rows a type cannot hold falls back to Q8_0 or F32) and uses
``ktconvert.quant`` for the bytes. Faults reproduce real conversion bugs:

* ``("experts-ne-order", L)``: layer L's expert tensors written in ggml ``ne`` order read as numpy order (the
  ``[H, I, E]`` array's bytes under the ``[E, I, H]`` shape; the tiny models have ``H == I``, so the shape
  still fits and only the numbers show it);
* ``("gate-up-swapped", L)``: layer L's ``ffn_gate_exps`` holds the up projections and vice versa;
  ``("gate-up-swapped", L, E)``: only expert E's;
* ``("router-transposed", L)``: layer L's ``ffn_gate_inp`` holds the transposed router's bytes under the
  original shape.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from ktconvert import families, quant
from ktconvert.formats import naming_map, transforms
from ktconvert.model import load_config
from ktconvert.model.ops.source import permute_rope_rows
from ktconvert.model.weights import read_tensors, to_reference_state

PROJ = ("gate", "up", "down")


def _row_type(want: str, row: int) -> str:
    if quant.row_ok(row, want):
        return want
    return "Q8_0" if quant.row_ok(row, "Q8_0") else "F32"


def write_gguf(model_dir, out, expert_type: str = "F32", other_type: str | None = None, faults=(), drop=(),
               split_kv_b: bool = False, poison=()) -> Path:
    """``drop``: llama.cpp names to leave out; ``poison``: names written in F32 with a NaN as first element."""
    cfg = load_config(Path(model_dir))
    state = {k: v.float().numpy() for k, v in to_reference_state(cfg, read_tensors(model_dir)).items()}
    nm = naming_map(cfg.family)
    other = other_type or expert_type
    faults = {tuple(f) for f in faults}
    tensors: dict[str, tuple[np.ndarray, str]] = {}

    names = dict(zip(PROJ, cfg.expert_proj_names))
    for layer in cfg.mlp.moe_layers:
        prefix = f"model.layers.{layer}.{cfg.moe_block_name}.experts"
        stacks = {p: np.stack([state.pop(f"{prefix}.{e}.{names[p]}.weight") for e in range(cfg.num_experts)])
                  for p in PROJ}
        if ("gate-up-swapped", layer) in faults:
            stacks["gate"], stacks["up"] = stacks["up"], stacks["gate"]
        for e in [f[2] for f in faults if f[:2] == ("gate-up-swapped", layer) and len(f) == 3]:
            stacks["gate"][e], stacks["up"][e] = stacks["up"][e].copy(), stacks["gate"][e].copy()
        if ("experts-ne-order", layer) in faults:
            stacks = {p: np.ascontiguousarray(w.transpose(2, 1, 0)).reshape(w.shape) for p, w in stacks.items()}
        for p, w in stacks.items():
            tensors[nm.expert_name("gguf-merged", p, layer)] = (w, expert_type)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    for name, w in state.items():
        m = nm.lookup(name)
        gname = m.gguf_name if m else None
        assert gname is not None, name
        if dict(m.transform).get("kv_b_split"):  # glm-dsa stores kv_b_proj only as attn_k_b / attn_v_b
            nope, vdim, rank = cfg.attention.mla.qk_nope_head_dim, cfg.attention.mla.v_head_dim, cfg.attention.mla.kv_lora_rank
            kv = w.reshape(heads, nope + vdim, rank)
            tensors[gname] = (np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1)), "F32")
            tensors[gname.replace("attn_k_b", "attn_v_b")] = (np.ascontiguousarray(kv[:, nope:]), "F32")
            continue
        if transforms.splits(m.transform):  # one HF tensor, several GGUF ones (Qwen3-Next's in_proj_qkvz)
            for sib in nm.hf_siblings(m):
                part = transforms.redo(w, dict(sib.transform), cfg.attention.linear, name)
                tensors[sib.gguf_name] = (part, _row_type(other, part.shape[-1]))
            continue
        if m.transform:  # llama.cpp's value changes (Qwen3.5: norms + 1, -exp(A_log), tiled value heads)
            w = transforms.redo(w, dict(m.transform), cfg.attention.linear, name)
        if nm.arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            w = permute_rope_rows(w, heads if ".attn_q." in gname else kv_heads)
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(-1)  # llama.cpp stores the shared-expert gate as a vector
        if gname.endswith("ffn_gate_inp.weight"):
            layer = int(gname.split(".")[1])
            if ("router-transposed", layer) in faults:
                w = np.ascontiguousarray(w.T).reshape(w.shape)
            tensors[gname] = (w, "F32")
            continue
        if split_kv_b and gname.endswith("attn_kv_b.weight"):
            nope, vdim, rank = cfg.attention.mla.qk_nope_head_dim, cfg.attention.mla.v_head_dim, cfg.attention.mla.kv_lora_rank
            kv = w.reshape(heads, nope + vdim, rank)
            tensors[gname.replace("attn_kv_b", "attn_k_b")] = (np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1)), "F32")
            tensors[gname.replace("attn_kv_b", "attn_v_b")] = (np.ascontiguousarray(kv[:, nope:]), "F32")
            continue
        tensors[gname] = (w, "F32" if w.ndim == 1 else _row_type(other, w.shape[-1]))

    writer = gguf.GGUFWriter(str(out), nm.arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    for gname, (w, qtype) in tensors.items():
        if gname in drop:
            continue
        if gname in poison:  # the quantizers refuse NaN, as they should: write the floats as they are
            bad = np.array(w, dtype=np.float32)
            bad.reshape(-1)[0] = np.nan
            writer.add_tensor(gname, bad)
            continue
        data = quant.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype, name=gname)
        writer.add_tensor(gname, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2", "qwen3_5_moe",
            "qwen3_vl_moe", "glm_moe_dsa", "qwen3_next", "kimi_k25", "deepseek_v32")
REPO = Path(__file__).resolve().parents[1]


class Workspace:
    """Tiny models and their GGUF conversions, each written once per test session (keyed by recipe)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._ggufs: dict[tuple, Path] = {}

    def model(self, family: str) -> Path:
        from ktconvert.model.tiny import write_tiny_model

        d = self.root / family
        if not (d / "config.json").is_file():
            write_tiny_model(family, d)
        return d

    def gguf(self, family: str, qtype: str, faults=(), **kw) -> Path:
        key = (family, qtype, tuple(faults), tuple(sorted(kw.items())))
        path = self._ggufs.get(key)
        if path is None:
            path = self.root / f"{family}-{qtype}-{len(self._ggufs)}.gguf"
            write_gguf(self.model(family), path, qtype, faults=faults, **kw)
            self._ggufs[key] = path
        return path

    def converted(self, family: str, spec: str, fmt: str = "gguf") -> Path:
        """``ktconvert quantize``'s output for the tiny model: ``spec`` is a type (``Q4_K``) or a preset
        (``Q4_K_M``); ``fmt`` gguf (the ``model.gguf`` path) or safetensors (the output directory)."""
        from ktconvert.convert import convert, presets

        out = self.root / f"{family}-quantize-{spec}-{fmt}"
        if not (out / "manifest.json").is_file():
            kw = {"recipe": spec} if spec in presets() else {"type": spec, "allow_fallback": True}
            convert(self.model(family), out, format=fmt, **kw)
        return out / "model.gguf" if fmt == "gguf" else out

    @staticmethod
    def rules(family: str) -> Path:
        """The family's single-request rule file, else its balance_serve one (GLM-4 MoE runs only there upstream)."""
        own = REPO / "rules" / "optimize" / f"{family}.yaml"
        return own if own.exists() else REPO / "rules" / "optimize" / f"{family}-serve.yaml"

    @staticmethod
    def golden(family: str) -> Path:
        return REPO / "golden" / family


def vanish_mid_run(monkeypatch, path: Path, layer: int = 1) -> None:
    """Delete ``path`` as the layer-major executor starts layer ``layer``: a source disappearing mid-run."""
    from ktconvert.model import executor

    real = executor.LayerMajor.layer_jobs  # every way a layer runs goes through it (run, run_many, run_pair)

    def vanish(self, index, *a, **kw):
        if index == layer and path.exists():
            path.unlink()
        return real(self, index, *a, **kw)

    monkeypatch.setattr(executor.LayerMajor, "layer_jobs", vanish)


def experts_path(family: str, layer: int) -> str:
    return f"model.layers.{layer}.{families.spec(family).moe_block_name}.experts"


def gate_path(family: str, layer: int) -> str:
    return f"model.layers.{layer}.{families.spec(family).moe_block_name}.gate"


def rewrite_gguf(src, dst, change) -> Path:
    """Copy a GGUF tensor by tensor; ``change(name, data, qtype) -> (data, qtype) | None`` may replace one
    (``data`` as GGUFReader gives it: float arrays for F32/F16, block bytes otherwise) or drop it (None)."""
    reader = gguf.GGUFReader(str(src))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    writer = gguf.GGUFWriter(str(dst), arch)
    for t in reader.tensors:
        got = change(t.name, np.array(t.data), t.tensor_type.name)
        if got is None:
            continue
        data, qtype = got
        if qtype in ("F32", "F16") and data.dtype != np.uint8:
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def write_random_bf16_model(directory: Path, overrides: dict, seed: int = 0) -> int:
    """A tiny qwen3_moe with ``overrides`` in its config and random BF16 weights (normal, std 0.05) written to
    ``directory``, for memory tests larger than the tiny models; returns its float32 size in bytes."""
    import json

    import torch

    from ktconvert.formats.safetensors_write import to_bytes
    from ktconvert.model.reference import build_skeleton
    from ktconvert.model.tiny import tiny_config

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_config("qwen3_moe") | overrides))
    rng = np.random.default_rng(seed)
    bits = {}
    for name, t in build_skeleton(load_config(directory)).state_dict().items():
        x = torch.from_numpy(rng.standard_normal(tuple(t.shape), dtype=np.float32) * 0.05)
        bits[name] = x.to(torch.bfloat16).view(torch.uint16).numpy()
    (directory / "model.safetensors").write_bytes(to_bytes(bits, {"format": "pt"}, {k: "BF16" for k in bits}))
    return 2 * sum(b.nbytes for b in bits.values())
