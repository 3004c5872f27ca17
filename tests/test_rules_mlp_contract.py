"""KT204 for MLP operators follows their real caller: a shared expert is called by its MoE block's operator, a dense
layer's MLP by the backend's decoder layer (upstream's ``KQwen2MoeMLP.forward(x, bsz_tensor)`` has no default)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ktconvert.cli import cli
from ktconvert.rules import modeltree

OPS = "ktransformers.operators"
MOE_RULES = """\
- match: {{name: "^model\\\\.layers\\\\..*\\\\.mlp$", class: transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock}}
  replace: {{class: {ops}.experts.{block}}}
- match: {{name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}}
  replace: {{class: {ops}.experts.{experts}, kwargs: {{prefill_device: cpu, generate_device: cpu}}}}
  recursive: false
- match: {{name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.shared_expert$"}}
  replace: {{class: {ops}.mlp.KQwen2MoeMLP}}
"""


def findings(tmp_path, text, *args):
    p = tmp_path / "rules.yaml"
    p.write_text(text)
    r = CliRunner().invoke(cli, ["check-rules", "-o", "json", *map(str, args), str(p)], catch_exceptions=False)
    return [(f["id"], f["rule_index"], f["message"], f["fix"]) for f in json.loads(r.output)["findings"]]


def test_shared_expert_under_a_v2_block_is_called_with_bsz_tensor(tmp_path):
    text = MOE_RULES.format(ops=OPS, block="KQwen2MoeSparseMoeBlockV2", experts="KTransformersExpertsV2")
    assert [f for f in findings(tmp_path, text, "--backend", "balance_serve") if f[0] in ("KT203", "KT204")] == []


def test_shared_expert_under_a_v1_block_misses_bsz_tensor(tmp_path):
    text = MOE_RULES.format(ops=OPS, block="KQwen2MoeSparseMoeBlock", experts="KTransformersExperts")
    got = [f for f in findings(tmp_path, text, "--backend", "ktransformers") if f[0] == "KT204"]
    assert len(got) == 1 and got[0][1] == 2, got
    assert "KQwen2MoeSparseMoeBlock (rule 0) at model.layers.0.mlp calls it without bsz_tensor" in got[0][2]
    assert "KQwen2MoeMLP needs bsz_tensor" in got[0][2] and "class: default" in got[0][3]


def test_shared_expert_under_the_models_own_block(tmp_path):
    text = MOE_RULES.format(ops=OPS, block="KQwen2MoeSparseMoeBlock", experts="KTransformersExperts")
    text = "\n".join(text.splitlines()[2:]) + "\n"  # the MoE block stays the model's own
    (tmp_path / "config.json").write_text(json.dumps(modeltree.PROBE_CONFIGS["qwen2_moe"]))
    got = [f for f in findings(tmp_path, text, "--backend", "ktransformers", "--model", tmp_path / "config.json")
           if f[0] == "KT204"]
    assert len(got) == 1 and "the model's own Qwen2MoeSparseMoeBlock at model.layers.0.mlp" in got[0][2], got


def test_dense_layer_mlp_is_called_by_the_decoder_layer(tmp_path):
    cfg = dict(modeltree.PROBE_CONFIGS["qwen3_moe"], num_hidden_layers=4, mlp_only_layers=[0])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    text = (f'- match: {{class: transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeMLP}}\n'
            f'  replace: {{class: {OPS}.mlp.KQwen2MoeMLP}}\n')
    got = [f for f in findings(tmp_path, text, "--backend", "ktransformers", "--model", tmp_path / "config.json")
           if f[0] == "KT204"]
    assert len(got) == 1 and "the ktransformers decoder layer calls it without bsz_tensor" in got[0][2], got
    # no dense layer: the rule then matches only the experts inside each experts list, whose caller is the MoE
    # block's own loop over that list, not an MLP call site this check knows, so nothing is claimed
    cfg["mlp_only_layers"] = []
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert [f for f in findings(tmp_path, text, "--backend", "ktransformers", "--model", tmp_path / "config.json")
            if f[0] == "KT204"] == []


def test_without_a_tree_the_decoder_layer_is_assumed(tmp_path):
    text = f'- match: {{name: "^model\\\\.layers\\\\.0\\\\.mlp$"}}\n  replace: {{class: {OPS}.mlp.KQwen2MoeMLP}}\n'
    got = [f for f in findings(tmp_path, text, "--backend", "ktransformers") if f[0] == "KT204"]
    assert len(got) == 1 and "ktransformers decoder layer" in got[0][2], got
