"""``verify --kernel kt-kernel|both``: the CPU experts computed by the real kt-kernel in a child process.

Correct Q8_0, Q4_K and BF16 GGUFs from ``ktconvert quantize`` pass under their profiles (LLAMAFILE), HF bf16
experts pass (BF16), a GGUF whose experts of one layer are in the wrong order fails at that layer, and ``both``
reports emulation-vs-kernel agreement per layer. The verify process itself never imports kt_kernel.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from kernel_helpers import require_kernel
from ktconvert.cli import cli
from ktconvert.model.inject import EmulationOptions
from ktconvert.verify import run_verify
from verify_helpers import Workspace

FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def ws(tiny_root, tmp_path_factory):
    w = Workspace(tmp_path_factory.mktemp("vk"))
    w.model = lambda family: tiny_root / family  # the session's tiny models
    return w


def _verify(ws, weights, kernel="kt-kernel", **kw):
    return run_verify(ws.model(FAMILY), ws.rules(FAMILY), ws.golden(FAMILY), weights=weights,
                      options=EmulationOptions(kernel=kernel), **kw)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "BF16"])
def test_correct_gguf_passes_through_the_kernel(ws, qtype):
    info = require_kernel()
    report = _verify(ws, ws.converted(FAMILY, qtype))
    assert report.passed, [b.line() for b in report.breaches]
    rows = report.kernel["layers"]
    assert [r["layer"] for r in rows] == [0, 1]
    assert {(r["kernel"], r["method"], r["variant"]) for r in rows} == {("kt-kernel", "LLAMAFILE", info["variant"])}
    assert "kt_kernel" not in sys.modules and "kt_kernel_ext" not in sys.modules


def _experts_reordered(src, dst, layer):
    """A copy of ``src`` whose experts of ``layer`` are stored in reverse order (every projection)."""
    from ktconvert.formats import open_checkpoint

    data = bytearray(open(src, "rb").read())
    ck = open_checkpoint(src)
    for proj in ("gate", "up", "down"):
        info = ck[f"blk.{layer}.ffn_{proj}_exps.weight"]
        per = info.nbytes // info.shape[0]
        block = bytes(data[info.offset:info.offset + info.nbytes])
        experts = [block[e * per:(e + 1) * per] for e in range(info.shape[0])]
        data[info.offset:info.offset + info.nbytes] = b"".join(reversed(experts))
    open(dst, "wb").write(bytes(data))
    return dst


def test_experts_in_the_wrong_order_fail_at_their_layer(ws, tmp_path):
    require_kernel()
    bad = _experts_reordered(ws.converted(FAMILY, "Q8_0"), tmp_path / "reordered.gguf", 1)
    report = _verify(ws, bad)
    assert not report.passed
    for phase in report.phases:
        assert phase.localization["layer"] == "layer 1", phase.localization
        assert phase.localization["module"] == "model.layers.1.mlp.experts"


def test_both_reports_agreement_per_layer(ws):
    info = require_kernel()
    report = _verify(ws, ws.converted(FAMILY, "Q8_0"), kernel="both")
    assert report.passed
    for row in report.kernel["layers"]:
        assert set(row["agreement"]) == {"prefill", "decode"}
        # measured on the avx512_bf16 variant: <= 5e-5 for Q8_0 (the emulation reproduces the kernel's activation
        # rounding); other variants (amx on Intel) are not measured, so only a finite agreement is required there
        limit = 5e-4 if info["variant"] == "avx512_bf16" else float("inf")
        assert all(0 <= v < limit for v in row["agreement"].values()), row


def test_hf_bf16_experts_run_the_bf16_method(ws, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    require_kernel()
    src = ws.model(FAMILY)
    out = tmp_path / "bf16"
    out.mkdir()
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_bytes((src / "config.json").read_bytes())
    report = _verify(ws, out)
    assert report.passed, [b.line() for b in report.breaches]
    assert {r["method"] for r in report.kernel["layers"]} == {"BF16"}


def test_refusals_before_anything_runs(ws):
    r = CliRunner().invoke(cli, ["verify", "--model", str(ws.model(FAMILY)), "--rules", str(ws.rules(FAMILY)),
                                 "--golden", str(ws.golden(FAMILY)), "--kt-weights", str(ws.model(FAMILY))])
    assert r.exit_code == 2 and "--kt-weights is read by the real kernel only" in r.output, r.output
    require_kernel()
    # float32 HF experts: no kt-kernel method reads them
    r = CliRunner().invoke(cli, ["verify", "--model", str(ws.model(FAMILY)), "--rules", str(ws.rules(FAMILY)),
                                 "--golden", str(ws.golden(FAMILY)), "--kernel", "kt-kernel"])
    assert r.exit_code == 2, r.output
    assert "kt-kernel has no method for F32 HF experts (layer 0)" in r.output
    # ktconvert's kernel-order safetensors: LLAMAFILE reads .gguf only
    st = ws.converted(FAMILY, "Q8_0", fmt="safetensors")
    r = CliRunner().invoke(cli, ["verify", "--model", str(ws.model(FAMILY)), "--rules", str(ws.rules(FAMILY)),
                                 "--golden", str(ws.golden(FAMILY)), "--weights", str(st), "--kernel", "both"])
    assert r.exit_code == 2 and "does not read ktconvert's kernel-order safetensors" in r.output, r.output


def test_json_report_names_the_kernel_and_fits_the_schema(ws):
    import jsonschema

    from ktconvert.io import resources

    require_kernel()
    r = CliRunner().invoke(cli, ["verify", "--model", str(ws.model(FAMILY)), "--rules", str(ws.rules(FAMILY)),
                                 "--golden", str(ws.golden(FAMILY)), "--weights", str(ws.converted(FAMILY, "Q4_K")),
                                 "--kernel", "both", "-o", "json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    jsonschema.Draft202012Validator(resources.load_schema("verify-report")).validate(d)
    assert d["options"]["kernel"] == "both" and d["kernel"]["layers"][0]["method"] == "LLAMAFILE"
    assert np.isfinite(d["kernel"]["layers"][0]["agreement"]["decode"])


@pytest.fixture(scope="module")
def ktamx_dirs(ws, tmp_path_factory):
    """kt-amx directories (2 numa parts) of the tiny model's experts, written by kt-kernel's own quantizer."""
    from ktconvert.kernel.kttree import ktamx_by_kernel

    require_kernel()
    root = tmp_path_factory.mktemp("amx")
    return {m: (ktamx_by_kernel(ws.model(FAMILY), root / m, m, 2), root / m)[1] for m in ("AMXINT8", "AMXINT4")}


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
def test_ktamx_dir_passes_through_the_amx_method(ws, ktamx_dirs, method):
    report = _verify(ws, None, kt_weights=ktamx_dirs[method])  # --tolerance auto: the method's profile
    assert report.profile.name == f"kt-{method.lower()}"
    assert report.passed, [b.line() for b in report.breaches]
    assert {(r["method"], r["threadpools"]) for r in report.kernel["layers"]} == {(method, 2)}


def test_ktamx_dir_with_swapped_numa_parts_fails_at_that_layer(ws, ktamx_dirs, tmp_path):
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "swapped"
    bad.mkdir()
    for f in sorted(ktamx_dirs["AMXINT8"].glob("*.safetensors")):
        tensors = load_file(str(f))
        for e in range(8):
            a, b = f"blk.1.ffn_gate_exps.{e}.numa.0.weight", f"blk.1.ffn_gate_exps.{e}.numa.1.weight"
            if a in tensors:
                tensors[a], tensors[b] = tensors[b], tensors[a]
        save_file(tensors, str(bad / f.name))
    report = _verify(ws, None, kt_weights=bad, profile="kt-amxint8")
    assert not report.passed
    for phase in report.phases:
        assert phase.localization["layer"] == "layer 1", phase.localization


def test_incomplete_ktamx_dir_is_refused_before_loading(ws, ktamx_dirs, tmp_path):
    from ktconvert.kernel import KernelRefused

    bad = tmp_path / "partial"
    bad.mkdir()
    first = sorted(ktamx_dirs["AMXINT8"].glob("*.safetensors"))[0]
    (bad / first.name).write_bytes(first.read_bytes())  # layer 0 only
    with pytest.raises(KernelRefused, match="the kt-amx directory has no layer 1"):
        _verify(ws, None, kt_weights=bad, profile="kt-amxint8")


def test_unusable_kt_weights_are_one_line_errors_before_any_child(ws, tmp_path):
    args = ["verify", "--model", str(ws.model(FAMILY)), "--rules", str(ws.rules(FAMILY)), "--golden",
            str(ws.golden(FAMILY)), "--kernel", "kt-kernel", "--kt-weights"]
    f = tmp_path / "file.safetensors"
    f.write_bytes(b"")
    r = CliRunner().invoke(cli, [*args, str(f)])
    assert r.exit_code == 3 and f"{f}: not a directory" in r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    r = CliRunner().invoke(cli, [*args, str(empty)])
    assert r.exit_code == 3 and "no .safetensors files" in r.output and "pass the directory the kt-amx converter wrote" in r.output


def test_ktamx_scan_and_kt_tree_errors_name_the_file(tmp_path):
    from safetensors.numpy import save_file

    from ktconvert.errors import InputError
    from ktconvert.formats.kt_amx_dir import scan_ktamx_dir
    from ktconvert.kernel.kttree import merge_kt_tree

    d = tmp_path / "dup"
    d.mkdir()
    for i in (0, 1):
        save_file({"blk.0.ffn_up_exps.0.numa.0.weight": np.zeros(4, np.int8)}, str(d / f"s{i}.safetensors"))
    with pytest.raises(InputError, match=r"s1\.safetensors:blk\.0\.ffn_up_exps\.0\.numa\.0\.weight: tensor also in"):
        scan_ktamx_dir(d)
    tree = tmp_path / "tree" / "_layer_0" / "_numa_0"
    tree.mkdir(parents=True)
    (tree / "INT8_up_0_64Byte_quant_.kt").write_bytes(b"\0" * 10)
    with pytest.raises(InputError, match="10 bytes, the name says 64"):
        merge_kt_tree(tmp_path / "tree", tmp_path / "out")
    (tree / "INT8_up_0_64Byte_quant_.kt").unlink()
    (tree / "stray.kt").write_bytes(b"")
    with pytest.raises(InputError, match="not a kt-kernel .kt file name"):
        merge_kt_tree(tmp_path / "tree", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written on a bad tree


def test_a_rule_file_without_cpu_experts_runs_nothing_in_the_kernel_and_says_so(ws, tmp_path):
    require_kernel()
    rules = tmp_path / "torch-experts.yaml"
    text = ws.rules(FAMILY).read_text().replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertsTorch"')
    rules.write_text(text.replace('generate_device: "cpu"\n      generate_op: "KExpertsTorch"\n      out_device: "cuda"',
                                  'generate_device: "cuda"\n      generate_op: "KExpertsTorch"'))
    r = CliRunner().invoke(cli, ["verify", "--model", str(ws.model(FAMILY)), "--rules", str(rules), "--golden",
                                 str(ws.golden(FAMILY)), "--weights", str(ws.converted(FAMILY, "Q8_0")),
                                 "--kernel", "kt-kernel"])
    assert r.exit_code == 0, r.output
    assert "CPU experts by kt-kernel: none" in r.output


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
def test_ktconverts_own_kt_amx_output_passes_through_the_kernel(ws, ktamx_dirs, tmp_path, method):
    """End to end: `quantize --to kt-amx` writes what kt-kernel's quantizer writes, and the kernel runs it within
    the method's profile."""
    from ktconvert.convert import convert
    from ktconvert.formats import open_checkpoint

    out = tmp_path / method
    convert(ws.model(FAMILY), out, type=method, format="kt-amx", threadpool_count=2)
    ours, theirs = open_checkpoint(out), open_checkpoint(ktamx_dirs[method])
    experts = sorted(n for n in theirs if ".numa." in n)
    assert experts and sorted(n for n in ours if ".numa." in n) == experts
    assert all(np.array_equal(ours.read(n), theirs.read(n)) for n in experts)
    report = _verify(ws, None, kt_weights=out)
    assert report.passed, [b.line() for b in report.breaches]
    assert {(r["method"], r["threadpools"]) for r in report.kernel["layers"]} == {(method, 2)}


