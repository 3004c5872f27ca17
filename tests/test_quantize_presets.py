"""llama-quantize's presets as recipes (rules/convert/{Q2_K,Q2_K_S,Q3_K_*,IQ*}.yaml) and its importance-matrix refusals.

Type choice: for every preset, on two variants of the tiny qwen3_moe (8 layers and 8 experts, which takes
llama-quant.cpp's 8-expert branches; 16 layers, 4 experts and one KV head, n_gqa 4, which takes the others) and on
the tiny deepseek_v3 (MLA: attn_kv_b, a shared expert, a dense first layer), the
type ``quantize --dry-run`` plans for each tensor equals the type in the header of the GGUF ``llama-quantize --imatrix``
writes (built from the pinned llama.cpp, tests/llamacpp_tools.py). Bytes: the presets whose types ktconvert writes
are byte-identical to llama-quantize's. Refusals: exit code, one line, nothing written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from convert_helpers import tiny
from llamacpp_tools import build, run_tool
from test_parity_llamacpp import differences
from test_quantize_imatrix_parity import TEXT, _llama_quantize

pytestmark = pytest.mark.interop

IQ_PRESETS = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M"]
WRITTEN_PRESETS = ["Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "IQ4_NL", "IQ4_XS"]


def _variant(hf: Path, out: Path, n_layers: int, n_experts: int | None = None, kv_heads: int | None = None) -> Path:
    """The tiny model with ``n_layers`` layers (layer i a copy of layer i % 2), its first ``n_experts`` experts and
    its first ``kv_heads`` KV heads."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(hf, out)
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    deep = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")}
    for i in range(n_layers):
        prefix = f"model.layers.{i % cfg['num_hidden_layers']}."
        for k, v in tensors.items():
            if not k.startswith(prefix):
                continue
            rest = k[len(prefix):]
            if n_experts and ".experts." in rest and int(rest.split(".experts.")[1].split(".")[0]) >= n_experts:
                continue
            if n_experts and rest == "mlp.gate.weight":
                v = v[:n_experts]
            if kv_heads and rest in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
                v = v[:kv_heads * hd]
            deep[f"model.layers.{i}.{rest}"] = np.ascontiguousarray(v)
    cfg["num_hidden_layers"] = n_layers
    if n_experts:
        cfg["num_experts"] = n_experts
        cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], n_experts)
    if kv_heads:
        cfg["num_key_value_heads"] = kv_heads
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(deep, str(out / "model.safetensors"))
    return out


def _inputs(root: Path, name: str, family: str = "qwen3_moe", **kw) -> tuple[Path, Path]:
    from ktconvert.convert import convert

    hf = _variant(tiny(root, family), root / name, **kw) if kw else tiny(root, family)
    f32 = convert(hf, root / f"{name}-f32", type="F32").out / "model.gguf"
    text = root / "text.txt"
    text.write_text(TEXT)
    imx = root / f"{name}.imatrix.gguf"
    run_tool("llama-imatrix", ["-m", str(f32), "-f", str(text), "-c", "64", "--chunks", "2", "-t", "1", "--no-ppl",
                               "-o", str(imx)])
    return f32, imx


@pytest.fixture(scope="module")
def models(tmp_path_factory, llama_tools):
    root = tmp_path_factory.mktemp("presets")
    return {"8 experts": _inputs(root, "e8", n_layers=8),
            "4 experts, n_gqa 4": _inputs(root, "e4", n_layers=16, n_experts=4, kv_heads=1),
            "deepseek_v3 (MLA)": _inputs(root, "ds", "deepseek_v3")}


def _llama_types(path: Path) -> dict[str, str]:
    """Each tensor's type in the header of a GGUF llama-quantize wrote."""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


_DRY_LINE = re.compile(r"^\[\s*\d+/\s*\d+\] (\S+)\s+- \[.*?\], type =\s*(\S+), size = [^(]*(?:\((\S+)\))?$")


def _llama_dry_types(f32: Path, imatrix: Path | None, preset: str, *flags: str) -> dict[str, str]:
    """Each tensor's type as ``llama-quantize --dry-run`` chooses it (the same llama_tensor_get_type as a real run,
    without the IQ quantizers' minutes; test_dry_run_types_are_the_written_header_types checks that they agree)."""
    args = ["--dry-run", *flags, *(["--imatrix", str(imatrix)] if imatrix else []), str(f32), preset, "1"]
    types = {m.group(1): (m.group(3) or m.group(2)).upper()
             for m in map(_DRY_LINE.match, run_tool("llama-quantize", args).splitlines()) if m}
    assert types, "llama-quantize --dry-run printed no tensor line"
    return types


