"""The upstream corpus checks clean under its own backend, and single injected mistakes are found exactly.

The corpus lives in ../shared (not in a user's clone): these tests skip cleanly without it.
"""

from __future__ import annotations

import json

import pytest

from ktconvert.rules import lint, modeltree
from ktconvert.rules.catalog import load_catalog

# Files that really fail upstream, with the fact that makes them fail. Any other upstream file is expected to
# load under its own backend, so an error on one is a bug in the catalog or the checks.
_KLLAMAMODEL = ("KLlamaModel.__init__ passes `device` positionally as BaseInjectedModule's prefill_device, so the "
                "rule's prefill_device kwarg raises TypeError (multiple values for 'prefill_device') at inject (KT206)")
KNOWN_FAILING: dict[str, str] = {
    "Internlm2_5-7b-Chat-1m.yaml": _KLLAMAMODEL,
    "kt-sft/Internlm2_5-7b-Chat-1m.yaml": _KLLAMAMODEL,
}


def _check(text: str, name: str, tmp_path=None, model: str | None = None, backend: str = "auto"):
    tree = None
    if model:
        cfg = tmp_path / "config.json"
        cfg.write_text(json.dumps(modeltree.PROBE_CONFIGS[model]))
        data, where = modeltree.load_config(cfg)
        tree = modeltree.build_tree(data, "model", where)
    return lint.check_text(text, name, lint.Options(backend=backend), load_catalog(), tree)


def test_whole_corpus_has_no_errors_under_its_own_backend(corpus_dir):
    report = lint.check_paths([corpus_dir], lint.Options(), load_catalog())
    assert len(report.files) == 102
    errors = {}
    for r in report.files:
        assert r.error is None
        rel = str(__import__("pathlib").Path(r.path).relative_to(corpus_dir))
        bad = [f"{f.line}:{f.col} {f.id} {f.message}" for f in r.findings if f.severity == "error"]
        if bad:
            errors[rel] = bad
    assert set(errors) == set(KNOWN_FAILING), errors
    for rel in KNOWN_FAILING:  # failing for the stated fact alone
        assert all(" KT206 KLlamaModel " in e and "'prefill_device'" in e for e in errors[rel]), errors[rel]
    # the style warnings upstream files are known for are found
    ids = {f.id for f in report.findings}
    assert {"KT302", "KT303", "KT213", "KT304"} <= ids


def test_backend_follows_the_file_name_convention(corpus_dir):
    report = lint.check_paths([corpus_dir / "Qwen3Moe-serve.yaml", corpus_dir / "Mixtral.yaml"], lint.Options(), load_catalog())
    assert [(r.backend, r.backend_source) for r in report.files] == [("balance_serve", "file-name"), ("ktransformers", "file-name")]


def test_serve_file_under_the_other_backend_is_caught(corpus_dir):
    """The DESIGN's headline failure: a serve rule file used with local_chat."""
    text = (corpus_dir / "DeepSeek-V3-Chat-serve.yaml").read_text()
    result = _check(text, "DeepSeek-V3-Chat.yaml")  # a non-serve name: the ktransformers backend
    by_id = {}
    for f in result.findings:
        by_id.setdefault(f.id, []).append(f.message)
    assert any("kDeepseekV3MLP" in m for m in by_id["KT204"])
    # RMSNorm.forward(x, batch_size_tensor=None) falls back to plain torch: local_chat's norm(hidden_states) works
    assert not any("RMSNorm" in m for i in ("KT203", "KT204") for m in by_id.get(i, []))
    assert any("flashinfer_attn" in m for m in by_id["KT203"]) and any("KDeepseekV3MoEV2" in m for m in by_id["KT203"])
    # the comment override names the backend back
    ok = _check("# ktconvert: backend=balance_serve\n" + text, "DeepSeek-V3-Chat.yaml")
    assert [f for f in ok.findings if f.severity == "error"] == []


def _pos(text: str, anchor: str, after: int = 0) -> tuple[int, int]:
    idx = text.index(anchor, after)
    return text[:idx].count("\n") + 1, idx - (text.rfind("\n", 0, idx) + 1) + 1


APPENDED_MARLIN = """
- match:
    name: "^model\\\\.layers\\\\.([0-9])\\\\.mlp\\\\.experts$"
  replace:
    class: ktransformers.operators.experts.KTransformersExperts
    kwargs: {generate_device: "cuda:0", generate_op: "KExpertsMarlin"}
  recursive: False
"""

APPENDED_MIXTRAL = """
- match:
    name: "^model\\\\.layers\\\\..*\\\\.block_sparse_moe$"
  replace: {class: default, kwargs: {generate_device: "cuda", prefill_device: "cuda"}}
"""

