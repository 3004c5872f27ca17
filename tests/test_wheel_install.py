"""The built wheel carries its schemas and rule data: an installed ktconvert works away from any checkout."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

from conftest import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)]
    if importlib.util.find_spec("setuptools") is not None:
        cmd.insert(4, "--no-build-isolation")  # offline and fast when the build backend is already here
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    (whl,) = out.glob("ktconvert-*.whl")
    return whl


def test_wheel_contains_schemas_and_rules(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "ktconvert/_schemas/optimize-rules.schema.json" in names
    assert "ktconvert/_schemas/operator-catalog.schema.json" in names
    assert "ktconvert/_rules/catalog/ktransformers.yaml" in names
    assert "ktconvert/_rules/lint-checks.yaml" in names
    assert "ktconvert/_rules/kernels/kt-llamafile.yaml" in names  # what LLAMAFILE runs: preflight and check-rules read it
    assert "ktconvert/_schemas/kt-llamafile-types.schema.json" in names
    assert "ktconvert/_golden/tiny-models.yaml" in names
    assert {f"ktconvert/_golden/{d.name}/golden.safetensors" for d in (REPO / "golden").iterdir() if d.is_dir()} <= names
    assert {f"ktconvert/_rules/optimize/{f.name}" for f in (REPO / "rules" / "optimize").glob("*.yaml")} <= names


def test_installed_wheel_checks_rules_from_its_own_data(wheel, tmp_path):
    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with zipfile.ZipFile(wheel) as zf:  # a wheel install is an unzip into site-packages
        zf.extractall(site)
    # third-party dependencies come from the running environment; ktconvert itself only from the wheel
    deps = sysconfig.get_paths()["purelib"]
    with open(os.path.join(site, "_deps.pth"), "w") as fh:
        fh.write(deps + "\n" + sysconfig.get_paths()["platlib"] + "\n")
    code = ("import ktconvert, ktconvert.io.resources as r; print(ktconvert.__file__); print(r.rules_dir());"
            "from ktconvert.cli import main; main(['check-rules', '--strict', str(r.rules_dir() / 'optimize')])")
    run = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    assert run.returncode == 0, run.stdout + run.stderr
    where, rules_dir = run.stdout.splitlines()[:2]
    assert where.startswith(site) and rules_dir.startswith(site)
    assert "0 error(s), 0 warning(s)" in run.stdout