def _our_types(f32: Path, preset: str, imatrix: Path | None) -> dict[str, str]:
    from ktconvert.convert import plan_conversion

    return {t.name: t.type for t in plan_conversion(f32, preset, imatrix=imatrix).tensors}


@pytest.mark.parametrize("model", ["8 experts", "4 experts, n_gqa 4", "deepseek_v3 (MLA)"])
@pytest.mark.parametrize("preset", IQ_PRESETS + WRITTEN_PRESETS)
def test_preset_chooses_llama_quantizes_type_for_every_tensor(models, tmp_path, model, preset):
    f32, imx = models[model]
    want = _llama_dry_types(f32, imx, preset)
    got = _our_types(f32, preset, imx)
    assert {n: got.get(n) for n in want} == want
    assert len(set(want.values()) - {"F32"}) > 1, "a one-type mix: the comparison proves little"


@pytest.mark.parametrize("model,preset,override", [
    ("4 experts, n_gqa 4", "Q3_K_M", r"blk\.0\.attn_v=Q8_0"),
    ("4 experts, n_gqa 4", "Q4_K_M", r"blk\.[01]\.attn_v=Q4_K"),
    ("8 experts", "IQ2_XXS", r"blk\.0\.ffn_down=Q4_K"),
])
def test_overridden_tensors_do_not_advance_the_mix_counters(models, model, preset, override):
    """llama-quant.cpp counts attn_v (Q3_K_M's first two, the _M mixes' use_more_bits) and the IQ2 mixes' ffn_down
    only over the tensors its mix chooses: one taken by --tensor-type moves the others up."""
    from ktconvert.convert import load_recipe, with_overrides

    f32, imx = models[model]
    want = _llama_dry_types(f32, imx, preset, "--tensor-type", override)
    got = _our_types(f32, with_overrides(load_recipe(preset), tensor_types=(override,)), imx)
    assert {n: got.get(n) for n in want} == want
    assert want != _llama_dry_types(f32, imx, preset), "the override changed nothing: the test cannot fail"


@pytest.mark.parametrize("preset", ["IQ4_NL", "IQ4_XS", "Q3_K_M", "Q3_K_L"])
def test_preset_without_imatrix_chooses_llama_quantizes_types(models, tmp_path, preset):
    """Without an importance matrix (IQ4_NL/IQ4_XS then give the first eighth's ffn_down Q5_K)."""
    f32, _ = models["4 experts, n_gqa 4"]
    assert _our_types(f32, preset, None) == _llama_dry_types(f32, None, preset)


@pytest.mark.parametrize("preset", ["IQ3_XS"])
def test_dry_run_types_are_the_written_header_types(small, tmp_path, preset):
    """What llama-quantize --dry-run says is what its GGUF's header holds, and what ktconvert plans."""
    f32, imx = small
    written = _llama_types(_llama_quantize(f32, imx, tmp_path / "llama.gguf", preset))
    assert written == _llama_dry_types(f32, imx, preset) == _our_types(f32, preset, imx)


@pytest.fixture(scope="module")
def small(tmp_path_factory, llama_tools):
    """The 2-layer tiny qwen3_moe (F32 GGUF) and llama-imatrix's importance matrix of it."""
    return _inputs(tmp_path_factory.mktemp("presets-small"), "small")


#: every IQ preset, written and compared byte for byte (with the importance matrix they need)
IQ_BYTE_PRESETS = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M"]


@pytest.mark.parametrize("preset", WRITTEN_PRESETS + IQ_BYTE_PRESETS)
def test_preset_with_imatrix_is_byte_identical_to_llama_quantize(small, tmp_path, preset):
    from ktconvert.convert import convert

    f32, imx = small
    want = _llama_quantize(f32, imx, tmp_path / "llama.gguf", preset)
    got = convert(f32, tmp_path / "ours", preset, imatrix=imx).out / "model.gguf"
    assert differences(want, got) == []


@pytest.mark.parametrize("preset", ["Q3_K_S", "Q3_K_M", "Q3_K_L", "IQ4_XS"])
def test_preset_without_imatrix_is_byte_identical_to_llama_quantize(small, tmp_path, preset):
    from ktconvert.convert import convert

    f32, _ = small
    want = tmp_path / "llama.gguf"
    run_tool("llama-quantize", [str(f32), str(want), preset, "1"])
    assert differences(want, convert(f32, tmp_path / "ours", preset).out / "model.gguf") == []


