"""Weights-aware checks (KT5xx): do the tensors the injected operators load exist, in types they can run?

Upstream finds these only at load time, as ``can't find token_embd.weight in GGUF file``, a missing
``exp_probs_b`` score-correction bias, a missing ``kv_b_proj``, or ``ggml_type N not implemented``. Here the
expected tensors come from the model's module tree (every parameter of every module) and the experts of each
MoE layer, translated to the checkpoint's own naming through the naming maps.
"""

from __future__ import annotations

from dataclasses import dataclass

from ktconvert.errors import InputError
from ktconvert.formats import naming_map
from ktconvert.rules import engine
from ktconvert.rules.catalog import MEASURED_LLAMAFILE
from ktconvert.rules.checks import check
from ktconvert.rules.modeltree import ModelTree
from ktconvert.formats.kt_amx import parse_name

_PROJECTIONS = ("gate", "up", "down")


@dataclass
class Expected:
    hf: str  # HF parameter name
    stored: tuple[str, ...]  # names it may have in the checkpoint (first is canonical)
    module: str


def _params(node, tree: ModelTree) -> list[str]:
    t = node.type
    mc = tree.moe_config
    if t == "Linear":
        name = node.path.rsplit(".", 1)[-1]
        return ["weight", "bias"] if ".self_attn." in node.path and name in mc.attention_bias_on else ["weight"]
    if t == "Embedding" or t.endswith("RMSNorm"):
        return ["weight"]
    on_block = mc.spec.experts.bias_on_block
    if t.endswith("MoEGate"):
        return ["weight", "e_score_correction_bias"] if mc.routing.topk_method == "noaux_tc" and not on_block else ["weight"]
    if on_block and mc.routing.topk_method == "noaux_tc" and node.path.endswith(f".{mc.moe_block_name}") and not node.dense:
        return ["e_score_correction_bias"]  # the MoE block's own buffer (spec moe.score_bias: block)
    return []


def expected_tensors(tree: ModelTree, container: str, naming, role_of) -> list[Expected]:
    """Every non-expert tensor loading the model will look up, in the checkpoint's naming (GGUF or HF)."""
    out: list[Expected] = []
    for node in tree.nodes:
        if _under_experts(node, tree, role_of):
            continue  # expert weights are checked per layer, in whatever layout the checkpoint has
        for p in _params(node, tree):
            hf = f"{node.path}.{p}"
            if container == "gguf":
                g = naming.to_gguf(hf) if naming else None
                if g is None:
                    continue
                stored = (g,)
            else:
                stored = (hf,)
            out.append(Expected(hf, stored, node.path))
    return out


def _under_experts(node, tree: ModelTree, role_of) -> bool:
    up = node
    while up is not None:
        if role_of(up.type) == "experts":
            return True
        up = tree.parent.get(up.path)
    return False


def expert_tensors(layer: int, n_experts: int, container: str, names: set, naming) -> list[tuple[str, list[str]]]:
    """(projection, names) of one layer's experts in the first layout the checkpoint uses for that layer."""
    if naming is None:
        return []
    layouts = ("gguf-merged", "gguf-split") if container == "gguf" else ("hf-split", "hf-fused")
    candidates = []
    for layout in layouts:
        per_proj = []
        for proj in _PROJECTIONS:
            if layout in ("gguf-split", "hf-split"):
                per = [naming.expert_name(layout, proj, layer, e) for e in range(n_experts)]
            else:
                per = [naming.expert_name(layout, proj, layer)]
                if layout == "hf-fused" and proj in ("gate", "up"):
                    per = [naming.expert_name(layout, "gate_up", layer)]
            per_proj.append((proj, [n for n in per if n]))
        present = sum(1 for _, ns in per_proj for n in ns if n in names)
        candidates.append((present, layout, per_proj))
    candidates.sort(key=lambda c: -c[0])
    return candidates[0][2]


