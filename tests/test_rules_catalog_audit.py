"""The catalog audit against upstream's operator sources (rules/catalog/ktransformers-audit.yaml): every operator
has a record, and each corrected entry now gives the finding upstream's code implies (or stays clean)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ktconvert.cli import cli
from ktconvert.io.datafile import load_data_file
from ktconvert.io.resources import rules_dir
from ktconvert.rules.catalog import load_catalog

OPS = "ktransformers.operators"
DSV3 = "ktransformers.models.modeling_deepseek_v3"
DEV = "generate_device: cuda, prefill_device: cuda"


def findings(tmp_path, text, *args):
    p = tmp_path / "rules.yaml"
    p.write_text(text)
    r = CliRunner().invoke(cli, ["check-rules", "-o", "json", *map(str, args), str(p)], catch_exceptions=False)
    return [(f["id"], f["rule_index"], f["message"]) for f in json.loads(r.output)["findings"]]


def ids(got, *wanted):
    return [f for f in got if f[0] in wanted]


def test_every_operator_has_an_audit_record():
    audit = load_data_file(rules_dir() / "catalog/ktransformers-audit.yaml", "operator-audit", "operator audit").data
    assert set(audit["operators"]) == set(load_catalog().operators) and set(audit["ops"]) == set(load_catalog().ops)
    for path, rec in [*audit["operators"].items(), *audit["ops"].items()]:
        assert (rec["source"] == "none") == (rec["status"] == "no-source"), path
        assert (rec["status"] == "fixed") <= ("fixed" in rec), path


def test_serve_norm_falls_back_under_local_chat(tmp_path):
    """RMSNorm.forward(x, batch_size_tensor=None) runs forward_native without it: fine for local_chat."""
    text = f"- match: {{class: {DSV3}.DeepseekV3RMSNorm}}\n  replace: {{class: {OPS}.layernorm.RMSNorm, kwargs: {{{DEV}}}}}\n"
    assert ids(findings(tmp_path, text, "--backend", "ktransformers"), "KT203", "KT204") == []
    # KQwen3NextRMSNorm.forward(x, num_tokens_tensors, ...) has no default: still caught
    text = text.replace("layernorm.RMSNorm", "layernorm.KQwen3NextRMSNorm")
    got = ids(findings(tmp_path, text, "--backend", "ktransformers"), "KT204")
    assert len(got) == 1 and "KQwen3NextRMSNorm needs bsz_tensor" in got[0][2], got


def test_llama4_moe_and_mlp_need_bsz_tensor(tmp_path):
    """KLlama4Moe.forward(hidden_states, bsz_tensor, ...) and KLlama4MLP.forward(x, bsz_tensor): no defaults."""
    text = (f'- match: {{name: "^model\\\\.layers\\\\..*\\\\.feed_forward$"}}\n'
            f'  replace: {{class: {OPS}.experts.KLlama4Moe, kwargs: {{{DEV}}}}}\n'
            f'- match: {{name: "^model\\\\.layers\\\\..*\\\\.feed_forward\\\\.shared_expert$"}}\n'
            f'  replace: {{class: {OPS}.mlp.KLlama4MLP, kwargs: {{{DEV}}}}}\n')
    got = findings(tmp_path, text, "--backend", "ktransformers")
    assert [(f[0], f[1]) for f in ids(got, "KT203", "KT204")] == [("KT203", 0), ("KT204", 1)], got
    assert ids(findings(tmp_path, text, "--backend", "balance_serve"), "KT203", "KT204") == []


def test_ascend_qwen3_block_calls_its_experts_without_bsz_tensor(tmp_path):
    """KQwen3MoeSparseMoeBlockW8A8 calls experts(x, ids, weights, cuda_graph_idx=..., use_npu_graph=...)."""
    def block(experts, op):
        return (f'- match: {{name: "^model\\\\.layers\\\\..*\\\\.mlp$"}}\n'
                f'  replace: {{class: {OPS}.ascend.ascend_experts.KQwen3MoeSparseMoeBlockW8A8, kwargs: {{{DEV}}}}}\n'
                f'- match: {{name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}}\n'
                f'  replace: {{class: {OPS}.{experts}, kwargs: {{generate_device: cpu, generate_op: {op}, out_device: npu}}}}\n'
                f'  recursive: false\n')
    w8a8 = block("ascend.ascend_experts.KTransformersExpertsW8A8", "KExpertsCPUW8A8")
    assert ids(findings(tmp_path, w8a8, "--backend", "balance_serve"), "KT204") == []
    v2 = block("experts.KTransformersExpertsV2", "KExpertsCPU")
    got = ids(findings(tmp_path, v2, "--backend", "balance_serve"), "KT204")
    assert len(got) == 1 and got[0][1] == 1 and "KQwen3MoeSparseMoeBlockW8A8 (rule 0)" in got[0][2], got


def test_ascend_norm_is_called_hf_style_by_the_ascend_serve_model():
    cat = load_catalog()
    ascend = cat.operators[f"{OPS}.ascend.ascend_layernorm.KQwen3MoeRMSNormW8A8"]
    assert ascend.contract == "hf" and cat.decoder_contract("balance_serve", ascend) == "hf"
    assert cat.decoder_contract("balance_serve", cat.operators[f"{OPS}.layernorm.KQwen3NextRMSNorm"]) == "serve"


def test_model_operator_refuses_prefill_device(tmp_path):
    """The model operators pass `device` positionally as BaseInjectedModule's prefill_device: TypeError."""
    text = (f'- match: {{name: "^model$"}}\n  replace:\n    class: {OPS}.models.KLlamaModel\n'
            f'    kwargs: {{generate_device: cuda, prefill_device: cuda, per_layer_prefill_intput_threshold: 0}}\n')
    got = ids(findings(tmp_path, text, "--backend", "ktransformers"), "KT206")
    assert len(got) == 1 and "'prefill_device'" in got[0][2], got
    ok = text.replace("prefill_device: cuda, ", "device: cuda, ")
    assert ids(findings(tmp_path, ok, "--backend", "ktransformers"), "KT206") == []