# (file, old, new, expected ID, anchor in the mutated text, model family for --model or None)
MUTATIONS = [
    ("DeepSeek-V3-Chat.yaml", "experts.KTransformersExperts ", "experts.KTransformerExperts ", "KT201", "ktransformers.operators.experts.KTransformerExperts", None),
    ("DeepSeek-V3-Chat.yaml", 'generate_op: "KExpertsCPU"', 'generate_op: "KExpertCPU"', "KT202", '"KExpertCPU"', None),
    ("DeepSeek-V3-Chat.yaml", "attention.KDeepseekV2Attention", "balance_serve_attention.flashinfer_attn", "KT203", "ktransformers.operators.balance_serve_attention", None),
    ("DeepSeek-V3-Chat.yaml", "experts.KTransformersExperts ", "experts.KTransformersExpertsV2 ", "KT204", "ktransformers.operators.experts.KTransformersExpertsV2", None),
    ("Mixtral.yaml", "experts.KTransformersExperts\n", "experts.KTransformersExpertsV2\n", "KT204", "ktransformers.operators.experts.KTransformersExpertsV2", None),
    ("DeepSeek-V3-Chat.yaml", 'generate_device: "cpu"\n      generate_op: "KExpertsCPU"', 'generate_device: "cuda"\n      generate_op: "KExpertsCPU"', "KT205", '"cuda"\n      generate_op', None),
    ("DeepSeek-V3-Chat.yaml", 'out_device: "cuda"', 'out_devcie: "cuda"', "KT206", "out_devcie", None),
    ("DeepSeek-V3-Chat-amx.yaml", 'backend: "AMXInt8"', 'backend: "AMXint8"', "KT207", '"AMXint8"', None),
    ("DeepSeek-V3-Chat.yaml", 'prefill_op: "KExpertsTorch"', 'prefill_op: "None"', "KT208", '"None"', None),
    ("DeepSeek-V3-Chat.yaml", 'name: "^model.embed_tokens"\n  replace:\n    class: "default"\n    kwargs:\n      generate_device: "cpu"\n',
     'name: "^model.embed_tokens"\n  replace:\n    class: "default"\n    kwargs:\n', "KT209", "prefill_device", None),
    ("DeepSeek-V3-Chat.yaml", '"^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"', '"^model\\\\.layers\\\\.(.*\\\\.mlp\\\\.experts$"', "KT301", '"^model\\\\.layers\\\\.(', None),
    ("DeepSeek-V3-Chat.yaml", '"^model\\\\.layers\\\\..*\\\\.self_attn$"', '"^model.layers\\\\..*\\\\.self_attn$"', "KT302", '"^model.layers', None),
    ("DeepSeek-V3-Chat.yaml", 'name: "^lm_head$"', 'name: "lm_head"', "KT303", '"lm_head"', None),
    ("DeepSeek-V3-Chat-multi-gpu.yaml", "30: ", '"30": ', "KT212", '"30"', None),
    ("DeepSeek-V3-Chat.yaml", 'generate_device: "cpu"\n      generate_op', 'generate_device: "cpu"\n      generate_device: "cpu"\n      generate_op', "KT102", 'generate_device: "cpu"\n      generate_op', None),
    ("DeepSeek-V3-Chat.yaml", "recursive: False", 'recursive: "False"', "KT105", '"False"', None),
    ("DeepSeek-V3-Chat.yaml", '    class: "ktransformers.operators.models.KDeepseekV2Model"', '    class: "ktransformers.operators.models.KDeepseekV2Model"\n    device: "cuda"', "KT104", 'device: "cuda"', None),
    ("DeepSeek-V3-Chat.yaml", '    class: ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE\n', "", "KT402", 'name: "^model\\\\.layers\\\\..*\\\\.mlp$"', None),
    ("DeepSeek-V3-Chat.yaml", None, APPENDED_MARLIN, "KT304", 'name: "^model\\\\.layers\\\\.([0-9])', None),
    ("DeepSeek-V3-Chat-multi-gpu.yaml", "30: ", "70: ", "KT403", "70", "deepseek_v3"),
    ("DeepSeek-V3-Chat.yaml", None, APPENDED_MIXTRAL, "KT401", 'name: "^model\\\\.layers\\\\..*\\\\.block_sparse_moe$"', "deepseek_v3"),
]


@pytest.mark.parametrize("name,old,new,check_id,anchor,model", MUTATIONS,
                         ids=[f"{m[3]}-{m[0]}" for m in MUTATIONS])
def test_injected_mistake_is_found_at_its_line_and_column(corpus_dir, tmp_path, name, old, new, check_id, anchor, model):
    original = (corpus_dir / name).read_text()
    clean = _check(original, name, tmp_path, model)
    assert [f for f in clean.findings if f.severity == "error"] == []
    if old is None:
        mutated, start = original + new, len(original)
    else:
        assert original.count(old) >= 1, "mutation anchor vanished from the corpus file"
        start = original.index(old)
        mutated = original.replace(old, new, 1)
    result = _check(mutated, name, tmp_path, model)
    rule_start = max(mutated.rfind("- match", 0, start + 1), 0)  # anchors are searched from the mutated rule on
    expected = _pos(mutated, anchor, rule_start)
    hits = [(f.line, f.col) for f in result.findings if f.id == check_id]
    assert expected in hits, (expected, [(f.id, f.line, f.col, f.message) for f in result.findings])
    assert len(hits) == 1 + sum(1 for f in clean.findings if f.id == check_id)
