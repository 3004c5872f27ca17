"""Tiny models: frozen RNG, byte-exact files against the recorded sha256, transformers compatibility,
and the designed routing margins (bf16 must not flip an expert)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import struct

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from transformers_helpers import transformers_523
from ktconvert import families
from ktconvert.cli import cli
from ktconvert.golden.paths import golden_root, load_tiny_hashes
from ktconvert.model import rng
from ktconvert.families.config import FAMILIES, normalize_config
from ktconvert.formats.safetensors_write import to_bytes
from ktconvert.model.tiny import (
    BOS_ID,
    EOS_ID,
    FP8_VARIANTS,
    TINY_VARIANTS,
    VOCAB,
    routing_channels,
    tensor_specs,
    tiny_config,
    tiny_files,
    tiny_name,
    tiny_tensors,
    token_codes,
)
from ktconvert.model.tinytok import PROMPT_TEXT
from ktconvert.model.tiny_release import FORMATS as RELEASE_FORMATS, tiny_release_files

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def one_thread():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- frozen RNG --------------------------------------------------------------------------------


def _splitmix64_scalar(state: int):
    """The reference algorithm in plain Python integers, independent of the numpy vectorisation."""
    mask = (1 << 64) - 1
    while True:
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        yield z ^ (z >> 31)


def test_splitmix64_matches_the_reference_algorithm():
    assert int(rng.splitmix64(0, 1)[0]) == 0xE220A8397B1DCDAF  # the published first output for seed 0
    for key in (0, 1, rng.stream_key("x"), (1 << 64) - 1):
        ref = _splitmix64_scalar(key)
        assert [int(v) for v in rng.splitmix64(key, 50)] == [next(ref) for _ in range(50)]
    assert int(rng.splitmix64(7, 1, start=9)[0]) == int(rng.splitmix64(7, 10)[9])


def test_uniform_values_are_exact_float32_in_the_open_interval():
    u = rng.uniform_pm1(rng.stream_key("t"), 100_000)
    assert u.dtype == np.float64
    assert np.all(u.astype(np.float32).astype(np.float64) == u)
    assert -1 < u.min() < -0.999 and 0.999 < u.max() < 1
    assert abs(u.mean()) < 0.01


def test_permutation_and_randint():
    perm = rng.permutation(rng.stream_key("p"), 8)
    assert sorted(perm) == list(range(8))
    r = rng.randint(rng.stream_key("r"), 10_000, 7)
    assert r.min() == 0 and r.max() == 6


# --- byte-exact files ---------------------------------------------------------------------------


def test_stbytes_is_a_valid_aligned_safetensors_file():
    from safetensors.numpy import load

    tensors = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.array([1, 2], dtype=np.int64)}
    data = to_bytes(tensors, {"format": "pt"})
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    header = json.loads(data[8 : 8 + n])
    assert list(header) == ["__metadata__", "a", "b"]
    back = load(data)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v)


@pytest.mark.parametrize("family", FAMILIES)
def test_regenerated_files_match_the_recorded_sha256(family):
    recorded = load_tiny_hashes()[family]
    got = {name: hashlib.sha256(data).hexdigest() for name, data in tiny_files(family).items()}
    assert got == recorded


@pytest.mark.parametrize("family,variant", TINY_VARIANTS)
def test_regenerated_variants_match_the_recorded_sha256(family, variant):
    recorded = load_tiny_hashes()[tiny_name(family, variant)]
    got = {name: hashlib.sha256(data).hexdigest() for name, data in tiny_files(family, variant).items()}
    assert got == recorded


# releases a family's spec gives a layout of their own (checkpoint.releases: gpt-oss's fused MXFP4)
OWN_RELEASES = [(f, fmt) for f in FAMILIES for fmt in RELEASE_FORMATS if families.spec(f).release(fmt)]


def test_tiny_hashes_file_lists_every_family():
    data = yaml.safe_load((golden_root() / "tiny-models.yaml").read_text())
    releases = [f"qwen3_moe-{f}" for f in RELEASE_FORMATS] + [f"{f}-{fmt}" for f, fmt in OWN_RELEASES]
    variants = [tiny_name(f, v) for f, v in TINY_VARIANTS]
    fp8 = [f"{f}-fp8" for f in FP8_VARIANTS]  # deepseek_v3, qwen3_moe, glm5_next
    assert sorted(data["models"]) == sorted([*FAMILIES, *variants, *fp8, *releases])


@pytest.mark.parametrize("fmt", RELEASE_FORMATS)
def test_tiny_releases_match_the_recorded_sha256(fmt):
    """Each tiny quantized release (``tiny-model --quant FMT``) is byte-stable: its encoders are part of the golden."""
    got = {name: hashlib.sha256(data).hexdigest() for name, data in tiny_release_files("qwen3_moe", fmt).items()}
    assert got == load_tiny_hashes()[f"qwen3_moe-{fmt}"]


@pytest.mark.parametrize("family,fmt", OWN_RELEASES)
def test_family_releases_match_the_recorded_sha256(family, fmt):
    got = {name: hashlib.sha256(data).hexdigest() for name, data in tiny_release_files(family, fmt).items()}
    assert got == load_tiny_hashes()[f"{family}-{fmt}"]


def test_cli_writes_the_same_bytes_and_refuses_to_overwrite(tmp_path):
    runner = CliRunner()
    out = tmp_path / "m"
    res = runner.invoke(cli, ["tiny-model", "mixtral", str(out)])
    assert res.exit_code == 0, res.output
    recorded = load_tiny_hashes()["mixtral"]
    for name, digest in recorded.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
        assert digest in res.output
    again = runner.invoke(cli, ["tiny-model", "mixtral", str(out)])
    assert again.exit_code == 2  # "OUT exists" is a usage error in every command
    assert "output already exists" in again.output and "--force" in again.output
    forced = runner.invoke(cli, ["tiny-model", "mixtral", str(out), "--force", "-o", "json"])
    assert forced.exit_code == 0
    assert json.loads(forced.output)["sha256"] == recorded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp directory left behind
    bad = runner.invoke(cli, ["tiny-model", "llama", str(tmp_path / "x")])
    assert bad.exit_code == 2


# --- shapes the K-quants need, names the reference uses ----------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_rows_are_multiples_of_256(family):
    cfg = normalize_config(tiny_config(family))
    assert cfg.hidden_size % 256 == 0 and cfg.mlp.moe_intermediate_size % 256 == 0
    experts = [s for s in tensor_specs(cfg) if ".experts." in s.name]
    assert experts and all(s.shape[-1] % 256 == 0 for s in experts)  # rows of weights; biases are one row
    assert len(cfg.mlp.moe_layers) >= 2


@pytest.mark.parametrize("family", FAMILIES)
def test_specs_match_the_reference_state_dict(family):
    from ktconvert.model import build_model

    cfg = normalize_config(tiny_config(family))
    model = build_model(cfg, device="meta")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert {s.name: s.shape for s in tensor_specs(cfg)} == expected


def test_deepseek_tiny_models_have_the_features_they_stand_for():
    v2 = normalize_config(tiny_config("deepseek_v2"))
    v3 = normalize_config(tiny_config("deepseek_v3"))
    for cfg in (v2, v3):
        assert cfg.mlp.moe_layers == (1, 2) and cfg.mlp.n_shared_experts >= 1 and cfg.rope.kind == "yarn"
    assert v2.attention.q_lora_rank is None and v2.routing.topk_method == "group_limited_greedy"
    assert v3.attention.q_lora_rank and v3.routing.topk_method == "noaux_tc" and v3.routing.scoring_func == "sigmoid"
    assert v3.routing.routed_scaling_factor != 1.0 and v3.routing.n_group and v3.routing.topk_group


def test_routing_channels_are_never_written_by_residual_outputs():
    tensors = tiny_tensors("qwen2_moe")
    chans = routing_channels()
    outs = [k for k in tensors if k.endswith(("o_proj.weight", "down_proj.weight"))]
    assert outs
    for k in outs:
        assert not tensors[k][chans].any(), k
    codes = token_codes()
    assert np.all(codes[:, 0] != codes[:, 1])


# --- transformers reads what we write ----------------------------------------------------------


def _transformers_523():
    return transformers_523("config spelling is pinned to transformers 5.23")


@pytest.mark.parametrize("family", FAMILIES)
def test_config_json_is_the_spelling_transformers_writes(family, tiny_root, tmp_path):
    transformers = _transformers_523()
    cfg = transformers.AutoConfig.from_pretrained(tiny_root / family)
    cfg.save_pretrained(tmp_path)
    saved, ours = (json.loads((d / "config.json").read_text()) for d in (tmp_path, tiny_root / family))
    if families.spec(family).tiny.get("spelling") == "release":
        # the release's spelling: transformers respells or drops keys (MiniMax-M3's sparse_attention_config), and
        # both spellings must read to the same normalised config
        a, b = normalize_config(saved), normalize_config(ours)
        assert a == b  # raw is left out of the comparison
        assert saved != ours
        return
    assert saved == ours


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_every_tensor(family, tiny_root, one_thread):
    transformers = _transformers_523()
    transformers.utils.logging.disable_progress_bar()
    from ktconvert import families

    try:
        _, info = transformers.AutoModelForCausalLM.from_pretrained(tiny_root / family, output_loading_info=True)
    except ValueError:  # no causal-LM class for a multimodal wrapper (Qwen3-VL-MoE): its image-text-to-text model
        _, info = transformers.AutoModelForImageTextToText.from_pretrained(tiny_root / family, output_loading_info=True)
    # the tiny models hold the language model only: a wrapper's vision tower is the one thing allowed to be missing
    outside = families.spec(family).ignore_prefixes
    missing = [k for k in info["missing_keys"] if not (outside and k.startswith(outside))]
    assert not missing and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_tokenizer_loads_and_round_trips(tiny_root):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_root / "qwen3_moe")
    assert len(tok) == VOCAB
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    ids = tok(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    assert 10 < len(ids) < 64
    assert tok.decode(ids) == PROMPT_TEXT
    assert all(0 <= i < VOCAB - 2 for i in ids)


# --- routing margins: bf16 must not flip experts ------------------------------------------------


def _routing(model, ids):
    """Per MoE layer: selected expert ids (sorted per token) and the gap between the k-th and (k+1)-th
    candidate in the space the selection is made in (logits, or V3's biased sigmoid / V4's biased sqrtsoftplus scores)."""
    import torch

    from ktconvert.model.modules import LogitsRouter, MoEGate, RoutedExperts, TopKRouter, router_scores

    picks, gaps = [], []

    def on_experts(mod, args, out):
        picks.append(args[1].sort(dim=-1).values.clone())

    def on_gate(mod, args, out):
        h = args[0].reshape(-1, args[0].shape[-1]).float()
        if isinstance(mod, MoEGate):
            logits = mod.logits(h)
            biased = mod.scoring != "softmax"
            space = router_scores(logits, mod.scoring) + mod.e_score_correction_bias.float() if biased else logits
            k = mod.top_k
        else:
            space, k = out.float(), model.config.num_experts_per_tok
        top = space.sort(dim=-1, descending=True).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    hooks = [m.register_forward_hook(on_experts) for m in model.modules() if isinstance(m, RoutedExperts)]
    hooks += [m.register_forward_hook(on_gate) for m in model.modules() if isinstance(m, (MoEGate, TopKRouter, LogitsRouter))]
    try:
        with torch.no_grad():
            model(torch.as_tensor(ids).reshape(1, -1))
    finally:
        for h in hooks:
            h.remove()
    return picks, gaps


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_does_not_flip_any_expert_over_the_golden_prompt(family, tiny_root, one_thread):
    import torch

    from ktconvert.golden import read_golden
    from ktconvert.model import from_pretrained

    ids = read_golden(golden_root() / family).input_ids
    model = from_pretrained(tiny_root / family)
    fp32, gaps = _routing(model, ids)
    bf16, _ = _routing(copy.deepcopy(model).to(torch.bfloat16), ids)
    assert len(fp32) == len(normalize_config(tiny_config(family)).mlp.moe_layers)
    for layer, (a, b) in enumerate(zip(fp32, bf16)):
        assert torch.equal(a, b), f"{family}: bf16 changed the routing of MoE layer {layer}"
    # the design margins (see ktconvert.model.tiny): several logits, or 0.2 in the score+bias space of
    # DeepSeek-V3-style routing (a sigmoid saturates: its gaps are small in absolute terms; V4's sqrtsoftplus too)
    sigmoid = normalize_config(tiny_config(family)).routing.scoring_func != "softmax"
    assert min(gaps) > (0.2 if sigmoid else 3.0), gaps
    # every expert is used somewhere, so a fault in any expert shows in the outputs
    assert all(torch.bincount(p.flatten(), minlength=8).min() > 0 for p in fp32)


def test_v3_score_correction_bias_decides_routing_in_the_last_moe_layer(tiny_root, one_thread):
    from ktconvert.golden import read_golden
    from ktconvert.model import from_pretrained

    ids = read_golden(golden_root() / "deepseek_v3").input_ids
    model = from_pretrained(tiny_root / "deepseek_v3")
    with_bias, _ = _routing(model, ids)
    for mod in model.modules():
        if getattr(mod, "e_score_correction_bias", None) is not None:
            mod.e_score_correction_bias.zero_()
    without, _ = _routing(model, ids)
    assert not (with_bias[-1] == without[-1]).all()


@pytest.mark.parametrize("family", [f for f in FAMILIES if normalize_config(tiny_config(f)).routing.groups > 1])
def test_group_limited_routing_designates_experts_of_two_groups(family):
    """With expert groups, each token's two designated experts lie in different groups in every MoE layer, so the
    group selection never compares two groups of rejected experts (a near-tie: see tests/test_tiny_selection_gaps.py)."""
    from ktconvert.model.tiny import router_permutation

    cfg = normalize_config(tiny_config(family))
    size = cfg.num_experts // cfg.routing.n_group
    codes = token_codes(cfg.vocab_size, cfg.num_experts, cfg.routing.n_group)
    assert np.all(codes[:, 0] != codes[:, 1])
    for layer in cfg.mlp.moe_layers:
        perm = np.asarray(router_permutation(family, layer, cfg.num_experts, cfg.routing.n_group))
        assert sorted(perm) == list(range(cfg.num_experts))
        assert np.all(perm[codes[:, 0]] // size != perm[codes[:, 1]] // size), layer
