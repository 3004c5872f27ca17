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


_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
_BOS_TEMPLATE = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                          {"Sequence": {"id": "A", "type_id": 0}}],
                 "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [510], "tokens": ["<s>"]}}}


def _with_post_processor(root, tmp_path, name, post_processor, **config):
    d = _model(root, tmp_path, name)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["post_processor"] = post_processor
    (d / "tokenizer.json").write_text(json.dumps(tj))
    if config:
        tc = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**tc, **config}))
    return d


# (post-processor, tokenizer_config.json's add_* flags) -> the add_bos/add_eos llama.cpp 0.3.36's converter writes
BYTE_LEVEL_CASES = {
    # Qwen's tokenizers: a ByteLevel post-processor adds nothing, and says so
    "byte-level": (_BYTE_LEVEL, {}, (False, False)),
    # the post-processor's flags win over tokenizer_config.json's: it is what tokenizes
    "byte-level-over-config": (_BYTE_LEVEL, {"add_bos_token": True, "add_eos_token": True}, (False, False)),
    # DeepSeek's: a template after ByteLevel adds the BOS; the EOS stays false
    "byte-level-then-bos-template": ({"type": "Sequence", "processors": [_BYTE_LEVEL, _BOS_TEMPLATE]}, {}, (True, False)),
    # no post-processor: nothing said, nothing written (as before)
    "none": (None, {}, (None, None)),
}


@pytest.mark.parametrize("case", sorted(BYTE_LEVEL_CASES))
def test_add_bos_and_eos_of_a_byte_level_tokenizer_are_llama_cpps(root, tmp_path, case):
    post, config, (bos, eos) = BYTE_LEVEL_CASES[case]
    d = _with_post_processor(root, tmp_path, "m", post, **config)
    kv = _kv(convert(d, tmp_path / "o", type="F32").out / "model.gguf")
    assert kv.get("tokenizer.ggml.add_bos_token") is bos and kv.get("tokenizer.ggml.add_eos_token") is eos, case


@pytest.mark.interop
@pytest.mark.parametrize("case", ["byte-level", "byte-level-then-bos-template"])  # about 15 s each
def test_tokenizer_keys_equal_llama_cpps_own_converter(root, tmp_path, case):
    """The tokenizer.ggml.* keys and values of our GGUF against llama.cpp's convert_hf_to_gguf on the same directory
    (from the pinned llama-cpp-python sdist; skipped where it cannot be had, required under CI)."""
    import os

    import ggml_ref
    import llamacpp_convert

    post, config, _ = BYTE_LEVEL_CASES[case]
    d = _with_post_processor(root, tmp_path, "m", post, **config)
    try:
        theirs = _kv(llamacpp_convert.convert(d, tmp_path / "llama.gguf"))
    except ggml_ref.RefUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"llama.cpp's converter required under CI: {exc}")
        pytest.skip(str(exc))
    ours = _kv(convert(d, tmp_path / "o", type="F32").out / "model.gguf")

    def tok(kv):
        return {k: v for k, v in kv.items() if k.startswith("tokenizer.ggml.")}

    assert set(tok(ours)) == set(tok(theirs))
    assert {k: v for k, v in tok(ours).items() if k.startswith("tokenizer.ggml.add_")} == \
        {k: v for k, v in tok(theirs).items() if k.startswith("tokenizer.ggml.add_")}