@pytest.fixture(scope="module")
def bf16_dir(ws, tmp_path_factory):
    """The tiny model's weights stored as bf16 safetensors (kt-kernel's BF16 method reads its experts)."""
    import torch
    from safetensors.torch import load_file, save_file

    src = ws.model(FAMILY)
    out = tmp_path_factory.mktemp("bf16")
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_bytes((src / "config.json").read_bytes())
    return out


def _minimum(ws, kw: dict, kernel: str) -> int:
    """The least --max-memory the streamed candidate runs in (its refusal names it; no reference built)."""
    import re

    from ktconvert.errors import UsageProblem

    kw = {k: v for k, v in kw.items() if k != "kernel"}
    with pytest.raises(UsageProblem) as exc:
        _verify(ws, kernel=kernel, localize=False, max_memory=1, **kw)
    return int(re.search(r"\((\d+) bytes\)", exc.value.message).group(1))


def _without_run(report) -> dict:
    """The report's numbers and findings, not how the run held its weights (nor its time or the child's RSS)."""
    d = report.as_dict()
    for k in ("run", "seconds", "notes"):
        d.pop(k)
    d["kernel"] = {k: v for k, v in d["kernel"].items() if k != "child_peak_rss"}
    return d


@pytest.mark.parametrize("case", ["Q8_0", "Q8_0-both", "BF16", "AMXINT8", "AMXINT4"])
def test_streamed_kernel_verify_is_bit_identical_to_the_resident_one(ws, request, case):
    """``--max-memory`` with the real kernel: the child loads each layer's experts when the layer's part starts and
    frees them when it ends; the kernel computes the same either way, so every number is the resident run's."""
    from ktconvert.golden.stream import float32_bytes

    require_kernel()
    kw = {"weights": ws.converted(FAMILY, "Q8_0")} if case.startswith("Q8_0") else \
        {"weights": request.getfixturevalue("bf16_dir")} if case == "BF16" else \
        {"weights": None, "kt_weights": request.getfixturevalue("ktamx_dirs")[case]}
    if case.endswith("-both"):  # the emulation runs beside the kernel: its decoded experts count in the budget too
        kw["kernel"] = "both"
    # half the float32 model, or the candidate's minimum where that is more (HF BF16: this process keeps the layer's
    # stored experts, the child its copy and the staging while it loads), still below the model
    budget = max(float32_bytes(ws.model(FAMILY)) // 2, _minimum(ws, kw, kw.get("kernel", "kt-kernel")))
    resident = _verify(ws, **kw)
    streamed = _verify(ws, **kw, max_memory=budget)
    assert resident.run["mode"] == "resident" and streamed.run["mode"] == "stream"
    assert streamed.run["max_memory"] == budget < float32_bytes(ws.model(FAMILY))
    assert 0 < streamed.run["peak_resident_weights"] <= budget  # the kernel child's layer counted in
    assert _without_run(streamed) == _without_run(resident)
    for a, b in zip(resident.phases, streamed.phases):
        assert np.array_equal(a.candidate_logits, b.candidate_logits)
    assert resident.passed, [b.line() for b in resident.breaches]
    assert {r["method"] for r in streamed.kernel["layers"]} == {"LLAMAFILE" if case.startswith("Q8_0") else case}
    assert len(streamed.kernel["layers"]) == 2  # one row per layer, however often the part loaded it
    assert streamed.kernel["child_peak_rss"] > 0


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
def test_streamed_kernel_verify_of_picked_experts_is_bit_identical_to_the_resident_one(ws, ktamx_dirs, method,
                                                                                      monkeypatch):
    """A streamed run holds a kt-amx layer over 1 GiB as the experts each forward picks (here every layer: the
    threshold is set to 0; 4 experts of 8 held, tokens in groups whose picks fit): every number is the resident
    run's, which loads each layer whole."""
    from ktconvert.golden.stream import float32_bytes
    from ktconvert.kernel.runner import KernelSession
    from ktconvert.kernel.verify_op import KernelRuntime

    monkeypatch.setattr(KernelRuntime, "WHOLE_LAYER_BYTES", 0)
    held, load = [], KernelSession.load_ktamx_layer

    def spy(self, *a, **kw):
        held.append(kw.get("capacity"))
        return load(self, *a, **kw)

    monkeypatch.setattr(KernelSession, "load_ktamx_layer", spy)
    kw = {"weights": None, "kt_weights": ktamx_dirs[method]}
    resident = _verify(ws, **kw)
    assert held and set(held) == {None}
    held.clear()
    budget = max(float32_bytes(ws.model(FAMILY)) // 2, _minimum(ws, kw, "kt-kernel"))
    streamed = _verify(ws, **kw, max_memory=budget)
    assert held and set(held) == {4}  # 2 * top_k of the 8 experts
    assert _without_run(streamed) == _without_run(resident)
    for a, b in zip(resident.phases, streamed.phases):
        assert np.array_equal(a.candidate_logits, b.candidate_logits)
    assert resident.passed, [b.line() for b in resident.breaches]


def test_budget_below_the_kernel_layer_is_refused_naming_the_child(ws):
    """The kernel child's memory counts against --max-memory: a budget the emulation would fit but the kernel's
    layer does not is refused before anything runs, naming the minimum and the kernel child (the candidate's
    minimum: without localisation the reference, whose embedding needs more here, is not built)."""
    from ktconvert.errors import UsageProblem

    require_kernel()
    gguf = ws.converted(FAMILY, "Q8_0")

    emulated = _minimum(ws, {"weights": gguf}, "emulate")
    kernel = _minimum(ws, {"weights": gguf}, "kt-kernel")
    with pytest.raises(UsageProblem) as exc:
        _verify(ws, gguf, kernel="kt-kernel", localize=False, max_memory=kernel - 1)
    line = exc.value.message
    assert "layer" in line and "the kt-kernel child holding its packed experts" in line and f"({kernel} bytes)" in line
    # LLAMAFILE: the child maps the layer's Q8_0 blocks; the emulation decodes one expert at a time
    assert kernel > emulated
    _verify(ws, gguf, kernel="kt-kernel", localize=False, max_memory=kernel)  # the minimum itself runs


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
def test_ktamx_kernel_minimum_does_not_hold_the_models_stored_experts(ws, ktamx_dirs, method):
    """With ``--kt-weights`` the kernel reads its experts from the kt-amx directory and nothing decodes the
    --model's own: the candidate's operators hold its child's layer, not also the safetensors layer stacked in this
    process (a Qwen3-30B-shaped AMXINT8 layer was refused at 1 GiB for that: 578 MiB in the child plus 1.2 GB of
    BF16 experts here). ``both`` runs the emulation, so it still reads and counts them."""
    from ktconvert.kernel.verify_op import KernelRuntime
    from ktconvert.model.ops.source import WeightSource

    require_kernel()
    kw = {"weights": None, "kt_weights": ktamx_dirs[method]}
    own = _minimum(ws, kw, "kt-kernel")
    both = _minimum(ws, kw, "both")
    from ktconvert.model import load_config

    src = WeightSource(ws.model(FAMILY), load_config(ws.model(FAMILY)))
    stored = max(sum(getattr(src.expert_blocks(layer), p).data.nbytes for p in ("gate", "up", "down"))
                 for layer in src.cfg.mlp.moe_layers)
    assert both - own >= stored  # the emulation's stacked copy (and its decoded expert) is what kt-kernel alone skips
    runtime = KernelRuntime("kt-kernel", kt_weights=ktamx_dirs[method])
    assert runtime.reads_own_files and not KernelRuntime("both", kt_weights=ktamx_dirs[method]).reads_own_files


def test_the_reference_runs_beside_the_kernel_childs_kept_slot(ws, ktamx_dirs):
    """kt-kernel frees no AMX layer's buffers: the child's slot stays allocated between the candidate's layers, so a
    streamed verify with localisation gives the reference what the budget leaves beside it, and a budget that
    cannot hold both is one line naming the child's share and the minimum (which then runs)."""
    import re

    from ktconvert.errors import UsageProblem
    from ktconvert.kernel.verify_op import KernelRuntime
    from ktconvert.model import load_config

    require_kernel()
    kw = {"kt_weights": ktamx_dirs["AMXINT8"]}
    runtime = KernelRuntime("kt-kernel", kt_weights=ktamx_dirs["AMXINT8"], streamed=True)
    kept = runtime.kept_between_layers(load_config(ws.model(FAMILY)))
    assert kept == max(runtime._layer_bytes(layer) for layer in runtime._ktamx.layers) > 0
    alone = _minimum(ws, {"weights": None, **kw}, "kt-kernel")  # the candidate's minimum (no reference built)
    with pytest.raises(UsageProblem) as exc:
        _verify(ws, None, max_memory=alone, **kw)
    line = exc.value.message
    assert "the kt-kernel child keeps" in line and "between layers" in line and "reference" in line, line
    need = int(re.search(r"\((\d+) bytes\)", line).group(1))
    assert need > alone
    report = _verify(ws, None, max_memory=need, **kw)
    assert report.run["mode"] == "stream" and report.passed, [b.line() for b in report.breaches]


def test_the_reference_gives_way_to_what_the_kernel_child_holds_measured(ws, ktamx_dirs, monkeypatch):
    """kt-kernel's child holds, beside the packed experts the plan counts between layers, working buffers sized by the
    layer's shape (39 MiB beside a 576 MiB Qwen3-30B-A3B AMXINT8 layer: the 1 GiB verify's process tree went 43-69 MiB
    over its budget). After each candidate layer the streamed reference's budget is the run's less what the children
    hold then, measured (their RSS over their RSS at start), never below the reference's minimum."""
    from ktconvert.kernel.verify_op import KernelRuntime
    from ktconvert.model import executor, load_config

    require_kernel()
    extra = 3 * 2**20  # buffers the plan cannot see, on top of what the child really holds
    real = KernelRuntime.held_now
    monkeypatch.setattr(KernelRuntime, "held_now", lambda self: real(self) + extra)
    seen = []  # the reference's budget each time one of its layers starts
    part = executor.StreamedWeights.part

    def spy(self, model, kind, layer=None):
        if isinstance(self, executor.CheckpointWeights) and kind == "layer":
            seen.append(self.budget)
        return part(self, model, kind, layer)

    monkeypatch.setattr(executor.StreamedWeights, "part", spy)
    kw = {"kt_weights": ktamx_dirs["AMXINT8"]}
    runtime = KernelRuntime("kt-kernel", kt_weights=ktamx_dirs["AMXINT8"], streamed=True)
    kept = runtime.kept_between_layers(load_config(ws.model(FAMILY)))
    budget = 8 * kept + 64 * 2**20
    report = _verify(ws, None, max_memory=budget, **kw)
    assert report.passed, [b.line() for b in report.breaches]
    layers = len(report.phases[0].layers) - 1
    assert len(seen) == layers  # prefill and decode in one pass: each layer's part once
    # before the child holds anything: the plan's count (the weights get all but the budget's reserve)
    assert seen[0] == executor.weights_budget(budget - kept)
    assert all(b <= executor.weights_budget(budget - extra) for b in seen[1:]), (budget, kept, seen)  # then measured


def test_a_kernel_child_holding_more_than_the_budget_leaves_is_said_in_the_report(ws, ktamx_dirs, monkeypatch):
    """When what the child holds, measured, leaves the reference less than its minimum, the reference still runs
    (at its minimum: there is no smaller way), and the report says by how much the run went beyond the budget,
    rather than staying silent."""
    from ktconvert.kernel.verify_op import KernelRuntime
    from ktconvert.model import load_config

    require_kernel()
    kw = {"kt_weights": ktamx_dirs["AMXINT8"]}
    runtime = KernelRuntime("kt-kernel", kt_weights=ktamx_dirs["AMXINT8"], streamed=True)
    budget = 8 * runtime.kept_between_layers(load_config(ws.model(FAMILY))) + 64 * 2**20
    clean = _verify(ws, None, max_memory=budget, **kw)
    assert not [n for n in clean.notes if "more than the plan counted" in n]
    monkeypatch.setattr(KernelRuntime, "held_now", lambda self: budget)  # the child holds it all
    report = _verify(ws, None, max_memory=budget, **kw)
    notes = [n for n in report.notes if "more than the plan counted" in n]
    assert len(notes) == 1 and "the reference ran at its minimum" in notes[0], report.notes
    assert _without_run(report) == _without_run(clean)  # the same numbers: only where the memory went differs