def _cli(*args):
    from ktconvert.cli import cli

    return CliRunner().invoke(cli, ["quantize", *map(str, args)])


@pytest.mark.parametrize("preset,first_type", [("IQ2_XXS", "IQ2_XXS"), ("IQ1_S", "IQ1_S"), ("Q2_K_S", "Q2_K"),
                                                ("IQ3_XXS", "IQ2_S")])
def test_very_low_bit_preset_without_imatrix_is_refused_as_llama_quantize_does(small, tmp_path, preset, first_type):
    f32, _ = small
    proc = __import__("subprocess").run([str(build() / "llama-quantize"), str(f32), str(tmp_path / "l.gguf"), preset,
                                         "1"], capture_output=True, text=True)
    assert proc.returncode != 0 and "requires an importance matrix" in proc.stderr + proc.stdout
    out = tmp_path / "out"
    res = _cli(f32, out, "--recipe", preset)
    lines = res.stderr.splitlines()
    assert res.exit_code == 2 and len(lines) == 1, res.stderr
    assert f"{first_type} (file type {preset}" in lines[0] and "--imatrix FILE" in lines[0], lines[0]
    assert not out.exists() and not (tmp_path / "ours").exists()


def test_one_tensor_of_a_very_low_bit_type_without_imatrix_is_refused(small, tmp_path):
    """llama-quantize checks each tensor's final type, whatever the file type: one rule sending attn_q to IQ2_XS in
    the Q4_K_M mix (what --tensor-type attn_q=IQ2_XS asks of llama-quantize) needs an importance matrix too."""
    from ktconvert.convert import load_recipe, plan_conversion
    from ktconvert.convert.recipe import Rule
    from ktconvert.errors import UsageProblem
    from dataclasses import replace

    f32, imx = small
    base = load_recipe("Q4_K_M")
    r = replace(base, rules=(base.rules[0], Rule(index=1, match="attn_q", type="IQ2_XS", where="test"),
                             *base.rules[1:]))
    with pytest.raises(UsageProblem, match=r"IQ2_XS \(file type Q4_K_M, first for blk\.0\.attn_q\.weight\)"):
        plan_conversion(f32, r)
    assert plan_conversion(f32, r, imatrix=imx).tensors  # with one it plans


def test_imatrix_without_the_entry_a_very_low_bit_tensor_needs_is_refused(small, tmp_path):
    """llama-quantize aborts at the first such tensor the matrix has no entry for; ktconvert refuses before writing
    (here --exclude-weights drops blk.1.ffn_up_exps, which IQ2_XXS quantizes to IQ2_XXS)."""
    f32, imx = small
    proc = __import__("subprocess").run([str(build() / "llama-quantize"), "--imatrix", str(imx), "--exclude-weights",
                                         "blk.1.ffn_up_exps", str(f32), str(tmp_path / "l.gguf"), "IQ2_XXS", "1"],
                                        capture_output=True, text=True)
    assert proc.returncode != 0 and "Missing importance matrix for tensor blk.1.ffn_up_exps.weight" in proc.stderr
    out = tmp_path / "out"
    res = _cli(f32, out, "--recipe", "IQ2_XXS", "--imatrix", imx, "--exclude-weights", "blk.1.ffn_up_exps")
    lines = res.stderr.splitlines()
    assert res.exit_code == 3 and len(lines) == 1, res.stderr
    assert "blk.1.ffn_up_exps.weight" in lines[0] and "IQ2_XXS" in lines[0] and str(imx) in lines[0], lines[0]
    assert not out.exists()


def test_override_equal_to_the_mix_type_is_not_dropped(small):
    """llama.cpp #22544: ``--tensor-type ffn_down_exps=Q4_K`` on Q4_K_M (Q4_K, the mix's own type) must still take
    the tensor out of the mix: blk.1.ffn_down_exps, Q6_K in the mix (use_more_bits), becomes Q4_K, as the pinned
    llama-quantize does (its test: test_quantize_imatrix_parity.py 'tensor-type equal to the mix's type')."""
    from ktconvert.convert import load_recipe, with_overrides

    f32, _ = small
    mix = _our_types(f32, load_recipe("Q4_K_M"), None)
    over = _our_types(f32, with_overrides(load_recipe("Q4_K_M"), tensor_types=("ffn_down_exps=Q4_K",)), None)
    assert mix["blk.1.ffn_down_exps.weight"] == "Q6_K" and over["blk.1.ffn_down_exps.weight"] == "Q4_K"