def test_attention_takes_chunck_size(tmp_path):
    text = (f'- match: {{name: "^model\\\\.layers\\\\..*\\\\.self_attn$"}}\n'
            f'  replace: {{class: {OPS}.attention.KDeepseekV2Attention, kwargs: {{{DEV}, chunck_size: 4096}}}}\n')
    assert ids(findings(tmp_path, text, "--backend", "ktransformers"), "KT206", "KT207") == []
    gate = text.replace("attention.KDeepseekV2Attention", "gate.KMoEGate")
    assert len(ids(findings(tmp_path, gate, "--backend", "ktransformers"), "KT206")) == 1


def test_w8a8_wrappers_default_to_their_base_constructors_ops(tmp_path):
    """Neither W8A8 wrapper sets op defaults of its own: KExpertsCPU / KLinearMarlin are what an omitted op means."""
    experts = (f'- match: {{name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}}\n'
               f'  replace: {{class: {OPS}.ascend.ascend_experts.KTransformersExpertsW8A8, '
               f'kwargs: {{generate_device: cpu, out_device: npu, backend: llamafile}}}}\n  recursive: false\n')
    assert ids(findings(tmp_path, experts, "--backend", "ktransformers"), "KT206") == []
    linear = (f'- match: {{name: "^model\\\\.layers\\\\..*\\\\.self_attn\\\\.q_proj$"}}\n'
              f'  replace: {{class: {OPS}.ascend.ascend_linear.KTransformersLinearW8A8A2, kwargs: {{generate_device: cpu}}}}\n')
    got = ids(findings(tmp_path, linear, "--backend", "ktransformers"), "KT205")
    assert len(got) == 1 and "KLinearMarlin runs only on a GPU" in got[0][2], got


def test_hunyuan_operators_work_under_local_chat(tmp_path):
    """local_chat had HunYuan in custom_models; its norm and MLP take bsz_tensor=None, its model HF arguments."""
    text = "".join(f'- match: {{name: "^{n}$"}}\n  replace: {{class: {OPS}.{c}, kwargs: {{{k}}}}}\n' for n, c, k in [
        ("model", "models.KHunyuanModel", "per_layer_prefill_intput_threshold: 0"),
        ("model\\\\.norm", "layernorm.KHunYuanRMSNorm", DEV),
        ("model\\\\.layers\\\\.0\\\\.mlp\\\\.shared_mlp", "mlp.KHunYuanMLP", DEV)])
    assert ids(findings(tmp_path, text, "--backend", "ktransformers"), "KT203", "KT204") == []


def test_op_kwargs_follow_the_op_constructors(tmp_path):
    """KLinearFP8(block_size=128), KLinearIPEXLLM(precision=...) take them; kt-sft's CPU experts know no AMXInt4."""
    linear = (f'- match: {{name: "^model\\\\.layers\\\\..*\\\\.self_attn\\\\.q_proj$"}}\n'
              f'  replace: {{class: {OPS}.linear.KTransformersLinear, kwargs: {{{DEV}, generate_op: KLinearFP8, '
              f'prefill_op: KLinearFP8, block_size: 128}}}}\n')
    assert ids(findings(tmp_path, linear, "--backend", "ktransformers"), "KT206", "KT207") == []
    xpu = linear.replace("cuda", "xpu").replace("KLinearFP8", "KLinearIPEXLLM").replace("block_size: 128", "precision: sym_int4")
    assert ids(findings(tmp_path, xpu, "--backend", "ktransformers"), "KT206", "KT207") == []
    sft = (f'- match: {{name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}}\n'
           f'  replace: {{class: {OPS}.experts.KTransformersExperts, kwargs: {{generate_device: cpu, generate_op: '
           f'KSFTExpertsCPU, out_device: cuda, backend: AMXInt4}}}}\n  recursive: false\n')
    got = ids(findings(tmp_path, sft, "--backend", "ktransformers"), "KT207")
    assert len(got) == 1 and "'AMXInt4' is not one of llamafile, AMXBF16, AMXInt8" in got[0][2], got


def test_swallowed_kwarg_is_a_warning_not_an_error(tmp_path):
    """flashinfer_attn has no absorb_for_prefill parameter (KDeepseekV2Attention has): upstream ignores it (KT214)."""
    text = (f'- match: {{name: "^model\\\\.layers\\\\..*\\\\.self_attn$"}}\n'
            f'  replace: {{class: {OPS}.balance_serve_attention.flashinfer_attn, kwargs: {{{DEV}, absorb_for_prefill: true}}}}\n')
    got = findings(tmp_path, text, "--backend", "balance_serve")
    assert [f[0] for f in got if f[0] in ("KT206", "KT214")] == ["KT214"], got
    real = text.replace("balance_serve_attention.flashinfer_attn", "attention.KDeepseekV2Attention")
    assert ids(findings(tmp_path, real, "--backend", "ktransformers"), "KT206", "KT214") == []
