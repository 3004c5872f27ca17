"""``verify --lora`` and ``golden --lora`` (issue 22 item 4) on the tiny qwen3_moe and its ``tiny-model --lora`` adapter:
the adapter applied by the reference passes against the golden made with it merged in float32 and fails against the
base golden; a zero adapter is "no effect"; a golden and an adapter that do not belong together are refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from verify_helpers import Workspace
from ktconvert.cli import cli
from ktconvert.errors import InputError
from ktconvert.golden import read_golden
from ktconvert.io import resources
from ktconvert.model.inject import EmulationOptions
from ktconvert.verify import run_verify
from numeric import assert_close

os.environ.setdefault("HF_HUB_OFFLINE", "1")
FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    pytest.importorskip("transformers")
    from ktconvert.golden.generate import generate_golden
    from ktconvert.model.tiny_lora import write_tiny_lora

    root = tmp_path_factory.mktemp("verify-lora")
    ws = Workspace(root)
    adapter = root / "adapter"
    write_tiny_lora(FAMILY, adapter)
    zero = _zero_adapter(adapter, root / "zero")
    old = os.environ.pop("CI", None)
    try:
        generate_golden(ws.model(FAMILY), root / "g-lora", lora=adapter)
        generate_golden(ws.model(FAMILY), root / "g-zero", lora=zero)
    finally:
        if old is not None:
            os.environ["CI"] = old
    return {"ws": ws, "root": root, "adapter": adapter, "zero": zero, "model": ws.model(FAMILY),
            "q8": ws.gguf(FAMILY, "Q8_0"), "rules": ws.rules(FAMILY), "base": ws.golden(FAMILY)}


def _zero_adapter(src, out):
    """The tiny adapter with every lora_B zero (an adapter fresh from initialisation), without the manifest whose
    hashes it no longer matches."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for name in ("fused_expert_lora.safetensors", "adapter_model.safetensors"):
        t = load_file(str(src / name))
        save_file({k: (torch.zeros_like(v) if k.endswith(("_lora_b", "lora_B.weight")) else v) for k, v in t.items()},
                  str(out / name))
    (out / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
    return out


def _verify(env, golden, lora=None, weights=None, **kw):
    return run_verify(env["model"], env["rules"], golden, weights=weights or env["q8"], lora=lora, **kw)


def test_golden_records_the_adapter_and_its_effect(env):
    g = read_golden(env["root"] / "g-lora")
    lo = g.manifest["lora"]
    assert (lo["form"], lo["rank"], lo["alpha"], lo["scale"]) == ("raw-dir", 4, 8.0, 2.0)
    assert set(lo["files"]) == {"fused_expert_lora.safetensors", "adapter_model.safetensors"}
    base = read_golden(env["base"])
    assert_close(g.tensors["base_logits"], base.logits, "base logits")  # the committed base golden, made elsewhere
    moved = np.abs(g.logits - base.logits).max()
    assert moved > 0.1 and lo["effect"]["logits_max_abs_diff"] == pytest.approx(moved, abs=1e-5)
    assert read_golden(env["root"] / "g-zero").manifest["lora"]["effect"]["logits_max_abs_diff"] == 0
    assert "ktconvert tiny-model qwen3_moe <MODEL_DIR> --lora <ADAPTER> && ktconvert golden" in g.manifest["command"]
    assert "--lora <ADAPTER>" in g.manifest["command"].split("&&")[1]


def test_lora_alpha_without_lora_is_a_usage_error(env, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    for args in (["golden", str(env["model"]), str(env["root"] / "never")],
                 ["verify", "--model", str(env["model"]), "--rules", str(env["rules"]), "--golden", str(env["base"])]):
        res = CliRunner().invoke(cli, [*args, "--lora-alpha", "8"])
        assert res.exit_code == 2 and "--lora-alpha without --lora" in res.output, res.output


def test_committed_lora_golden_reproduces(env):
    """golden/qwen3_moe-lora (the gate's LoRA cases) is what golden --lora makes of the tiny model and adapter now:
    same adapter hashes, tensors within the bound test_goldens_reproduce uses (float32 kernels differ by CPU)."""
    from ktconvert.golden import golden_root

    made, committed = read_golden(env["root"] / "g-lora"), read_golden(golden_root() / "qwen3_moe-lora")
    assert committed.manifest["lora"]["sha256"] == made.manifest["lora"]["sha256"]
    assert committed.manifest["lora"]["files"] == made.manifest["lora"]["files"]
    assert set(committed.tensors) == set(made.tensors)
    for name, ref in committed.tensors.items():
        ref = ref.astype(np.float64)
        assert_close(made.tensors[name], ref, name)


def test_adapter_passes_against_merged_golden_and_fails_against_base(env):
    r = _verify(env, env["root"] / "g-lora", lora=env["adapter"])
    assert r.passed, [b.line() for b in r.breaches]
    assert r.lora["finding"] is None
    assert {p: v["verdict"] for p, v in r.lora["against_base"].items()} == {"prefill": "fail", "decode": "fail"}
    assert r.lora["against_base"]["prefill"]["max_abs_diff"] > 0.1
    # the same adapter converted to sglang's form has the same sha256 and passes too
    res = CliRunner().invoke(cli, ["convert-lora", str(env["adapter"]), str(env["root"] / "sg"),
                                   "--base-model", str(env["model"])], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert _verify(env, env["root"] / "g-lora", lora=env["root"] / "sg").passed


def test_streamed_lora_verify_is_bit_identical_to_the_resident_one(env):
    """``--lora`` under ``--max-memory``: the streamed reference adds each delta to its part's float32 weights as
    the resident one adds them to the whole model, the candidate's source applies them as it reads; same numbers."""
    from ktconvert.golden.stream import float32_bytes

    budget = float32_bytes(env["model"]) // 2
    mem = _verify(env, env["root"] / "g-lora", lora=env["adapter"])
    st = _verify(env, env["root"] / "g-lora", lora=env["adapter"], max_memory=budget)
    assert mem.run["mode"] == "resident" and st.run["mode"] == "stream"
    a, b = mem.as_dict(), st.as_dict()
    for d in (a, b):
        for k in ("run", "seconds", "notes"):
            d.pop(k)
    assert a == b and st.passed
    for x, y in zip(mem.phases, st.phases):
        assert np.array_equal(x.candidate_logits, y.candidate_logits)
        assert [v for _, v in x.forced] == [v for _, v in y.forced]


def test_streamed_kernel_lora_is_refused_before_anything_runs(env):
    from kernel_helpers import require_kernel

    require_kernel()
    res = CliRunner().invoke(cli, ["verify", "--model", str(env["model"]), "--rules", str(env["rules"]), "--golden",
                                   str(env["root"] / "g-lora"), "--lora", str(env["adapter"]), "--weights",
                                   str(_bf16_copy(env)), "--kernel", "kt-kernel", "--max-memory", "1GiB"],
                             catch_exceptions=False)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "does not stream --lora (its SFT class) yet" in lines[0], res.stderr
    assert res.stdout == ""


def test_zero_adapter_is_no_effect(env):
    r = _verify(env, env["root"] / "g-zero", lora=env["zero"])
    assert r.passed
    assert r.lora["finding"].startswith("no effect: the adapter leaves the logits unchanged")
    assert all(v["verdict"] == "pass" for v in r.lora["against_base"].values())
    assert any("no effect" in n for n in r.notes)


@pytest.mark.parametrize("case", ["base-golden-with-lora", "lora-golden-without", "other-adapter"])
def test_golden_and_adapter_that_do_not_belong_together_are_refused(env, case):
    golden, lora, names = {
        "base-golden-with-lora": (env["base"], env["adapter"], ("made without an adapter", "--lora adapter sha256")),
        "lora-golden-without": (env["root"] / "g-lora", None, ("was made with LoRA adapter sha256", "without --lora")),
        "other-adapter": (env["root"] / "g-lora", env["zero"], ("is not the golden's adapter sha256",)),
    }[case]
    with pytest.raises(InputError) as exc:
        _verify(env, golden, lora=lora)
    assert "\n" not in str(exc.value) and all(n in str(exc.value) for n in names), str(exc.value)


def test_merged_weights_pass_without_lora_and_refuse_it(env):
    from ktconvert.convert import convert

    out = convert(env["model"], env["root"] / "q8-merged", type="Q8_0", lora=env["adapter"]).out
    assert _verify(env, env["root"] / "g-lora", weights=out / "model.gguf").passed
    with pytest.raises(InputError, match="already have an adapter merged"):
        _verify(env, env["root"] / "g-lora", lora=env["adapter"], weights=out / "model.gguf")
    with pytest.raises(InputError, match="have an adapter merged .* but golden 'qwen3_moe' was made without one"):
        _verify(env, env["base"], weights=out / "model.gguf")


def test_golden_lora_of_a_fused_expert_checkpoint_is_refused(env, monkeypatch):
    from ktconvert.golden.generate import generate_golden
    from ktconvert.model.tiny import write_tiny_model
    from ktconvert.model.tiny_lora import write_tiny_lora

    monkeypatch.delenv("CI", raising=False)
    write_tiny_model("gpt_oss", env["root"] / "gpt_oss")  # saved as transformers 5 does: experts.gate_up_proj
    write_tiny_lora("gpt_oss", env["root"] / "gpt_oss-lora")
    with pytest.raises(InputError, match="keeps this checkpoint's fused experts fused") as exc:
        generate_golden(env["root"] / "gpt_oss", env["root"] / "never", lora=env["root"] / "gpt_oss-lora")
    assert ":model.layers.0.mlp.experts." in str(exc.value)


def test_an_adapter_that_does_not_fit_the_model_is_named(env):
    from ktconvert.convert.lora_merge import load_lora
    from ktconvert.model import build_model, load_config
    from ktconvert.verify.runner import _check_lora_fits

    cfg = load_config(env["model"])
    state = dict(build_model(cfg).state_dict())
    loaded = load_lora(env["adapter"], model_type=FAMILY)
    name = "model.layers.1.self_attn.o_proj.weight"
    state[name] = state[name][:, :-1]
    with pytest.raises(InputError, match=f"B @ A is \\[256, 256\\] but {name} is \\[256, 255\\]"):
        _check_lora_fits(loaded, state, cfg)
    del state[name]
    with pytest.raises(InputError, match=f"the adapter adapts {name}, which the qwen3_moe model has not"):
        _check_lora_fits(loaded, state, cfg)


def _bf16_copy(env):
    import torch
    from safetensors.torch import load_file, save_file

    out = env["root"] / "bf16"
    if not out.is_dir():
        out.mkdir()
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(env["model"] / "model.safetensors")).items()},
                  str(out / "model.safetensors"))
        (out / "config.json").write_bytes((env["model"] / "config.json").read_bytes())
    return out