def test_recipe_quantize_section_equals_llama_quantize(small, tmp_path):
    """A recipe saying the importance matrix (relative to the recipe file), a --tensor-type and an
    --exclude-weights writes what llama-quantize writes with those options."""
    import shutil

    f32, imx = small
    shutil.copy(imx, tmp_path / "m.imatrix.gguf")
    recipe = tmp_path / "mix.yaml"
    recipe.write_text("kind: convert-recipe\nname: mix\nbase: Q4_K_M\nquantize:\n  imatrix: m.imatrix.gguf\n"
                      "  tensor_types: ['attn_k=Q5_K']\n  exclude_weights: [ffn_gate]\n"
                      "rules:\n  - {match: 'never-matches', type: F32}\n")
    want = _llama_quantize(f32, tmp_path / "m.imatrix.gguf", tmp_path / "llama.gguf", "Q4_K_M",
                           "--tensor-type", "attn_k=Q5_K", "--exclude-weights", "ffn_gate")
    res = _cli(f32, tmp_path / "ours", "--recipe", recipe)
    assert res.exit_code == 0, res.stderr
    assert differences(want, tmp_path / "ours" / "model.gguf") == []


@pytest.fixture(scope="module")
def split_input(tmp_path_factory, llama_tools):
    """The tiny qwen3_moe as an F32 split GGUF set written by ktconvert (--shard-size)."""
    from ktconvert.convert import convert

    root = tmp_path_factory.mktemp("split-in")
    out = convert(tiny(root, "qwen3_moe"), root / "f32", type="F32", shard_size="2MB").out
    files = sorted(out.glob("model-*-of-*.gguf"))
    assert len(files) >= 3, files
    return files


def test_keep_split_is_byte_identical_to_llama_quantize_keep_split(split_input, tmp_path):
    first = split_input[0]
    run_tool("llama-quantize", ["--keep-split", str(first), str(tmp_path / "llama.gguf"), "Q4_K_M", "1"])
    want = sorted(tmp_path.glob("llama-*-of-*.gguf"))
    res = _cli(first, tmp_path / "ours", "--recipe", "Q4_K_M", "--keep-split")
    assert res.exit_code == 0, res.stderr
    got = sorted((tmp_path / "ours").glob("model-*-of-*.gguf"))
    assert [p.name.split("-", 1)[1] for p in got] == [p.name.split("-", 1)[1] for p in want]
    assert len(got) == len(split_input)
    for w, g in zip(want, got):
        assert differences(w, g) == [], g.name
        assert w.read_bytes() == g.read_bytes(), g.name  # the headers too: keys, their order, tensor order
    assert gguf.GGUFReader(got[1]).fields["split.no"].contents() == 1


def test_keep_split_refusals(split_input, small, tmp_path):
    f32, _ = small
    res = _cli(split_input[0], tmp_path / "o", "--recipe", "Q4_K_M", "--keep-split", "--shard-size", "1MB")
    assert res.exit_code == 2 and "give one" in res.stderr and not (tmp_path / "o").exists()
    res = _cli(split_input[0], tmp_path / "o", "--type", "Q8_0", "--keep-split", "--to", "safetensors")
    assert res.exit_code == 2 and "GGUF output only" in res.stderr and not (tmp_path / "o").exists()


def test_selection_that_leaves_no_entry_is_no_imatrix_for_the_mix(models):
    """--include-weights that no entry contains leaves llama-quantize without an importance matrix: IQ4_XS then
    writes the first eighth's ffn_down Q5_K, as without --imatrix."""
    from ktconvert.convert import plan_conversion

    f32, imx = models["4 experts, n_gqa 4"]
    want = _llama_dry_types(f32, imx, "IQ4_XS", "--include-weights", "no-such-tensor")
    got = {t.name: t.type for t in plan_conversion(f32, "IQ4_XS", imatrix=imx,
                                                   include_weights=("no-such-tensor",)).tensors}
    assert got == want and want["blk.0.ffn_down_exps.weight"] == "Q5_K"
    assert _our_types(f32, "IQ4_XS", imx)["blk.0.ffn_down_exps.weight"] == "IQ4_XS"
