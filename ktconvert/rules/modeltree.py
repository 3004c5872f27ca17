"""The module tree of a model, built from ``config.json`` alone (no torch, no weights).

Paths and module types follow the ktransformers model definitions the upstream rule files are written
against (``model.layers.3.mlp.experts.7.gate_proj``), so rule regexes and class matches resolve here
exactly as they would at injection time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert import families
from ktconvert.families.config import normalize_config, text_view
from ktconvert.io.datafile import read_json

FAMILIES = families.FAMILIES

# A rule file whose match classes all come from one family can be checked against that family's tree even
# without --model; these configs stand in for the real model: real layer counts and dense layers, two experts
# (per-expert modules only ever repeat the same few types), small dims (the tree does not depend on them).
# The family-specific keys are each spec's ``probe`` section.
_PROBE_BASE = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
               "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts_per_tok": 2}
PROBE_CONFIGS = {f: {**_PROBE_BASE, "model_type": f, **families.spec(f).probe} for f in FAMILIES}


@dataclass(slots=True)
class Node:
    path: str
    type: str
    children: list = field(default_factory=list)
    layer: int | None = None
    dense: bool = False  # inside a decoder layer whose MLP is dense (no experts)

    def add(self, name: str, type_: str, **kw) -> "Node":
        child = Node(f"{self.path}.{name}" if self.path else name, type_, layer=kw.pop("layer", self.layer),
                     dense=kw.pop("dense", self.dense))
        self.children.append(child)
        return child

    def walk(self):
        """Every node below and including this one, depth first in insertion order (iterative: a recursive generator
        costs a frame per level for every node it yields)."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))


@dataclass
class ModelTree:
    family: str
    config: dict
    root: Node
    num_layers: int
    dense_layers: list
    source: str  # "model" (from --model) or "probe"
    moe_config: object = None  # ktconvert.families.config.MoeConfig

    def __post_init__(self):
        self.nodes: list[Node] = list(self.root.walk())  # flattened once: checks scan it many times
        self.parent: dict[str, Node] = {c.path: n for n in self.nodes for c in n.children}
        self.search_cache: dict = {}  # regex -> {path: matched}, shared by every rule file checked on this tree

    def modules(self) -> int:
        return len(self.nodes)


def family_of_type(type_id: str) -> str | None:
    return families.family_of_class(type_id)


