"""llama.cpp's KL-divergence base file (``llama-perplexity --kl-divergence-base``): ktconvert writes a golden's
logits as one (``golden --kl-base``) and reads one (``ktconvert.golden.kld.read_kl_base``); hostile base files are
one line each. The interop tests prove the format against llama.cpp's own ``llama-perplexity``, both ways."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from ktconvert.cli import cli
from ktconvert.errors import InputError
from ktconvert.golden import kld, read_golden
from ktconvert.golden.paths import golden_root
from ktconvert.model.tiny import write_tiny_model


@pytest.fixture
def no_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)


def _golden_rows():
    gold = read_golden(golden_root() / "qwen3_moe")
    return [int(i) for i in gold.input_ids.reshape(-1)], gold.logits[0]


def test_a_golden_written_as_a_base_file_reads_back_as_llamacpp_lays_it_out(tmp_path):
    ids, logits = _golden_rows()
    path = kld.write_kl_base(tmp_path / "g.kld", ids, logits)
    data = path.read_bytes()
    n_ctx, n_vocab = logits.shape
    assert data[:8] == b"_logits_" and struct.unpack("<Iii", data[8:20]) == (n_ctx, n_vocab, 1)
    rows = n_ctx - 1 - n_ctx // 2
    assert len(data) == 20 + 4 * n_ctx + 2 * rows * (2 * ((n_vocab + 1) // 2) + 4)
    base = kld.read_kl_base(path, n_vocab=n_vocab)
    assert base.prompt(0) == ids and base.n_chunk == 1 and list(base.positions) == list(range(n_ctx // 2, n_ctx - 1))
    got = kld.compare(base, 0, logits)
    # the only loss is the 16-bit step: (largest - least kept logit) / 65535 per row, half of it at most
    step = float(np.max(logits[n_ctx // 2:n_ctx - 1].max(-1) - np.maximum(logits[n_ctx // 2:n_ctx - 1].min(-1),
                                                                            logits[n_ctx // 2:n_ctx - 1].max(-1) - 16))) / 65535
    assert got["max_abs_log_prob_diff"] <= 0.5 * step + 1e-5 * 16
    assert got["top1_agreement"] == 1.0 and got["kl_mean"] < 1e-7
    # the same logits shifted by a constant are the same distribution: the same bytes
    assert kld.encode(ids, logits + 3.0)[:20 + 4 * n_ctx] == data[:20 + 4 * n_ctx]


def test_cli_golden_writes_a_base_file_beside_the_golden(tmp_path, no_ci):
    write_tiny_model("qwen3_moe", tmp_path / "m")
    res = CliRunner().invoke(cli, ["golden", str(tmp_path / "m"), str(tmp_path / "g"), "--engine", "stream",
                                   "--max-memory", "64MiB", "--prompt-ids", "1,5,9,13,17,21", "--kl-base",
                                   str(tmp_path / "g.kld")])
    assert res.exit_code == 0, res.output
    assert "llama-perplexity -m MODEL.gguf -c 6 --kl-divergence-base" in res.output
    gold = read_golden(tmp_path / "g")
    base = kld.read_kl_base(tmp_path / "g.kld", n_vocab=gold.logits.shape[-1])
    assert base.prompt(0) == [1, 5, 9, 13, 17, 21]
    assert kld.compare(base, 0, gold.logits[0])["top1_agreement"] == 1.0


def test_cli_golden_kl_base_refusals_write_nothing(tmp_path, no_ci):
    write_tiny_model("qwen3_moe", tmp_path / "m")
    base = ["golden", str(tmp_path / "m"), str(tmp_path / "g"), "--engine", "stream", "--max-memory", "64MiB"]
    short = CliRunner().invoke(cli, [*base, "--prompt-ids", "1,2", "--kl-base", str(tmp_path / "g.kld")])
    assert short.exit_code == 2 and "--kl-base needs a prompt of at least 3 tokens" in short.output, short.output
    nowhere = CliRunner().invoke(cli, [*base, "--prompt-ids", "1,2,3", "--kl-base", str(tmp_path / "no" / "g.kld")])
    assert nowhere.exit_code == 2 and "--kl-base" in nowhere.output, nowhere.output
    assert all("\n" not in r.output.strip() for r in (short, nowhere))
    assert {p.name for p in tmp_path.iterdir()} == {"m"}


def _hostile(tmp_path, name, edit):
    ids, logits = _golden_rows()
    data = bytearray(kld.encode(ids, logits))
    path = tmp_path / name
    path.write_bytes(bytes(edit(data, len(ids), logits.shape[1])))
    return path


def _put(data, at, fmt, value):
    data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return data


HOSTILE = {
    "not-a-base-file": (lambda d, n, v: b"GGUF" + bytes(d[4:]), "no _logits_ header"),
    "empty": (lambda d, n, v: b"", "no _logits_ header"),
    "truncated": (lambda d, n, v: d[:-7], "truncated"),
    "absurd-chunk-count": (lambda d, n, v: _put(d, 16, "<i", 2**31 - 1), "n_chunk 2147483647 make"),
    "negative-vocab": (lambda d, n, v: _put(d, 12, "<i", -5), "not a usable base file"),
    "context-of-two": (lambda d, n, v: _put(d, 8, "<I", 2), "not a usable base file"),
    "token-outside-vocab": (lambda d, n, v: _put(d, 20 + 4 * 3, "<i", v), f"token id {512} at position 3"),
    "nan-scale": (lambda d, n, v: _put(d, 20 + 4 * n, "<f", float("nan")), "row 0 has scale nan"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_base_files_are_one_line(tmp_path, name):
    edit, needle = HOSTILE[name]
    path = _hostile(tmp_path, f"{name}.kld", edit)
    with pytest.raises(InputError) as exc:
        kld.read_kl_base(path)
    line = exc.value.one_line()
    assert needle in line and str(path) in line and "\n" not in line, line


def test_a_base_file_of_another_model_is_refused(tmp_path):
    ids, logits = _golden_rows()
    path = kld.write_kl_base(tmp_path / "g.kld", ids, logits)
    with pytest.raises(InputError, match="vocabulary of 512 tokens, the model has 1024: the base file of another model"):
        kld.read_kl_base(path, n_vocab=1024)


# --- against llama.cpp's own llama-perplexity ------------------------------------------------------------------
N_CTX = 16


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    from ktconvert.convert import convert

    root = tmp_path_factory.mktemp("kld")
    write_tiny_model("qwen3_moe", root / "m")
    return root / "m", convert(root / "m", root / "f32", type="F32").out / "model.gguf"


def _perplexity(llama_perplexity, *args) -> str:
    from llamacpp_tools import run_tool

    # --no-repack: llama.cpp's plain CPU buffers, as tests/llamacpp_runner.py loads models (the AMX repack of an
    # Intel CPU with AMX is what that file's note is about)
    return run_tool("llama-perplexity", ["-t", "1", "-b", str(N_CTX), "-c", str(N_CTX), "--no-repack", *map(str, args)])


def _stream_logits(model, ids) -> np.ndarray:
    from ktconvert.golden.stream import compute_stream_golden

    return compute_stream_golden(model, ids, max_memory=2**30, decode_check=False).tensors["logits"][0]


@pytest.mark.interop
def test_llamacpp_base_file_reads_as_a_golden_matching_ktconverts(llama_perplexity, f32_gguf, tmp_path):
    """(a) llama-perplexity --kl-divergence-base on the tiny model's F32 GGUF: ktconvert reads the file, runs its own
    reference on the same tokens and finds the same distributions (llama.cpp F32 vs torch F32, 16-bit steps)."""
    from ktconvert.model.tinytok import PROMPT_TEXT

    model, gguf = f32_gguf
    (tmp_path / "text.txt").write_text((PROMPT_TEXT + " ") * 8)
    _perplexity(llama_perplexity, "-m", gguf, "-f", tmp_path / "text.txt", "--chunks", 1,
                "--kl-divergence-base", tmp_path / "base.kld")
    base = kld.read_kl_base(tmp_path / "base.kld", n_vocab=512)
    assert base.n_ctx == N_CTX and base.n_chunk == 1
    ids = base.prompt(0)  # as stored: the tiny vocabulary adds no BOS (llama.cpp's gpt-2 default, no add_bos_token)
    got = kld.compare(base, 0, _stream_logits(model, ids))
    assert got["top1_agreement"] == 1.0 and got["kl_mean"] < 1e-5, got
    assert got["max_abs_log_prob_diff"] < 5e-3, got


@pytest.mark.interop
def test_llamacpp_scores_a_base_file_ktconvert_wrote(llama_perplexity, f32_gguf, tmp_path):
    """(b) ktconvert's golden written as a base file: llama-perplexity --kl-divergence on the same F32 GGUF accepts
    it and reports a KL divergence near zero, with the same top token everywhere."""
    model, gguf = f32_gguf
    ids = [510] + [(7 * i + 3) % 500 + 4 for i in range(N_CTX - 1)]  # 510: the tiny vocabulary's BOS
    kld.write_kl_base(tmp_path / "ours.kld", ids, _stream_logits(model, ids))
    # llama.cpp logs from a thread of its own and never joins it: common/log.cpp's common_log_main() leaks the logger
    # on purpose, and says that lines still queued when the program exits are lost (llama-cpp-python 0.3.36's
    # vendored llama.cpp). Under load the worker can lag behind the whole tail, so the chunk's row is lost: seen
    # three times in a row once. A lost row is the logger, not the score, so the run is repeated, at most six times
    for _ in range(6):
        log = _perplexity(llama_perplexity, "-m", gguf, "--kl-divergence-base", tmp_path / "ours.kld",
                          "--kl-divergence")
        row = re.search(r"^\s*1\s+([\d.]+) ± +[\d.]+\s+(-?[\d.]+) ± +[\d.]+\s+(-?[\d.]+) ± +[\d.]+\s+[\d.]+ ± +[\d.]+ %"
                        r"\s+([\d.]+) ± +[\d.]+ %", log, re.M)
        if row is not None:
            break
    assert row is not None, log[-2000:]
    kl, same_top = float(row.group(3)), float(row.group(4))
    assert abs(kl) < 1e-4 and same_top == 100.0, row.group(0)