@check("KT501", "KT502", stage="weights")
def check_weights(ctx, compiled: list, tree: ModelTree, checkpoint) -> None:
    """KT501 (a tensor an operator loads is missing) and KT502 (experts in a type their op cannot run), from one
    walk that resolves which rule owns each module's weights."""
    catalog = ctx.catalog
    names = set(checkpoint)
    # kernel-order safetensors carry llama.cpp names and ggml types: checked as a GGUF is
    container = "gguf" if getattr(checkpoint, "llama_names", False) else checkpoint.container
    if _kt_amx_finding(ctx, checkpoint, names):
        return
    try:
        naming = naming_map(checkpoint.architecture or tree.family) if container == "gguf" else naming_map(tree.family)
    except InputError:
        naming = None
    assigned = {a.path: a for a in engine.resolve(tree.root, compiled, catalog.is_instance, tree.search_cache)}
    threshold = _prefill_threshold(compiled)
    wfile = checkpoint.files[0] if checkpoint.files else "weights"

    def owner(module: str):
        """The rule that decides how ``module``'s parameters are loaded: its own, or its nearest ancestor's."""
        path = module
        while True:
            a = assigned.get(path)
            if a is not None and a.rule is not None:
                return a.rule
            if not path:
                return None
            path = path.rsplit(".", 1)[0] if "." in path else ""

    def point(rule):
        return (str(rule.index), "replace", "class") if rule is not None else ()

    def who(rule) -> str:
        if rule is None:
            return "no rule (the module stays default)"
        return f"{rule.replace_class.rsplit('.', 1)[-1]} (rule {rule.index})"

    missing = 0
    for exp in expected_tensors(tree, container, naming, catalog.role_of):
        if any(n in names for n in exp.stored):
            continue
        if exp.hf.endswith("self_attn.kv_b_proj.weight") and container == "gguf":
            base = exp.stored[0].rsplit(".attn_kv_b.weight", 1)[0]
            if f"{base}.attn_k_b.weight" in names and f"{base}.attn_v_b.weight" in names:
                continue  # newer DeepSeek GGUFs: upstream rebuilds kv_b_proj from attn_k_b + attn_v_b
        rule = owner(exp.module)
        missing += 1
        if missing > 20:
            continue
        ctx.add("KT501", point(rule), f"{exp.stored[0]} ({exp.hf}) is not in {wfile}; {who(rule)} loads it, so upstream "
                f"fails at load with \"can't find {exp.stored[0]}\"",
                "convert the weights with this tensor (or point --weights at the complete file set)",
                at=None if rule is not None else (1, 1))
    if missing > 20:
        ctx.add("KT501", (), f"{missing - 20} more expected tensors are missing from {wfile}", "see the first ones above", at=(1, 1))

    bad_types: dict[tuple, list] = {}  # (rule, slot, op, dtype) -> [(layer, tensor)]: one finding per cause
    for node in tree.nodes:
        if catalog.role_of(node.type) != "experts" or node.layer is None:
            continue
        rule = owner(node.path)
        op = catalog.operators.get(rule.replace_class) if rule is not None else None
        groups = expert_tensors(node.layer, len(node.children), container, names, naming)
        absent = [n for _, ns in groups for n in ns if n not in names]
        if absent:
            ctx.add("KT501", point(rule), f"layer {node.layer} experts: {len(absent)} tensor(s) missing from {wfile}, "
                    f"first {absent[0]}; {who(rule)} loads them", "convert every expert of every MoE layer",
                    at=None if rule is not None else (1, 1))
            continue
        if op is None or op.role != "experts":
            continue
        for slot_name, slot in op.ops.items():
            if slot.unused or (slot_name == "prefill_op" and threshold == 0):
                continue  # the prefill op is only loaded for layer-wise prefill
            op_name = rule.kwargs.get(slot_name, slot.default)
            if not isinstance(op_name, str) or op_name not in catalog.ops:
                continue
            allowed = catalog.ggml_types(op_name, rule.kwargs.get("backend"))
            if container == "safetensors":
                allowed = catalog.type_sets.get("safetensors-experts", allowed)
            if allowed == "any":
                continue
            for _, ns in groups:
                for n in ns:
                    dtype = checkpoint[n].dtype
                    if dtype not in allowed:
                        bad_types.setdefault((rule.index, slot_name, op_name, dtype, tuple(allowed)), []).append((node.layer, n))
    by_index = {r.index: r for r in compiled}
    for (index, slot_name, op_name, dtype, allowed), hits in bad_types.items():
        rule = by_index[index]
        backend = rule.kwargs.get("backend")
        why = f" with backend {backend}" if backend in catalog.ops[op_name].get("backend_ggml_types", {}) else ""
        layers = sorted({layer for layer, _ in hits})
        where = (str(index), "replace", "kwargs", slot_name) if slot_name in rule.kwargs else point(rule)
        if catalog.ggml_type_set(op_name, backend) == MEASURED_LLAMAFILE:  # the measured table says why, and what runs
            from ktconvert.quant import kt_llamafile

            first = hits[0][1]
            prob = kt_llamafile.problem(dtype, int(checkpoint[first].shape[-1]))
            ctx.add("KT502", where, f"{first} is {dtype} ({len(hits)} expert tensor(s) in {len(layers)} layer(s)): "
                    f"{op_name} ({slot_name} of rule {index}) runs it on the llamafile backend, and {prob.message}; "
                    "upstream loads every weight and fails only once it serves", prob.fix)
            continue
        ctx.add("KT502", where, f"{len(hits)} expert tensor(s) in {len(layers)} layer(s) are {dtype} (first {hits[0][1]}), "
                f"which {op_name}{why} ({slot_name} of rule {index}) cannot run (it runs {', '.join(allowed)}); "
                "upstream raises at load (ggml_type not implemented)",
                f"requantize the experts to one of {', '.join(allowed)}, or choose another {slot_name}")


def _kt_amx_finding(ctx, checkpoint, names: set) -> bool:
    """A kt-amx directory (kt-kernel's AMXINT8/AMXINT4 experts) is read by SGLang's kt-kernel integration, never by
    an optimize-rule operator: say so once instead of listing every tensor the operators would miss."""

    amx = [n for n in names if parse_name(n) is not None]
    if not amx:
        return False
    parts = 1 + max(parse_name(n)[3] for n in amx)
    wfile = checkpoint.files[0].parent if checkpoint.files else "weights"
    ctx.add("KT501", (), f"{wfile} is a kt-amx directory (kt-kernel AMXINT8/AMXINT4 experts, {parts} part(s)): no "
            "operator of this rule file reads it (ktransformers' operators load GGUF or Hugging Face weights, and "
            "this directory holds only packed experts)",
            "point --weights at the GGUF or Hugging Face checkpoint; serve this directory with sglang "
            f"--kt-weight-path DIR --kt-method AMXINT8|AMXINT4 --kt-threadpool-count {parts} --model-path HF_DIR",
            at=(1, 1))
    return True


def _prefill_threshold(compiled: list) -> int:
    for rule in compiled:
        value = rule.kwargs.get("per_layer_prefill_intput_threshold") if isinstance(rule.kwargs, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0
