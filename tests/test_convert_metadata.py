"""GGUF metadata of an HF conversion: general.* and tokenizer keys as convert_hf_to_gguf writes them, file_type
of what is used, and one-line errors for the files they come from (nothing written)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from gguf import GGUFReader, LlamaFileType

from convert_helpers import tiny
from ktconvert.cli import cli
from ktconvert.convert import convert


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("meta")


def _model(root, tmp_path, name="My-Model-Instruct"):
    d = tmp_path / name
    shutil.copytree(tiny(root, "qwen3_moe"), d)
    return d


def _kv(path):
    r = GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def test_general_keys(root, tmp_path):
    kv = _kv(convert(tiny(root, "qwen3_moe"), tmp_path / "o", type="Q8_0").out / "model.gguf")
    assert kv["general.type"] == "model"
    # 2 layers x 8 experts x (gate, up, down) of 256x256 routed; size_label counts one expert's share
    assert kv["general.size_label"] == "8x1.1M" and kv["general.name"]
    assert kv["general.file_type"] == int(LlamaFileType.MOSTLY_Q8_0) and kv["general.quantization_version"] == 2


def test_model_card_and_tokenizer_files(root, tmp_path):
    d = _model(root, tmp_path)
    (d / "README.md").write_text("---\nlicense: apache-2.0\nbase_model: org/Base-7B\n---\n# My model\n")
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.update(add_bos_token=True, add_eos_token=False, add_sep_token=False)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    kv = _kv(convert(d, tmp_path / "o", "Q4_K_M").out / "model.gguf")
    assert kv["general.license"] == "apache-2.0"
    assert kv["general.basename"] == "My-Model" and kv["general.finetune"] == "Instruct"
    assert kv["tokenizer.chat_template"] == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert kv["tokenizer.ggml.add_bos_token"] is True and kv["tokenizer.ggml.add_eos_token"] is False
    assert kv["tokenizer.ggml.add_sep_token"] is False
    assert kv["tokenizer.ggml.bos_token_id"] == 510 and kv["tokenizer.ggml.eos_token_id"] == 511
    assert kv["tokenizer.ggml.pre"] == "gpt-2"
    # tokenizer_config.json's own template wins over chat_template.jinja, as in convert_hf_to_gguf
    tc["chat_template"] = "inline"
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    kv = _kv(convert(d, tmp_path / "o2", "Q8_0").out / "model.gguf")
    assert kv["tokenizer.chat_template"] == "inline"


def test_type_is_labelled_with_what_is_used(root, tmp_path):
    """--type Q4_K is one type everywhere, labelled as llama-quantize --pure labels it: llama-quantize takes Q4_K as
    an alias of Q4_K_M (tools/quantize/quantize.cpp's QUANT_OPTIONS), and Q3_K / Q5_K of Q3_K_M / Q5_K_M."""
    for t, ft in (("Q3_K", "MOSTLY_Q3_K_M"), ("Q4_K", "MOSTLY_Q4_K_M"), ("Q5_K", "MOSTLY_Q5_K_M"), ("Q6_K", "MOSTLY_Q6_K")):
        res = CliRunner().invoke(cli, ["quantize", str(tiny(root, "qwen3_moe")), str(tmp_path / t), "--type", t])
        assert res.exit_code == 0, res.output
        assert _kv(tmp_path / t / "model.gguf")["general.file_type"] == int(LlamaFileType[ft])


@pytest.mark.parametrize("name,content,needle", [
    ("chat_template.jinja", b"\xff\xfe{{ bad }}", "not UTF-8"),
    ("chat_template.json", b'{"chat_template": ', "not valid JSON"),
    ("chat_template.json", b'{"chat_template": 7}', "neither a string"),
    ("README.md", b"---\nlicense: [unclosed\n---\n", "front matter"),
])
def test_bad_metadata_files_are_one_line_errors(root, tmp_path, name, content, needle):
    d = _model(root, tmp_path)
    (d / name).write_bytes(content)
    res = CliRunner().invoke(cli, ["quantize", str(d), str(tmp_path / "out"), "--type", "Q8_0"])
    assert res.exit_code == 3, res.output
    line = res.output.strip()
    assert "\n" not in line and name in line and needle in line, line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
