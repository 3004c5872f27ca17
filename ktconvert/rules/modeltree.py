"""The module tree of a model, built from ``config.json`` alone (no torch, no weights): a walker over the layers,
each layer's mechanisms (``ktconvert/arch/``) adding their own modules.

Paths and module types follow the ktransformers model definitions the upstream rule files are written
against (``model.layers.3.mlp.experts.7.gate_proj``), so rule regexes and class matches resolve here
exactly as they would at injection time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert import arch, families
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
    root = Node("", sp.classes.causal_lm or f"{pre}ForCausalLM")
    model = root.add("model", f"{pre}Model")
    model.add("embed_tokens", "Embedding")
    layers = model.add("layers", "ModuleList")
    moe_layers = set(mc.mlp.moe_layers)
    dense_layers = []
    residual = arch.residual_for(mc)
    for i in range(mc.num_hidden_layers):
        sparse = i in moe_layers
        if not sparse:
            dense_layers.append(i)
        layer = layers.add(str(i), f"{pre}DecoderLayer", layer=i, dense=not sparse)
        arch.attention(mc, i).layer_modules(layer, mc)
        arch.mechanism(arch.feed_forward_for(mc, i)).layer_modules(layer, mc)
        layer.add("input_layernorm", f"{pre}RMSNorm")
        layer.add("post_attention_layernorm", f"{pre}RMSNorm")
        if residual:
            arch.mechanism(residual).layer_modules(layer, mc)
    model.add("norm", f"{pre}RMSNorm", layer=None, dense=False)
    if residual:
        arch.mechanism(residual).model_modules(model, mc)
    root.add("lm_head", "Linear")
    return ModelTree(family, cfg, root, mc.num_hidden_layers, dense_layers, source, mc)


@lru_cache(maxsize=None)
def probe_tree(family: str) -> ModelTree:
    """Built once per family: trees are never mutated by the checks."""
    return build_tree(dict(PROBE_CONFIGS[family]), source="probe", where=f"<{family} probe>")