def test_kernel_runs_the_expert_lora_in_its_sft_class(env):
    from kernel_helpers import require_kernel

    from ktconvert.kernel.runner import KernelRefused

    require_kernel()
    try:
        r = _verify(env, env["root"] / "g-lora", lora=env["adapter"], weights=_bf16_copy(env),
                    options=EmulationOptions(kernel="both"))
    except KernelRefused as exc:
        if "has no AMXBF16_SFT_MOE" in str(exc):
            pytest.skip(str(exc))
        raise
    assert r.passed, [b.line() for b in r.breaches]
    assert {x["method"] for x in r.kernel["layers"]} == {"AMXBF16_SFT"}
    # measured 0.0054 on the amx and avx512_bf16 variants (BF16 without an adapter: 0.0046)
    assert all(v < 0.01 for x in r.kernel["layers"] for v in x["agreement"].values()), r.kernel
    assert {v["verdict"] for v in r.lora["against_base"].values()} == {"fail"}


def test_kernel_lora_on_weights_without_an_sft_path_is_refused(env):
    from kernel_helpers import require_kernel
    from ktconvert.kernel.runner import KernelRefused

    require_kernel()
    with pytest.raises(KernelRefused, match="LLAMAFILE weights \\(layer 0\\) have no SFT path"):
        _verify(env, env["root"] / "g-lora", lora=env["adapter"], options=EmulationOptions(kernel="kt-kernel"))


