"""``ktconvert doctor``: CPU features, kt-kernel's variant and methods, llama.cpp; each CI machine kind
(AMD Zen 5 without AMX, Intel Xeon with AMX) is checked against its own expectation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from ktconvert.cli import cli
from ktconvert.kernel.cpu import cpu_features, parse_cpuinfo
from ktconvert.kernel.doctor import missing

ZEN5 = """processor\t: 0
model name\t: AMD EPYC 9R45
flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16
processor\t: 1
model name\t: AMD EPYC 9R45
flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16
"""
XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16 avx_vnni amx_bf16 amx_tile amx_int8
"""


def test_cpuinfo_parsing_for_both_machine_kinds(tmp_path):
    z = parse_cpuinfo(ZEN5)
    assert z["model"] == "AMD EPYC 9R45" and z["logical_cpus"] == 2 and "amx_tile" not in z["flags"]
    (tmp_path / "cpuinfo").write_text(XEON)
    x = cpu_features(tmp_path / "cpuinfo")["features"]
    assert x["amx_tile"] and x["amx_int8"] and x["amx_bf16"] and x["avx_vnni"] and x["avx512_bf16"]
    assert cpu_features(tmp_path / "absent")["source"] is None  # no file: no features claimed


def _run_json(*args, env=None):
    res = subprocess.run([sys.executable, "-m", "ktconvert", "doctor", "-o", "json", *args], capture_output=True,
                         text=True, env=env, timeout=300)
    return res.returncode, json.loads(res.stdout)


def test_doctor_reports_this_machine_as_its_kind():
    rc, rep = _run_json("--no-llama-cpp")
    assert rc == 0
    flags = parse_cpuinfo(open("/proc/cpuinfo").read())["flags"]
    feats = rep["cpu"]["features"]
    assert feats["avx512f"] == ("avx512f" in flags) and feats["amx_int8"] == ("amx_int8" in flags)
    kt = rep["kt_kernel"]
    if not kt["available"]:
        assert kt["error"] and all(not r["runs"] for r in rep["methods"])
        return
    rows = {r["method"]: r for r in rep["methods"]}
    assert rows["LLAMAFILE"]["runs"] and rows["AMXINT8"]["runs"] and rows["AMXINT4"]["runs"]
    if "KT_KERNEL_CPU_VARIANT" not in os.environ:
        if "amx_int8" in flags and "amx_tile" in flags:  # Intel with AMX: the amx variant, AMX tiles
            assert kt["variant"] == "amx" and rows["AMXINT8"]["path"] == "AMX tiles"
        elif "avx512_bf16" in flags:  # Zen 5: avx512_bf16, AMX methods on the VNNI path
            assert kt["variant"] == "avx512_bf16" and rows["AMXINT8"]["path"].startswith("AVX-512 VNNI")


def test_require_kt_kernel_fails_when_it_cannot_be_imported(tmp_path):
    (tmp_path / "kt_kernel.py").write_text("raise ImportError('built for another CPU')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    rc, rep = _run_json("--no-llama-cpp", "--require", "kt-kernel", "--require", "LLAMAFILE", env=env)
    assert rc == 3
    assert rep["missing"][0].startswith("kt-kernel: ") and "built for another CPU" in rep["missing"][0]
    assert rep["missing"][1].startswith("LLAMAFILE: does not run here")


def test_missing_names_each_unmet_requirement():
    rep = {"cpu": {"features": {k: False for k in ("avx512f", "avx512bw", "amx_tile", "amx_int8")}},
           "kt_kernel": {"available": True, "error": None, "variant": "avx2"},
           "methods": [{"method": "AMXINT8", "runs": False}],
           "llama_cpp": {"importable": False, "error": "llama_cpp is not installed"}}
    out = missing(rep, ["avx512", "amx", "AMXINT8", "llama-cpp", "kt-kernel"])
    assert [o.split(":")[0] for o in out] == ["avx512", "amx", "AMXINT8", "llama-cpp"]
    assert "avx2 variant" in out[2]


def test_doctor_text_names_cpu_and_kernel():
    res = CliRunner().invoke(cli, ["doctor", "--no-llama-cpp"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("CPU ") and "AMX " in res.output and "kt-kernel " in res.output