def load_config(path: str | Path) -> tuple[dict, str]:
    """Read ``config.json`` (or the one inside a model directory); the nested ``text_config`` wins if present."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise InputError("no config.json here", path=str(path), fix="pass a model directory or its config.json to --model")
    cfg = read_json(p, "config.json", fix="pass a model directory or its config.json to --model")
    cfg = text_view(cfg)
    return cfg, str(p)


def build_tree(cfg: dict, source: str = "model", where: str = "config.json") -> ModelTree:
    """Module tree for one of ``FAMILIES``; another model type is refused plainly.

    The config is read by the same parser as the reference models (``ktconvert.families.config``), so both
    spellings (hub and transformers 5) give the same layers, dense layers and attention layout.
    """

    try:
        mc = normalize_config(dict(cfg))  # another model_type is refused there, as quantize refuses it
    except InputError as exc:
        if exc.path is not None:  # about another file (a family spec), already placed there
            raise
        raise InputError(exc.message, path=where, where=exc.where, fix=exc.fix) from None
    family = mc.family
    sp = mc.spec
    pre = sp.prefix
    classes = sp.classes
    root = Node("", classes.causal_lm or f"{pre}ForCausalLM")
    model = root.add("model", f"{pre}Model")
    model.add("embed_tokens", "Embedding")
    layers = model.add("layers", "ModuleList")
    moe_layers = set(mc.moe_layers)
    dense_layers = []
    for i in range(mc.num_hidden_layers):
        sparse = i in moe_layers
        if not sparse:
            dense_layers.append(i)
        layer = layers.add(str(i), f"{pre}DecoderLayer", layer=i, dense=not sparse)
        _attention(layer, sp, mc, pre)
        if not sparse:
            _mlp(layer, mc.dense_block_name, f"{pre}MLP")
        else:
            # upstream ktransformers classes: DeepSeek's block is <P>MoE with a <P>MoEGate, others a
            # <P>SparseMoeBlock with a plain Linear router
            router = sp.experts.router_attr
            if not classes.ktransformers_module:
                # no ktransformers modeling file: transformers' own block and router classes; its routed
                # experts are fused into one module there, so each expert here is a plain Module
                moe = layer.add(sp.moe_block_name, classes.moe_block.get("transformers", f"{pre}SparseMoeBlock"))
                hashed = i in mc.hash_layers  # routed by token id (DeepSeek-V4's first layers)
                moe.add(router, f"{pre}HashRouter" if hashed else classes.gate.get("transformers", "Linear"))
                expert_type = "Module"
            else:
                kt_gate = bool(classes.gate)
                moe = layer.add(sp.moe_block_name, f"{pre}MoE" if kt_gate else f"{pre}SparseMoeBlock")
                moe.add(router, f"{pre}MoEGate" if kt_gate else "Linear")
                expert_type = classes.expert or f"{pre}MLP"
            _experts(moe, pre, mc.num_experts, sp.expert_proj_names, expert_type)
            if sp.shared_expert == "shared_experts" and mc.n_shared_experts:
                _mlp(moe, "shared_experts", f"{pre}MLP")
            if sp.shared_expert == "gated" and mc.shared_expert_intermediate_size:
                _mlp(moe, "shared_expert", f"{pre}MLP")
                moe.add("shared_expert_gate", "Linear")
        layer.add("input_layernorm", f"{pre}RMSNorm")
        layer.add("post_attention_layernorm", f"{pre}RMSNorm")
        if mc.hc_modules:
            layer.add("attn_hc", f"{pre}HyperConnection")
            layer.add("ffn_hc", f"{pre}HyperConnection")
    model.add("norm", f"{pre}RMSNorm", layer=None, dense=False)
    if mc.hc_modules:
        model.add("hc_head", f"{pre}HyperHead", layer=None, dense=False)
    root.add("lm_head", "Linear")
    return ModelTree(family, cfg, root, mc.num_hidden_layers, dense_layers, source, mc)


@lru_cache(maxsize=None)
def probe_tree(family: str) -> ModelTree:
    """Built once per family: trees are never mutated by the checks."""
    return build_tree(dict(PROBE_CONFIGS[family]), source="probe", where=f"<{family} probe>")


def _attention(layer: Node, sp, mc, pre: str) -> None:
    if mc.kda is not None and mc.layer_types[layer.layer] == "linear_attention":  # Kimi Delta Attention
        lin = layer.add("self_attn", sp.classes.linear_attention or f"{pre}GatedDeltaNet")
        for name in ("q_proj", "k_proj", "v_proj"):
            lin.add(name, "Linear")
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            lin.add(name, "Conv1d")
        for name in ("f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj"):
            lin.add(name, "Linear")
        lin.add("o_norm", f"{pre}RMSNormGated")
        lin.add("o_proj", "Linear")
        return
    if mc.layer_types and mc.layer_types[layer.layer] == "linear_attention":
        lin = layer.add("linear_attn", f"{pre}GatedDeltaNet")
        for name in sp.linear_projections:
            lin.add(name, "Linear")
        lin.add("conv1d", "Conv1d")
        lin.add("norm", f"{pre}RMSNormGated")
        lin.add("out_proj", "Linear")
        return
    attn = layer.add("self_attn", f"{pre}Attention")
    if mc.compressed is not None:
        _compressed_attention(attn, mc, pre)
        return
    if mc.is_mla:
        if mc.q_lora_rank:
            attn.add("q_a_proj", "Linear")
            attn.add("q_a_layernorm", f"{pre}RMSNorm")
            attn.add("q_b_proj", "Linear")
        else:
            attn.add("q_proj", "Linear")
        attn.add("kv_a_proj_with_mqa", "Linear")
        attn.add("kv_a_layernorm", f"{pre}RMSNorm")
        attn.add("kv_b_proj", "Linear")
        attn.add("o_proj", "Linear")
        if mc.qk_rope_head_dim:  # NoPE MLA (GLM-5-Next) has no rotary module
            attn.add("rotary_emb", sp.classes.tree_rotary or f"{pre}RotaryEmbedding")
        if mc.indexer is not None and layer.layer not in mc.dsa_shared_layers:
            ix = attn.add("indexer", f"{pre}Indexer")
            ix.add("wq_b", "Linear")
            ix.add("wk", "Linear")
            ix.add("k_norm", "LayerNorm")
            ix.add("weights_proj", "Linear")
        return
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        attn.add(name, "Linear")
    if mc.qk_norm:
        attn.add("q_norm", f"{pre}RMSNorm")
        attn.add("k_norm", f"{pre}RMSNorm")
    attn.add("rotary_emb", f"{pre}RotaryEmbedding")
    if layer.layer in mc.msa_layers:  # MiniMax Sparse Attention's indexer, flat in self_attn as released
        attn.add("index_q_proj", "Linear")
        attn.add("index_k_proj", "Linear")
        attn.add("index_q_norm", f"{pre}RMSNorm")
        attn.add("index_k_norm", f"{pre}RMSNorm")


def _compressed_attention(attn: Node, mc, pre: str) -> None:
    """DeepSeek-V4's attention: q LoRA, one K=V projection, grouped output projection; a compressed layer's compressor
    (its lightning indexer under it on the indexer-ratio layers)."""
    for name, type_ in (("q_a_proj", "Linear"), ("q_a_norm", f"{pre}RMSNorm"), ("q_b_proj", "Linear"),
                        ("kv_proj", "Linear"), ("kv_norm", f"{pre}RMSNorm"), ("o_a_proj", "Linear"),
                        ("o_b_proj", "Linear"), ("rotary_emb", f"{pre}RotaryEmbedding")):
        attn.add(name, type_)
    ratio = mc.compressed.ratios[attn.layer]
    if not ratio:
        return
    csa = ratio == mc.compressed.csa_ratio
    comp = attn.add("compressor", f"{pre}CSACompressor" if csa else f"{pre}HCACompressor")
    parts = [comp]
    if csa:
        parts.append(comp.add("indexer", f"{pre}Indexer"))
    for part in parts:
        part.add("kv_proj", "Linear")
        part.add("gate_proj", "Linear")
        part.add("kv_norm", f"{pre}RMSNorm")
    if csa:
        parts[1].add("q_b_proj", "Linear")
        parts[1].add("scorer", f"{pre}IndexerScorer").add("weights_proj", "Linear")


def _mlp(parent: Node, name: str, type_: str, projs=("gate_proj", "up_proj", "down_proj")) -> Node:
    mlp = parent.add(name, type_)
    for p in projs:
        mlp.add(p, "Linear")
    mlp.add("act_fn", "Activation")
    return mlp


def _experts(moe: Node, pre: str, n: int, projs, expert_type: str) -> None:
    experts = moe.add("experts", f"{pre}Experts")
    for e in range(n):
        _mlp(experts, str(e), expert_type, projs)
