"""Counts and sizes read from a file are checked before anything is allocated or looped over (issue 31).

One validator (``ktconvert.families.limits``) refuses an impossible or absurd count the same way in every command:
exit 3, one line naming config.json (or the GGUF) and the field. Peak memory stays bounded whatever a field claims:
each hostile field runs the CLI in a child process whose own peak RSS (its VmHWM, tests/child_peak.py) is held under a bound, and a
hypothesis fuzz over config.json numeric fields and GGUF KV counts holds the traced Python allocations of the
readers under a bound.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from child_peak import run_cli
from ktconvert.cli import cli
from ktconvert.errors import InputError

FAMILY = "qwen3_moe"
ARCH = "qwen3moe"


@contextmanager
def _headroom(limit: int = 1 << 30):
    """In-process runs get at most ``limit`` more bytes of address space, so that a regression fails with a
    MemoryError instead of taking the test process (and the machine it shares) down with it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        with open("/proc/self/statm") as fh:
            vm = int(fh.read().split()[0]) * resource.getpagesize()
    except OSError:  # not Linux: no guard
        yield
        return
    cap = vm + limit if hard == resource.RLIM_INFINITY else min(vm + limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from ktconvert.model.tiny import write_tiny_model

    out = tmp_path_factory.mktemp("counts") / FAMILY
    write_tiny_model(FAMILY, out)
    return out


@pytest.fixture(scope="module")
def gguf(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("counts-gguf") / "q8"
    res = CliRunner().invoke(cli, ["quantize", str(model), str(out), "--type", "Q8_0"])
    assert res.exit_code == 0, res.output
    return out / "model.gguf"


def _with_config(model: Path, dst: Path, **fields) -> Path:
    """A copy of the tiny model (weights linked, not copied) with config.json fields replaced."""
    dst.mkdir()
    for f in model.iterdir():
        if f.name != "config.json":
            os.symlink(f, dst / f.name)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _patch_kv(gguf_bytes: bytes, key: str, value: int) -> bytes:
    """The GGUF with the integer KV ``key`` set to ``value`` (same type, same size: nothing else moves)."""
    b = bytearray(gguf_bytes)
    k = key.encode()
    i = b.find(struct.pack("<Q", len(k)) + k)
    assert i >= 0, key
    j = i + 8 + len(k)
    fmt = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[struct.unpack_from("<I", b, j)[0]]
    bits = 8 * struct.calcsize(fmt)
    lo, hi = (0, 2 ** bits - 1) if fmt[-1] in "IQ" else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    struct.pack_into(fmt, b, j + 4, min(max(value, lo), hi))
    return bytes(b)


def _commands(src: Path, out: Path) -> dict[str, list[str]]:
    return {
        "inspect": ["inspect", str(src)],
        "check-rules": ["check-rules", "--model", str(src), "--explain", "rules/optimize/qwen3_moe.yaml"],
        "preflight": ["preflight", "--model-path", str(src)],
        "quantize": ["quantize", str(src), str(out), "--type", "Q8_0"],
    }


IMPOSSIBLE = {
    # field: (value, what the line says)
    "hidden_size": (0, "hidden_size=0 must be at least 1"),
    "num_hidden_layers": (-1, "num_hidden_layers=-1 must be at least 1"),
    "num_experts_per_tok": (9, "num_experts_per_tok=9 must be in 1..8"),
    "vocab_size": (0, "vocab_size=0 must be at least 1"),
    "num_attention_heads": (1.5, "num_attention_heads must be an integer, got 1.5"),
    "num_local_experts": (10 ** 12, "num_local_experts=1000000000000 must be at most 8192"),
    "max_position_embeddings": (10 ** 15, "must be at most 268435456"),
    "head_dim": (float("inf"), "head_dim must be an integer, got inf"),  # JSON Infinity (found by the fuzz)
}


@pytest.mark.parametrize("field", sorted(IMPOSSIBLE))
def test_impossible_config_refused_the_same_by_every_command(model, tmp_path, monkeypatch, field):
    """hidden_size 0, num_hidden_layers -1, top-k above the expert count...: each command used to differ (exit 0
    from inspect, findings from check-rules, an internal error from quantize); now one line, exit 3, nothing
    written, the same words everywhere."""
    monkeypatch.chdir(Path(__file__).parents[1])
    value, says = IMPOSSIBLE[field]
    src = _with_config(model, tmp_path / "m", **{field: value})
    lines = set()
    for name, args in _commands(src, tmp_path / "out").items():
        with _headroom():
            res = CliRunner().invoke(cli, args)
        err = res.stderr.strip().splitlines()
        assert res.exit_code == 3, (name, res.output)
        assert len(err) == 1 and err[0].startswith("ktconvert: error: "), (name, res.stderr)
        assert f"config.json:{field}: " in err[0] and says in err[0], (name, err[0])
        lines.add(err[0].split(f"config.json:{field}: ", 1)[1])
    assert len(lines) == 1, lines  # the same message from every command
    assert not (tmp_path / "out").exists()


def _peak_rss_mib(args: list[str], tmp_path: Path) -> tuple[int, float, str]:
    """Run the CLI in a child process: its exit code, its own peak RSS (tests/child_peak.py) and stderr, under a
    4 GiB address-space limit so that a regression cannot take the machine down with it."""
    code, peak, _, err = run_cli(args, address_space=4 << 30)
    return code, peak, err


RSS_BOUND_MIB = 600  # a CLI run on the tiny model peaks near 150-250 MiB (torch imported); the fields below took 2.5+ GiB

CONFIG_FIELDS = {
    "num_hidden_layers": ("inspect", 10 ** 9),
    "num_local_experts": ("quantize", 10 ** 12),
    "hidden_size": ("check-rules", 10 ** 9),
    "vocab_size": ("preflight", 10 ** 12),
}


@pytest.mark.parametrize("field", sorted(CONFIG_FIELDS))
def test_peak_rss_bounded_per_config_field(model, tmp_path, field):
    cmd, value = CONFIG_FIELDS[field]
    src = _with_config(model, tmp_path / "m", **{field: value})
    code, rss, err = _peak_rss_mib(_commands(src, tmp_path / "out")[cmd], tmp_path)
    assert code == 3 and f"config.json:{field}: " in err and "must be at most" in err, err
    assert rss < RSS_BOUND_MIB, f"{cmd} with {field}={value} peaked at {rss:.0f} MiB"


@pytest.mark.parametrize("key,value", [("block_count", 2 ** 31), ("expert_count", 2 ** 40),
                                       ("embedding_length", 2 ** 32 - 1), ("expert_used_count", 99)])
def test_peak_rss_bounded_per_gguf_count(gguf, tmp_path, key, value):
    """A 4 MiB GGUF whose block_count says 2^31 took inspect past 2.5 GiB from its header alone."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_patch_kv(gguf.read_bytes(), f"{ARCH}.{key}", value))
    code, rss, err = _peak_rss_mib(["inspect", str(bad)], tmp_path)
    assert code == 3 and f"bad.gguf:{ARCH}.{key}: " in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert rss < RSS_BOUND_MIB, f"inspect with {key}={value} peaked at {rss:.0f} MiB"


def test_golden_prompt_longer_than_the_model_refused_first(model, tmp_path, monkeypatch):
    """30,000 prompt ids against max_position_embeddings 256 went past 2.5 GiB; refused before the model is built."""
    monkeypatch.delenv("CI", raising=False)
    ids = ",".join(["5"] * 30000)
    with _headroom():
        res = CliRunner().invoke(cli, ["golden", str(model), str(tmp_path / "g"), "--prompt-ids", ids])
    assert res.exit_code == 3, res.output
    line = res.stderr.strip()
    assert "config.json:max_position_embeddings: the prompt has 30000 tokens" in line and "at most 256" in line
    assert not (tmp_path / "g").exists()


def test_check_rules_tree_for_a_config_alone_is_bounded(model, tmp_path, monkeypatch):
    """check-rules --model builds the module tree from the config alone: layers x experts beyond any released model
    by a wide margin is refused naming both fields, before the walk."""
    monkeypatch.chdir(Path(__file__).parents[1])
    src = _with_config(model, tmp_path / "m", num_hidden_layers=1000, num_local_experts=8000)
    with _headroom():
        res = CliRunner().invoke(cli, _commands(src, tmp_path / "out")["check-rules"])
    assert res.exit_code == 3, res.output
    assert "config.json:num_local_experts: num_local_experts=8000 experts in each of 1000 layers" in res.stderr
    assert "more than 131072" in res.stderr


# --- fuzz: any numeric value in any count field, of config.json or of a GGUF's KVs --------------------------------

# traced Python allocations of one example: the largest module tree the limits accept (2^17 expert modules) peaks
# near 170 MiB; the unbounded readers allocated GiBs
_FUZZ_BOUND = 256 << 20
_numbers = st.one_of(st.integers(min_value=-(2 ** 63), max_value=2 ** 64), st.sampled_from([0, 1, 2, 8, 256]),
                     st.floats(allow_nan=True, allow_infinity=True), st.booleans())
_CONFIG_FIELDS = ("num_hidden_layers", "num_local_experts", "num_experts_per_tok", "hidden_size", "vocab_size",
                  "moe_intermediate_size", "max_position_embeddings", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "decoder_sparse_step")


def _bounded(fn) -> None:
    """Run ``fn``; it may refuse with InputError, nothing else, and its traced peak stays under the bound."""
    tracemalloc.start()
    try:
        with _headroom():
            fn()
    except InputError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < _FUZZ_BOUND, f"peak {peak >> 20} MiB"


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.sampled_from(_CONFIG_FIELDS), _numbers, min_size=1, max_size=3))
def test_fuzz_config_counts_memory_bounded(model, tmp_path_factory, fields):
    from ktconvert.formats.checkpoint import open_checkpoint
    from ktconvert.formats.layout import detect_layout
    from ktconvert.rules.modeltree import build_tree

    cfg = json.loads((model / "config.json").read_text())
    cfg.update(fields)
    ck = open_checkpoint(model)
    _bounded(lambda: build_tree(dict(cfg)))
    _bounded(lambda: detect_layout(ck, dict(cfg)))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.sampled_from(("block_count", "expert_count", "expert_used_count", "expert_shared_count",
                                        "embedding_length", "expert_feed_forward_length")),
                       st.integers(min_value=0, max_value=2 ** 64 - 1), min_size=1, max_size=3))
def test_fuzz_gguf_counts_memory_bounded(gguf, tmp_path_factory, kvs):
    from ktconvert.formats.checkpoint import open_checkpoint
    from ktconvert.formats.layout import detect_layout

    data = gguf.read_bytes()
    for key, value in kvs.items():
        if f"{ARCH}.{key}".encode() in data:
            data = _patch_kv(data, f"{ARCH}.{key}", value)
    path = tmp_path_factory.mktemp("fuzz") / "f.gguf"
    path.write_bytes(data)
    _bounded(lambda: detect_layout(open_checkpoint(path)))
    shutil.rmtree(path.parent)