def test_golden_merge_of_a_bf16_model_stays_float32(env, tmp_path):
    """--to hf writes a merged weight in its stored type, so golden --lora merges into a float32 copy of a bf16 model."""
    import torch
    from safetensors.torch import load_file

    from ktconvert.convert import convert
    from ktconvert.convert.lora_merge import load_lora
    from ktconvert.formats.lora_delta import lora_delta
    from ktconvert.golden.generate import _float32_copy

    src = _float32_copy(_bf16_copy(env), tmp_path / "f32")
    out = convert(src, tmp_path / "merged", type="F32", format="hf", lora=env["adapter"]).out
    merged = load_file(str(out / "model.safetensors"))
    base = load_file(str(_bf16_copy(env) / "model.safetensors"))
    deltas = load_lora(env["adapter"], model_type=FAMILY).deltas
    for name in ("model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
        assert merged[name].dtype == torch.float32
        want = base[name].float().numpy() + lora_delta(deltas[name])
        assert np.array_equal(merged[name].numpy(), want)


def test_cli_json_carries_the_adapter(env):
    import jsonschema

    res = CliRunner().invoke(cli, ["verify", "--model", str(env["model"]), "--rules", str(env["rules"]),
                                   "--weights", str(env["q8"]), "--golden", str(env["root"] / "g-lora"),
                                   "--lora", str(env["adapter"]), "-o", "json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    jsonschema.Draft202012Validator(resources.load_schema("verify-report")).validate(d)
    assert d["lora"]["sha256"] == read_golden(env["root"] / "g-lora").manifest["lora"]["sha256"]
    assert d["lora"]["golden_effect"]["logits_max_abs_diff"] > 0.1
