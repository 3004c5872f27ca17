"""``verify --kernel kt-kernel --max-memory``: a run with a budget far below the model stays inside it, counting the
whole process tree: the verify process's own peak RSS (its VmHWM) and the kernel child's (its VmHWM, in the report),
each above the fixed overhead of that process (imports, the opened model and golden; kt-kernel's import in the
child), measured in the same way in the same session."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from child_peak import run_cli
from kernel_helpers import require_kernel
from ktconvert.cli import cli
from ktconvert.formats.safetensors_write import to_bytes
from ktconvert.model import load_config
from ktconvert.model.reference import build_skeleton
from verify_helpers import Workspace

MIB = 2**20


@pytest.mark.slow
def test_streamed_kernel_run_stays_inside_a_budget_smaller_than_the_model(tmp_path, monkeypatch):
    from ktconvert.convert import convert
    from ktconvert.kernel import KernelSession
    from ktconvert.model.tiny import tiny_config

    require_kernel()
    monkeypatch.delenv("CI", raising=False)  # the golden is made here, from the synthetic model
    model = tmp_path / "m"
    model.mkdir()
    cfg = tiny_config("qwen3_moe") | {"num_local_experts": 64, "num_hidden_layers": 4, "moe_intermediate_size": 512}
    (model / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    bits = {}
    for name, t in build_skeleton(load_config(model)).state_dict().items():
        x = torch.from_numpy(rng.standard_normal(tuple(t.shape), dtype=np.float32) * 0.05)
        bits[name] = x.to(torch.bfloat16).view(torch.uint16).numpy()
    (model / "model.safetensors").write_bytes(to_bytes(bits, {"format": "pt"}, {k: "BF16" for k in bits}))
    model_f32 = 2 * sum(b.nbytes for b in bits.values())
    del bits
    golden = tmp_path / "golden"
    r = CliRunner().invoke(cli, ["golden", str(model), str(golden), "--engine", "stream", "--max-memory", "64MiB",
                                 "--prompt-ids", ",".join(str(i) for i in range(1, 17))], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    convert(model, tmp_path / "q8", type="Q8_0")
    budget = 48 * MIB
    assert model_f32 > 8 * budget
    args = ["verify", "--model", model, "--rules", Workspace.rules("qwen3_moe"), "--golden", golden,
            "--weights", tmp_path / "q8" / "model.gguf", "--kernel", "kt-kernel", "-o", "json"]
    code, base, _, err = run_cli([*args, "--max-memory", "64KiB"], timeout=600)  # opens everything, then refused
    assert code == 2 and "is below the minimum" in err, err
    code, peak, out, err = run_cli([*args, "--max-memory", budget], timeout=600)
    assert code in (0, 1), err
    report = json.loads(out)
    assert report["run"]["mode"] == "stream" and report["run"]["peak_resident_weights"] <= budget
    with KernelSession("LLAMAFILE") as s:  # the child's fixed overhead: kt-kernel imported, nothing loaded
        child_base = s.memory()["hwm"]
    child = report["kernel"]["child_peak_rss"]
    grew = (peak - base) * MIB + (child - child_base)
    print(f"verify process {base:.0f} -> {peak:.0f} MiB, kernel child {child_base / MIB:.0f} -> {child / MIB:.0f} MiB, "
          f"grew {grew / MIB:.0f} MiB in all; budget {budget / MIB:.0f} MiB, model {model_f32 / MIB:.0f} MiB float32")
    # measured on this AMD EPYC: 59 MiB in the verify process, 18 MiB in the child (the picked experts' pages of the
    # layer it maps), 77 MiB in all; the slack is for activations, the allocator and the pages of the converted file
    # the verify process reads through its memory map; an executor or child holding every layer fails by far (the
    # child alone would hold 107 MiB of Q8_0 experts)
    assert grew <= budget + 48 * MIB
