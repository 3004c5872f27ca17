"""Devices, FIFOs and sockets are refused before anything reads them (a read would block or never end)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "ktconvert", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "pipe.yaml"
    os.mkfifo(p)
    return p


def _one_line(r, code, *parts):
    assert r.returncode == code, r.stderr + r.stdout
    text = r.stderr + r.stdout
    assert "Traceback" not in text
    assert all(p in text for p in parts), text


def test_check_rules_refuses_a_fifo_and_dev_zero(fifo):
    _one_line(_run("check-rules", fifo), 3, str(fifo), "is a FIFO, not a regular file")
    _one_line(_run("check-rules", "/dev/zero"), 3, "/dev/zero", "is a device, not a regular file")


def test_model_config_that_is_a_fifo(fifo, tmp_path):
    cfg = tmp_path / "m"
    cfg.mkdir()
    os.mkfifo(cfg / "config.json")
    _one_line(_run("check-rules", "--model", cfg, REPO / "rules" / "optimize" / "qwen3_moe.yaml"), 3,
              "config.json is a FIFO")


def test_inspect_and_quantize_refuse_a_fifo_checkpoint_and_a_fifo_shard(tmp_path, tiny_root):
    pipe = tmp_path / "w.safetensors"
    os.mkfifo(pipe)
    _one_line(_run("inspect", pipe), 3, "is a FIFO, not a regular file")
    _one_line(_run("quantize", pipe, tmp_path / "out", "--type", "Q8_0"), 3, "is a FIFO")
    assert not (tmp_path / "out").exists()
    shards = tmp_path / "shards"
    shutil.copytree(tiny_root / "qwen3_moe", shards)
    (shards / "model.safetensors").rename(shards / "model-00001-of-00002.safetensors")
    os.mkfifo(shards / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors",
                                            "model.norm.weight": "model-00001-of-00002.safetensors"}}
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    _one_line(_run("inspect", shards), 3, "model-00002-of-00002.safetensors", "is a FIFO")


def test_json_reader_refuses_a_device():
    from ktconvert.errors import InputError
    from ktconvert.io.datafile import read_json

    with pytest.raises(InputError, match="is a device, not a regular file"):
        read_json("/dev/zero", "config.json")
