"""How a caller's forward contract and an operator's disagree, in words (KT204 from the rule and tree checks)."""

from __future__ import annotations

from ktconvert.rules.catalog import Operator


def contract_msg(op: Operator, caller_contract: str, caller: str) -> str:
    style = {"hf": "without bsz_tensor (HF-style call)", "serve": "with (bsz_tensor, cuda_graph_idx)"}[caller_contract]
    needs = {"hf": "takes only the HF-style arguments", "serve": "needs bsz_tensor and cuda_graph_idx"}[op.contract]
    return f"forward contract mismatch: {caller} calls it {style}, but {op.short} {needs}"


def contract_fix(op: Operator, want: str) -> str:
    if op.role == "experts":
        return ("use KTransformersExperts (V1) under a V1 MoE block" if want == "hf"
                else "use KTransformersExpertsV2 under a V2 MoE block")
    if op.role == "mlp":
        return ("keep the model's own MLP here (class: default), or replace its caller with the V2 operator that "
                "passes bsz_tensor" if want == "hf" else "use an MLP operator that takes bsz_tensor (e.g. KQwen2MoeMLP)")
    return "use the operator made for this backend, or switch --backend"
