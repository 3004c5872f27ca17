"""Parity tier: ktconvert's presets write the GGUF llama.cpp's own quantizer writes.

For each tiny model (the five families, 8 experts; variants with 4 experts, with tied embeddings) ktconvert
converts the HF checkpoint to an F32 GGUF, llama.cpp quantizes that GGUF with ``llama_model_quantize`` (the C
entry point of ``llama-quantize``, default parameters, no importance matrix) per preset, and ktconvert
quantizes the same F32 GGUF and the HF checkpoint per preset. Every tensor must have the same type and the
same bytes, every key/value the same value. ``--type T`` is compared with ``llama-quantize --pure`` (one type
everywhere) and the requantization of a lossy GGUF with ``--allow-requantize``.

llama-cpp-python is built from source into a cache on first use (``tests/llamacpp_runner.py``); without it the
tests skip with the reason, except under CI, where they must run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, LlamaFileType

import llamacpp_runner

pytestmark = pytest.mark.interop

PRESETS = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "Q8_0"]
FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"]
#: name -> (family, experts kept, tied embeddings)
VARIANTS = {
    **{f: (f, None, False) for f in FAMILIES},
    "qwen3_moe-4x": ("qwen3_moe", 4, False),     # no 8-expert bumps: attn_v in use_more_bits layers
    "deepseek_v3-4x": ("deepseek_v3", 4, False),  # attn_kv_b counted like attn_v
    "qwen2_moe-tied": ("qwen2_moe", None, True),  # token_embd takes output's type
    "mixtral-4x-tied": ("mixtral", 4, True),
    "Qwen3-Tiny-Chat": ("qwen3_moe", None, False),  # model card, chat_template.jinja, add_bos: general.*, tokenizer keys
    "qwen3_moe-h160": ("qwen3_moe", None, False),   # hidden 160: rows K-quants cannot hold, llama.cpp's fallbacks
}
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def make_variant(family: str, out: Path, experts: int | None, tied: bool) -> Path:
    """A tiny model of ``family`` with only the first ``experts`` experts and/or tied embeddings (no lm_head)."""
    from safetensors.numpy import load_file, save_file

    from ktconvert.model.tiny import write_tiny_model

    write_tiny_model(family, out)
    if out.name == "Qwen3-Tiny-Chat":
        (out / "README.md").write_text("---\nlicense: mit\ntags: [moe]\n---\n# tiny\n")
        (out / "chat_template.jinja").write_text("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}")
        tc = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**tc, "add_bos_token": True, "add_eos_token": False}))
    if out.name.endswith("-h160"):
        _narrow_hidden(out, 160)
    if experts is None and not tied:
        return out
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    keep = {}
    for name, arr in tensors.items():
        parts = name.split(".")
        if experts is not None and "experts" in parts:
            e = parts[parts.index("experts") + 1]
            if e.isdigit() and int(e) >= experts:
                continue
        if experts is not None and (name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))
                                    or name.endswith("e_score_correction_bias")):
            arr = np.ascontiguousarray(arr[:experts])
        if tied and name == "lm_head.weight":
            continue
        keep[name] = arr
    if experts is not None:
        for k in _EXPERT_KEYS:
            if k in cfg:
                cfg[k] = experts
        cfg["num_experts_per_tok"] = min(cfg.get("num_experts_per_tok", 2), 2)
        for k in ("n_group", "topk_group"):
            if k in cfg:
                cfg[k] = 1
    if tied:
        cfg["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(keep, str(out / "model.safetensors"))
    return out


def _narrow_hidden(out: Path, h: int) -> None:
    """Keep the first ``h`` hidden dimensions of a tiny qwen3_moe (every tensor's hidden axis, by name)."""
    from safetensors.numpy import load_file, save_file

    cfg = json.loads((out / "config.json").read_text())
    H = cfg["hidden_size"]
    tensors = {}
    for name, a in load_file(out / "model.safetensors").items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            a = a[:h]
        elif a.ndim == 2 and a.shape[1] == H:
            a = a[:, :h]
        elif a.ndim == 1 and a.shape[0] == H:
            a = a[:h]
        tensors[name] = np.ascontiguousarray(a)
    cfg["hidden_size"] = h
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def models(tmp_path_factory, llama_built):
    """variant -> (HF dir, F32 GGUF written by ktconvert)."""
    from ktconvert.convert import convert

    root = tmp_path_factory.mktemp("parity")
    out = {}
    for name, (family, experts, tied) in VARIANTS.items():
        hf = make_variant(family, root / name, experts, tied)
        f32 = convert(hf, root / f"{name}-f32", type="F32").out / "model.gguf"
        out[name] = (hf, f32)
    return out


def _ftype(name: str) -> int:
    return int(LlamaFileType["ALL_F32" if name == "ALL_F32" else f"MOSTLY_{name}"])


def read(path: Path) -> tuple[dict, dict]:
    """(name -> (type, bytes)), (key -> value) of a GGUF."""
    r = GGUFReader(path)
    tensors = {t.name: (t.tensor_type.name, t.data.tobytes()) for t in r.tensors}
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return tensors, kv


def differences(want: Path, got: Path) -> list[str]:
    """Every tensor whose type or bytes differ, every key whose value differs (one line each)."""
    wt, wk = read(want)
    gt, gk = read(got)
    out = [f"tensor {n}: only in {'llama.cpp' if n in wt else 'ktconvert'}" for n in sorted(set(wt) ^ set(gt))]
    for n in sorted(set(wt) & set(gt)):
        if wt[n][0] != gt[n][0]:
            out.append(f"tensor {n}: llama.cpp {wt[n][0]}, ktconvert {gt[n][0]}")
        elif wt[n][1] != gt[n][1]:
            out.append(f"tensor {n}: {wt[n][0]} bytes differ")
    for k in sorted(set(wk) | set(gk)):
        if wk.get(k) != gk.get(k):
            out.append(f"key {k}: llama.cpp {str(wk.get(k))[:60]!r}, ktconvert {str(gk.get(k))[:60]!r}")
    return out


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_presets_equal_llama_quantize(models, tmp_path, variant, preset):
    from ktconvert.convert import convert, load_recipe

    hf, f32 = models[variant]
    want = tmp_path / "llama.gguf"
    llamacpp_runner.quantize(f32, want, _ftype(load_recipe(preset).file_type))
    from_gguf = convert(f32, tmp_path / "from-gguf", preset).out / "model.gguf"
    assert differences(want, from_gguf) == []
    from_hf = convert(hf, tmp_path / "from-hf", preset).out / "model.gguf"
    assert differences(want, from_hf) == []


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0", "F16", "F32"])
def test_type_equals_llama_quantize_pure(models, tmp_path, qtype):
    """--type T --allow-fallback is llama-quantize --pure with the ftype whose default type is T, and labelled with
    that ftype (without --allow-fallback, --type refuses the rows T cannot hold instead of writing another type)."""
    from ktconvert.convert import convert, recipe_for_type

    hf, f32 = models["deepseek_v3-4x"]
    want = tmp_path / "llama.gguf"
    llamacpp_runner.quantize(f32, want, _ftype(recipe_for_type(qtype).file_type), pure=True)
    got = convert(f32, tmp_path / "ours", type=qtype, allow_fallback=True).out / "model.gguf"
    assert differences(want, got) == []
    got = convert(hf, tmp_path / "ours-hf", type=qtype, allow_fallback=True).out / "model.gguf"
    assert differences(want, got) == []


def test_requantize_follows_allow_requantize(models, tmp_path):
    """From a lossy GGUF both refuse unless asked; asked, both write the same tensors."""
    from ktconvert.convert import convert
    from ktconvert.errors import InputError

    _, f32 = models["qwen3_moe"]
    q8 = tmp_path / "q8.gguf"
    llamacpp_runner.quantize(f32, q8, _ftype("Q8_0"))
    with pytest.raises(AssertionError, match="requantizing from type q8_0 is disabled"):
        llamacpp_runner.quantize(q8, tmp_path / "refused.gguf", _ftype("Q4_K_M"))
    with pytest.raises(InputError, match="--allow-requantize"):
        convert(q8, tmp_path / "refused", "Q4_K_M")
    assert not (tmp_path / "refused").exists()
    want = tmp_path / "llama.gguf"
    llamacpp_runner.quantize(q8, want, _ftype("Q4_K_M"), allow_requantize=True)
    got = convert(q8, tmp_path / "ours", "Q4_K_M", allow_requantize=True).out / "model.gguf"
    assert differences(want, got) == []


def _table(log: str) -> list[str]:
    keep = ("[", "warning: ", "llama_model_quantize_impl: model size", "llama_model_quantize_impl: quant size",
            "llama_model_quantize_impl: WARNING")
    return [line.rstrip() for line in log.splitlines() if line.startswith(keep)]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe-4x", "mixtral-4x-tied", "qwen3_moe-h160"])
def test_dry_run_prints_llama_quantizes_table(models, tmp_path, variant, preset):
    """quantize --dry-run -o llama prints, line for line, what llama-quantize --dry-run logs for the same file."""
    from click.testing import CliRunner

    from ktconvert.cli import cli
    from ktconvert.convert import load_recipe

    hf, f32 = models[variant]
    log = llamacpp_runner.quantize(f32, tmp_path / "dry.gguf", _ftype(load_recipe(preset).file_type), dry_run=True)
    want = _table(log)
    assert len(want) > 20
    for src in (f32, hf):
        res = CliRunner().invoke(cli, ["quantize", str(src), str(tmp_path / "o"), "--recipe", preset, "--dry-run",
                                       "-o", "llama"])
        assert res.exit_code == 0, res.output
        assert res.output.splitlines() == want
