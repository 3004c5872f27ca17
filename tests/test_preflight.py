"""``ktconvert preflight``: each launch mismatch listed in docs/commands/preflight.md is caught,
one line with its fix, and a correct launch gets no finding at all. Headers only: kt-amx directories here are
synthetic (right names, dtypes and sizes, zero bytes), so these tests need no kt-kernel.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from click.testing import CliRunner

from ktconvert import families
from ktconvert.cli import cli
from ktconvert.preflight import Launch, finding_line, parse_command, preflight

E, H, I = 8, 256, 256  # the tiny qwen3_moe model: layers 0 and 1 are MoE


def write_ktamx(d, *, parts=2, bits=8, layers=(0, 1), experts=E, drop=()):
    """A kt-amx directory as the converter lays it out: one shard per layer, I8 weights and F32 scales."""
    from safetensors.numpy import save_file

    d.mkdir(parents=True)
    ip = I // parts
    for layer in layers:
        t = {}
        for p in ("gate", "up", "down"):
            rows, cols = (ip, H) if p != "down" else (H, ip)
            for e in range(experts):
                for n in range(parts):
                    base = f"blk.{layer}.ffn_{p}_exps.{e}.numa.{n}"
                    t[f"{base}.weight"] = np.zeros(rows * cols * bits // 8, dtype=np.int8)
                    t[f"{base}.scale"] = np.ones(rows, dtype=np.float32)
        for name in drop:
            t.pop(name, None)
        save_file(t, str(d / f"model-{layer:05d}.safetensors"))
    return d


@pytest.fixture(scope="module")
def env(tiny_root, tmp_path_factory):
    from ktconvert.convert import convert

    root = tmp_path_factory.mktemp("pf")
    model = tiny_root / "qwen3_moe"
    out = {"model": model, "root": root}
    for t in ("Q8_0", "Q4_1"):
        convert(model, root / t, type=t)
        out[t] = root / t
    out["int8"] = write_ktamx(root / "q3-AMXINT8-NUMA2", bits=8)
    out["int4"] = write_ktamx(root / "q3-AMXINT4-NUMA2", bits=4)
    out["int8p1"] = write_ktamx(root / "q3-AMXINT8-NUMA1", bits=8, parts=1)
    return out


def run(env, **kw):
    base = dict(model_path=str(env["model"]), cpuinfer="2", threadpools="2", gpu_experts="0")
    base.update(kw)
    return preflight(Launch(**base))


def ids(report):
    return [f.id for f in report.findings]


def test_correct_launches_have_no_finding_and_take_under_a_second(env):
    for kw in (dict(weight_path=str(env["int8"]), method="AMXINT8"),
               dict(weight_path=str(env["int4"]), method="AMXINT4"),
               dict(weight_path=str(env["Q8_0"]), method="LLAMAFILE", threadpools="1", cpuinfer="1")):
        report = run(env, **kw)
        assert report.findings == [], [finding_line(f) for f in report.findings]
        assert report.passed and report.seconds < 1.0


def test_bf16_method_on_the_bf16_release_and_not_on_f32(env, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    d = tmp_path / "bf16"
    d.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(env["model"] / "model.safetensors")).items()},
              str(d / "model.safetensors"))
    assert run(env, weight_path=str(d), method="BF16", threadpools="1", cpuinfer="1").findings == []
    bad = run(env, weight_path=str(env["model"]), method="BF16", threadpools="1", cpuinfer="1")
    assert ids(bad) == ["PF161"] and "these are F32" in bad.findings[0].message


def test_none_cpuinfer_and_none_gpu_experts_are_named(env):
    report = run(env, weight_path=str(env["int8"]), method="AMXINT8", cpuinfer=None, gpu_experts=None)
    assert ids(report) == ["PF106", "PF107"]
    assert "TypeError at load" in report.findings[0].message and "without kt-kernel" in report.findings[1].message


@pytest.mark.parametrize("dirkey,method,expect", [
    ("int8", "AMXINT4", "garbage"),  # INT8 dir under an INT4 method: loads, rel. error 3.0
    ("int4", "AMXINT8", "segfault"),  # INT4 dir under AMXINT8: crashes
])
def test_int_width_of_the_dir_against_the_method(env, dirkey, method, expect):
    report = run(env, weight_path=str(env[dirkey]), method=method)
    assert ids(report) == ["PF153"] and expect in report.findings[0].message


def test_a_dir_named_for_the_other_width_is_a_warning(env, tmp_path):
    d = write_ktamx(tmp_path / "q3-AMXINT8-NUMA2", bits=4)
    report = run(env, weight_path=str(d), method="AMXINT4")
    assert ids(report) == ["PF154"] and report.passed


@pytest.mark.parametrize("dirkey,tp,expect", [("int8", "1", "garbage"), ("int8p1", "2", "segfault")])
def test_parts_on_disk_against_threadpool_count(env, dirkey, tp, expect):
    report = run(env, weight_path=str(env[dirkey]), method="AMXINT8", threadpools=tp, cpuinfer="2")
    f = next(f for f in report.findings if f.id == "PF151")
    assert expect in f.message and f.where == "--kt-threadpool-count"


def test_a_missing_expert_and_a_wrong_size_are_named(env, tmp_path):
    d = write_ktamx(tmp_path / "partial", drop=["blk.1.ffn_down_exps.7.numa.1.scale"])
    report = run(env, weight_path=str(d), method="AMXINT8")
    assert ids(report) == ["PF155"] and "blk.1.ffn_down_exps.7.numa.1.scale" in report.findings[0].message
    from safetensors.numpy import load_file, save_file

    d2 = write_ktamx(tmp_path / "short")
    f = d2 / "model-00001.safetensors"
    t = load_file(str(f))
    t["blk.1.ffn_up_exps.3.numa.0.scale"] = np.ones(64, dtype=np.float32)
    save_file(t, str(f))
    report = run(env, weight_path=str(d2), method="AMXINT8")
    assert ids(report) == ["PF157"] and report.findings[0].where == "blk.1.ffn_up_exps.3.numa.0.scale"


def test_alignment_and_expert_counts(env):
    r = run(env, weight_path=str(env["Q8_0"]), method="LLAMAFILE", threadpools="2")
    assert "PF124" in ids(r) and "I / 256 >= threadpool count" in r.findings[ids(r).index("PF124")].message
    r = run(env, weight_path=str(env["int4"]), method="AMXINT4", threadpools="4", cpuinfer="4")
    assert "(I / threadpools) % 128" in next(f.message for f in r.findings if f.id == "PF124")
    r = run(env, weight_path=str(env["int8"]), method="AMXINT8", gpu_experts="9")
    assert ids(r) == ["PF123"]


def test_thread_counts(env):
    assert ids(run(env, weight_path=str(env["int8"]), method="AMXINT8", cpuinfer="1")) == ["PF111"]
    r = run(env, weight_path=str(env["int8"]), method="AMXINT8", cpuinfer="3")
    assert "PF112" in ids(r) and r.passed  # a warning: uneven pools still run
    r = run(env, weight_path=str(env["int8"]), method="AMXINT8", cpuinfer="100000")
    assert "PF113" in ids(r) and r.passed
    assert ids(run(env, weight_path=str(env["int8"]), method="AMXINT8", numa_nodes=["0"])) == ["PF114"]


def test_method_against_the_weight_format(env):
    r = run(env, weight_path=str(env["int8"]), method="LLAMAFILE", threadpools="1", cpuinfer="1")
    assert ids(r) == ["PF132"] and "AMXINT8 or AMXINT4" in r.findings[0].fix
    r = run(env, weight_path=str(env["Q8_0"]), method="AMXINT8")
    assert ids(r) == ["PF133"] and "LLAMAFILE" in r.findings[0].fix
    r = run(env, weight_path=str(env["Q4_1"]), method="LLAMAFILE", threadpools="1", cpuinfer="1")
    assert ids(r) == ["PF141"] and "SIGABRT" in r.findings[0].message
    r = run(env, weight_path=str(env["int8"]), method="AMXINT9")
    assert ids(r)[0] == "PF103"


def _stacked_lora(d, r=4, layers=(0, 1), nan=False, alpha=None):
    from safetensors.numpy import save_file

    d.mkdir()
    shapes = {"gate_lora_a": (E, r, H), "up_lora_a": (E, r, H), "gate_lora_b": (E, I, r), "up_lora_b": (E, I, r),
              "down_lora_a": (E, r, I), "down_lora_b": (E, H, r)}
    t = {f"layers.{L}.experts.{k}": np.zeros(s, dtype=np.float32) for L in layers for k, s in shapes.items()}
    if nan:
        t["layers.1.experts.down_lora_b"][0, 0, 0] = np.nan
    save_file(t, str(d / "fused_expert_lora.safetensors"))
    if alpha is not None:
        (d / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": alpha}))
    return d / "fused_expert_lora.safetensors"


def test_seed_era_moe_lora(env, tmp_path):
    base = dict(weight_path=str(env["int8"]), method="AMXINT8", moe_sft_method="AMXINT8",
                seed_flags=["--kt-moe-lora-path"])
    good = _stacked_lora(tmp_path / "good", alpha=8)
    r = run(env, moe_lora_path=str(good), moe_lora_rank="4", moe_lora_alpha="8", **base)
    assert ids(r) == ["PF116"] and r.passed  # only: these flags are not sglang-kt 0.7.2's
    assert "PF189" in ids(run(env, moe_lora_path=str(good), moe_lora_rank="8", moe_lora_alpha="8", **base))
    assert "PF195" in ids(run(env, moe_lora_path=str(good), moe_lora_rank="4", moe_lora_alpha="16", **base))
    nan = _stacked_lora(tmp_path / "nan", nan=True)
    assert "PF192" in ids(run(env, moe_lora_path=str(nan), moe_lora_rank="4", moe_lora_alpha="8", **base))
    half = _stacked_lora(tmp_path / "half", layers=(1,))
    assert "PF190" in ids(run(env, moe_lora_path=str(half), moe_lora_rank="4", moe_lora_alpha="8", **base))
    wide = _stacked_lora(tmp_path / "wide", r=4)
    from safetensors.numpy import load_file, save_file

    t = load_file(str(wide))
    t["layers.0.experts.up_lora_b"] = np.zeros((E, I + 8, 4), dtype=np.float32)
    save_file(t, str(wide))
    assert "PF191" in ids(run(env, moe_lora_path=str(wide), moe_lora_rank="4", moe_lora_alpha="8", **base))


def test_a_pickle_saved_as_the_lora_safetensors_is_named(env, tmp_path):
    f = tmp_path / "lora.safetensors"
    f.write_bytes(pickle.dumps({"layers.0.experts.gate_lora_a": [0.0]}, protocol=2))
    r = run(env, weight_path=str(env["int8"]), method="AMXINT8", moe_lora_path=str(f), moe_lora_rank="4",
            seed_flags=["--kt-moe-lora-path"])
    f183 = next(x for x in r.findings if x.id == "PF183")
    assert "pickle" in f183.message and f183.where == str(f)


def test_sft_method_against_the_weights(env, tmp_path):
    good = _stacked_lora(tmp_path / "l", alpha=8)
    base = dict(weight_path=str(env["int8"]), method="AMXINT8", moe_lora_path=str(good), moe_lora_rank="4",
                moe_lora_alpha="8", seed_flags=["--kt-moe-sft-method"])
    assert "PF177" in ids(run(env, moe_sft_method="AMXINT4", **base))
    assert "PF177" in ids(run(env, moe_sft_method="BF16", **base))
    assert "PF176" in ids(run(env, moe_sft_method="LLAMAFILE", **base))


def test_pasted_command_after_double_dash(env):
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", str(env["model"]), "--kt-weight-path",
           str(env["int8"]), "--kt-method", "AMXINT8", "--kt-cpuinfer", "2", "--kt-threadpool-count=2",
           "--kt-num-gpu-expert", "0", "--kt-enable-dynamic-expert-update", "--kt-numa-nodes", "0", "0",
           "--kt-max-deffered-experts-per-token", "2", "--tp", "1"]
    launch = parse_command(cmd)
    assert launch.numa_nodes == ["0", "0"] and launch.gpu_experts == "0" and launch.threadpools == "2"
    res = CliRunner().invoke(cli, ["preflight", "-o", "json", "--", *cmd])
    assert res.exit_code == 1, res.output
    d = json.loads(res.output)
    import jsonschema

    from ktconvert.io import resources

    jsonschema.Draft202012Validator(resources.load_schema("preflight-report")).validate(d)
    found = {f["id"]: f for f in d["findings"]}
    assert set(found) == {"PF115", "PF117"}
    assert found["PF115"]["fix"] == "did you mean --kt-max-deferred-experts-per-token?"
    # flags given to preflight override the pasted ones
    res = CliRunner().invoke(cli, ["preflight", "--kt-threadpool-count", "1", "--", *cmd[:13]])
    assert "PF151" in res.output and res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert lines[-1].startswith("FAIL: ") and all(x.startswith(("error ", "warning ")) for x in lines[:-1])


def test_clean_cli_run_exits_zero_and_rules_must_agree(env, tmp_path):
    args = ["preflight", "--model-path", str(env["model"]), "--kt-weight-path", str(env["int8"]), "--kt-method",
            "AMXINT8", "--kt-cpuinfer", "2", "--kt-threadpool-count", "2", "--kt-num-gpu-experts", "0"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0 and res.output.startswith("OK: 0 error(s), 0 warning(s)"), res.output
    rules = tmp_path / "r.yaml"
    rules.write_text('- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}\n'
                     '  replace: {class: ktransformers.operators.experts.KTransformersExperts,\n'
                     '            kwargs: {generate_op: KExpertsCPU, backend: llamafile}}\n')
    res = CliRunner().invoke(cli, [*args, "--rules", str(rules)])
    assert res.exit_code == 1 and "PF201" in res.output and "backend llamafile" in res.output


def test_an_unreadable_weight_file_is_one_line_exit_3(env, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    res = CliRunner().invoke(cli, ["preflight", "--model-path", str(env["model"]), "--kt-weight-path", str(bad),
                                   "--kt-method", "LLAMAFILE", "--kt-cpuinfer", "1", "--kt-threadpool-count", "1",
                                   "--kt-num-gpu-experts", "0"])
    assert res.exit_code == 3 and str(bad) in res.output


@pytest.mark.parametrize("name", [
    "blk.3.ffn_gate_exps.0.numa.1.weight", "blk.10.ffn_down_exps.255.numa.0.scale", "blk.3.ffn_gate_exps.0.numa.1.bias",
    "blk.3.ffn_gateup_exps.0.numa.1.weight", "blk.x.ffn_up_exps.0.numa.0.weight", "blk.3.ffn_up_exps.0.numa.0",
    "model.layers.3.mlp.experts.0.up_proj.weight", "blk.3.ffn_up_exps.0.numa.0.weight.x", "blk.3.ffn_up_exps.².numa.0.weight",
    "blk.3.ffn_up_exps.weight", "xblk.3.ffn_up_exps.0.numa.0.weight"])
def test_ktamx_name_parser_agrees_with_the_pattern(name):
    from ktconvert.formats.kt_amx import NAME_RE as NAME_PATTERN
    from ktconvert.formats.kt_amx import parse_name as parse_ktamx_name

    m = NAME_PATTERN.match(name)
    want = None if m is None or not all(g.isascii() for g in m.groups()) else \
        (int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)), m.group(5))
    got = parse_ktamx_name(name)
    assert (tuple(got) if got else None) == want


CLAMPED = [f for f in families.FAMILIES if families.spec(f).section("moe").get("activation")]


@pytest.mark.parametrize("family", CLAMPED)
def test_clamped_experts_under_a_method_without_the_clamp_are_refused(tiny_root, family):
    """A clamped SwiGLU family launched with a method sglang-kt does not give the clamp to would load and run with
    silu(gate) * up: PF167 names the family, its limit and the methods that compute it; under those, no PF167."""
    act = families.spec(family).section("moe")["activation"]
    model = str(tiny_root / family)
    base = dict(model_path=model, weight_path=model, cpuinfer="2", threadpools="1", gpu_experts="0")
    for method in ("AMXINT4", "BF16", "LLAMAFILE"):
        found = [f for f in preflight(Launch(method=method, **base)).findings if f.id == "PF167"]
        assert len(found) == 1 and family in found[0].message and method in found[0].message, method
        assert ("no kt-kernel 0.7.2 method" in found[0].fix) == (not act["kt_methods"])
        assert all(m in found[0].fix for m in act["kt_methods"])
    for method in act["kt_methods"]:
        assert "PF167" not in ids(preflight(Launch(method=method, **base))), method
