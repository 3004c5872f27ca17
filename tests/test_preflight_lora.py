"""preflight on the LoRA part of a kt-kernel launch (sglang-kt 0.7.2 flags and the seed-era ones): one test per
launch mistake, each one finding naming the flag, file, tensor or field; a correct launch (expert-only adapter with
the INT8 .kt tree, or a merged adapter through --lora-paths) gets none. Adapters and the tree are ktconvert's own
outputs (convert-lora, quantize --form kt-tree)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ktconvert.cli import cli
from ktconvert.convert import convert
from ktconvert.convert.lora import convert_lora
from ktconvert.preflight import Launch, finding_line, parse_command, preflight
from lora_helpers import fused, raw_dir

TINY = {"e": 8, "h": 256, "i": 256, "layers": (0, 1)}  # the tiny qwen3_moe


@pytest.fixture(scope="module")
def env(tiny_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("pf-lora")
    model = tiny_root / "qwen3_moe"
    convert(model, root / "tree", type="AMXINT8", format="kt-amx", form="kt-tree")
    convert(model, root / "merged-int8", type="AMXINT8", format="kt-amx")
    raw = raw_dir(root / "raw", experts=fused(**TINY))
    convert_lora(raw, root / "expert", expert_only=True)
    convert_lora(raw, root / "merged")
    return {"model": model, "root": root, "raw": raw, "tree": root / "tree", "int8": root / "merged-int8",
            "expert": root / "expert", "merged": root / "merged"}


def run(env, **kw):
    base = dict(model_path=str(env["model"]), cpuinfer="2", threadpools="2", gpu_experts="0", method="AMXINT8",
                weight_path=str(env["tree"]), max_running_requests="4")
    base.update(kw)
    return preflight(Launch(**base))


def ids(report):
    return [f.id for f in report.findings]


def test_correct_lora_launches_have_no_finding(env):
    for kw in (dict(expert_lora_path=str(env["expert"])), dict(lora_paths=[f"a={env['merged']}"]),
               dict(expert_lora_path=str(env["expert"]), max_running_requests=None)):
        r = run(env, **kw)
        assert r.findings == [], [finding_line(f) for f in r.findings]
        assert r.seconds < 1.0, r.seconds  # adapter values read, tree hashed: still under a second


@pytest.mark.parametrize("kw, expect", [
    (dict(expert_lora_path="{raw}"), "PF175"),  # raw training dir
    (dict(expert_lora_path="{raw}/fused_expert_lora.safetensors"), "PF179"),  # a single file
    (dict(expert_lora_path="{merged}"), "PF182"),  # merged adapter on the expert-only flag
    (dict(lora_paths=["{expert}"]), "PF203"),  # expert-only adapter on --lora-paths
    (dict(lora_paths=["{raw}"]), "PF175"),
    (dict(lora_paths=["{merged}/adapter_model.safetensors"]), "PF174"),
    (dict(expert_lora_path="{expert}", lora_paths=["{merged}"]), "PF171"),
    (dict(expert_lora_path="{expert}", weight_path=None), "PF178"),
    (dict(expert_lora_path="{expert}", gpu_experts="2"), "PF172"),
    (dict(expert_lora_path="{expert}", gpu_experts=None, gpu_ratio="0.5"), "PF172"),
    (dict(expert_lora_path="{expert}", max_running_requests="1"), "PF197"),
    (dict(expert_lora_path="{expert}", method="AMXBF16_SFT"), "PF198"),
    (dict(expert_lora_path="{expert}", weight_path="{int8}"), "PF199"),  # INT8 SFT reads only the .kt tree
    (dict(expert_lora_path="{expert}", kt_lora_path="{merged}"), "PF170"),
])
def test_launch_mistake(env, kw, expect):
    kw = {k: ([x.format(**env) for x in v] if isinstance(v, list) else v.format(**env) if isinstance(v, str) else v)
          for k, v in kw.items()}
    found = ids(run(env, **kw))
    assert expect in found, found



@pytest.mark.parametrize("kw, flag, expect", [
    (dict(expert_lora_path="{raw}"), "--kt-expert-lora-path", "PF175"),
    (dict(kt_lora_path="{raw}"), "--kt-lora-path", "PF175"),  # the deprecated alias is named as given
    (dict(lora_paths=["a={raw}"]), "--lora-paths", "PF175"),
    (dict(expert_lora_path="{raw}/fused_expert_lora.safetensors"), "--kt-expert-lora-path", "PF179"),
    (dict(expert_lora_path="{root}"), "--kt-expert-lora-path", "PF180"),
    (dict(lora_paths=["{merged}/adapter_model.safetensors"]), "--lora-paths", "PF174"),
    (dict(lora_paths=["{expert}"]), "--lora-paths", "PF203"),
])
def test_a_finding_about_a_flag_s_adapter_names_the_flag_then_the_path(env, kw, flag, expect):
    # the finding format is `error PFnnn --flag: ...`: the flag where the finding is placed, its value in the message
    kw = {k: ([x.format(**env) for x in v] if isinstance(v, list) else v.format(**env)) for k, v in kw.items()}
    path = next(iter(kw.values()))
    path = (path[0] if isinstance(path, list) else path).split("=", 1)[-1]
    found = [f for f in run(env, **kw).findings if f.id == expect]
    assert len(found) == 1, [finding_line(f) for f in run(env, **kw).findings]
    assert found[0].where == flag and finding_line(found[0]).startswith(f"error {expect} {flag}: {path} "), finding_line(found[0])

def test_llamafile_has_no_sft_path(env, tiny_root, tmp_path):
    convert(env["model"], tmp_path / "q8", type="Q8_0")
    r = run(env, expert_lora_path=str(env["expert"]), weight_path=str(tmp_path / "q8"), method="LLAMAFILE",
            threadpools="1", cpuinfer="1")
    assert ids(r) == ["PF173"]


def _adapter(env, tmp_path, *, experts=None, config=None):
    raw = raw_dir(tmp_path / "raw", experts=experts if experts is not None else fused(**TINY), config=config)
    convert_lora(raw, tmp_path / "exp", expert_only=True, allow_nonfinite=True)
    return tmp_path / "exp"


@pytest.mark.parametrize("case, expect", [
    ("nan", "non-finite value nan"),
    ("zero-b", "lora_B is all zero in every layer and projection"),
    ("layer-missing", "MoE layer(s) [0] have no expert LoRA"),
    ("no-alpha", "sglang-kt serves it with alpha = r = 4"),
    ("rank", "r is 8 but the expert tensors have rank 4"),
    ("rslora", "use_rslora is set"),
])
def test_adapter_content_against_the_model(env, tmp_path, case, expect):
    t = fused(**{**TINY, "layers": (1,)} if case == "layer-missing" else TINY)
    if case == "nan":
        t["layers.1.experts.gate_lora_b"][2, 3, 1] = float("nan")
    if case == "zero-b":
        t = {k: (v.zero_() if k.endswith("_b") else v) for k, v in t.items()}
    d = _adapter(env, tmp_path, experts=t)
    cfg_path = d / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    if case == "no-alpha":
        del cfg["lora_alpha"]
    if case == "rank":
        cfg["r"] = 8
    if case == "rslora":
        cfg["use_rslora"] = True
    cfg_path.write_text(json.dumps(cfg))
    r = run(env, expert_lora_path=str(d))
    lines = [finding_line(f) for f in r.findings]
    assert any(expect in x and "exp/" in x for x in lines), lines


def test_a_broken_tree_is_named(env, tmp_path):
    import shutil

    shutil.copytree(env["tree"], tmp_path / "tree")
    next((tmp_path / "tree").glob("_layer_1/_numa_0/INT8_gate_2_*quant_.kt")).write_bytes(b"\0" * 32768)
    r = run(env, expert_lora_path=str(env["expert"]), weight_path=str(tmp_path / "tree"))
    assert ids(r) == ["PF204"] and "sha256" in r.findings[0].message


def test_seed_era_flags_say_what_072_expects(env, tmp_path):
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", str(env["model"]), "--kt-weight-path",
           str(env["tree"]), "--kt-method", "AMXINT8", "--kt-cpuinfer", "2", "--kt-threadpool-count", "2",
           "--kt-num-gpu-experts", "0", "--kt-moe-lora-path", str(env["raw"] / "fused_expert_lora.safetensors"),
           "--kt-moe-lora-rank", "4", "--kt-moe-lora-alpha", "16", "--kt-moe-sft-method", "AMXINT8"]
    launch = parse_command(cmd)
    assert launch.moe_lora_rank == "4" and launch.moe_sft_method == "AMXINT8"
    res = CliRunner().invoke(cli, ["preflight", "-o", "json", "--", *cmd])
    d = json.loads(res.output)
    assert d["flag_set"] == "seed-era"
    pf116 = next(f for f in d["findings"] if f["id"] == "PF116")
    assert "--kt-expert-lora-path" in pf116["fix"] and "--lora-paths" in pf116["fix"]
    # the seed-era alpha against the adapter's config
    assert cmd[-3] == "16"
    res = CliRunner().invoke(cli, ["preflight", "-o", "json", "--", *cmd[:-3], "32", *cmd[-2:]])
    assert "PF195" in [f["id"] for f in json.loads(res.output)["findings"]]
