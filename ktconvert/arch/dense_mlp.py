"""The dense gated MLP (``dense_mlp``: DeepSeek's first layers, Qwen's ``mlp_only_layers``, MiniMax-M3's dense
layers): down(act(gate) * up); its projections are also the shape of every expert and shared expert (``moe.py``).
Torch: ``model/modules.py`` ``GatedMLP``.

Which layers are dense and how wide they are is parsed here (:func:`parse_layers`, :func:`parse_widths`, the spec's
``config.dense_layers`` policy through :func:`moe_layers_of`), into the MLP part ``MoeConfig.mlp`` that ``moe.py``
defines (:class:`~ktconvert.arch.moe.MlpPart`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, Getter, MechanismBase, layer_prefix
from ktconvert.errors import InputError

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


def mlp_tensors(add: Add, h: int, prefix: str, inter: int, names=("gate_proj", "up_proj", "down_proj"),
                bias: bool = False) -> None:
    """A gated MLP's three projections (and their biases): dense layers, experts and shared experts."""
    add(f"{prefix}.{names[0]}.weight", (inter, h), "linear")
    add(f"{prefix}.{names[1]}.weight", (inter, h), "linear")
    add(f"{prefix}.{names[2]}.weight", (h, inter), "out_linear")
    if bias:
        add(f"{prefix}.{names[0]}.bias", (inter,), "bias")
        add(f"{prefix}.{names[1]}.bias", (inter,), "bias")
        add(f"{prefix}.{names[2]}.bias", (h,), "out_bias")


def mlp_modules(parent, name: str, type_: str, projs=("gate_proj", "up_proj", "down_proj")):
    mlp = parent.add(name, type_)
    for p in projs:
        mlp.add(p, "Linear")
    mlp.add("act_fn", "Activation")
    return mlp


def parse_layers(policy: str, family: str, raw: dict, layers: int, num_experts: int,
                 path: str | None) -> tuple[int, ...]:
    """The MoE layers under the spec's ``dense_layers`` policy, refused where config.json's two spellings of the
    dense layers disagree or name a dense layer the family cannot have."""
    moe_layers = tuple(sorted(moe_layers_of(policy, raw, layers, num_experts, path)))
    types = raw.get("mlp_layer_types")
    if policy == "first_k_dense" and isinstance(types, list) and "first_k_dense_replace" in raw and (
            [t == "sparse" for t in types] != [i in moe_layers for i in range(layers)]):
        # transformers reads only mlp_layer_types, llama.cpp's converters only first_k_dense_replace
        raise InputError(f"mlp_layer_types {types} disagrees with first_k_dense_replace="
                         f"{raw.get('first_k_dense_replace')}", path=path, where="mlp_layer_types",
                         fix="make both name the same dense layers")
    if policy == "none" and _lists_dense(raw):
        raise InputError("dense MLP layers (mlp_layer_types \"dense\" / moe_layer_freq 0) are not supported for "
                         f"{family}: every layer must be MoE", path=path, where="mlp_layer_types")
    return moe_layers


def parse_widths(g: Getter, expert_width_key: str, dense_key: str | None, raw: dict, layers: int,
                 moe_layers: tuple[int, ...], path: str | None) -> tuple[int, int]:
    """``(moe_intermediate_size, intermediate_size)``: an expert's width (config.json's ``expert_width_key``, the
    spec's ``config.expert_width``) and the dense MLP layers' (``dense_key``: the spec's ``config.dense_width``)."""
    if expert_width_key == "intermediate_size":
        moe_inter = g.int("intermediate_size")
        inter = moe_inter
    else:
        moe_inter = g.int(expert_width_key)
        inter = int(g.opt("intermediate_size", moe_inter))
    # read only where a layer is dense: transformers saves its default (MiniMax-M3: 12288) whatever the layers, and
    # without dense layers both spellings must read alike (llama.cpp's minimax-m3 reads feed_forward_length only
    # for its leading dense layers)
    if dense_key and dense_key in raw and len(moe_layers) < layers:
        inter = g.int(dense_key)
    elif dense_key and len(moe_layers) < layers:
        raise InputError(f"the dense MLP layers' width is missing: give {dense_key} (transformers defaults it, "
                         "llama.cpp's converter reads intermediate_size instead)", path=path, where=dense_key,
                         fix=f"write {dense_key} as the release does")
    return moe_inter, inter


def mlp_kinds(raw: dict) -> list | None:
    """Each layer's MLP as a ``layer_list`` family spells it: transformers' ``mlp_layer_types`` (``sparse`` /
    ``dense``), else the hub's per-layer ``moe_layer_freq`` list (1 MoE, 0 dense) read as transformers reads it;
    None when the config gives neither list."""
    types, freq = raw.get("mlp_layer_types"), raw.get("moe_layer_freq")
    if isinstance(types, list):
        return types
    if isinstance(freq, list):
        return ["sparse" if f else "dense" for f in freq]
    return None


def _layer_list(raw: dict, layers: int, path: str | None) -> set[int]:
    """The MoE layers of a ``layer_list`` family: one ``sparse`` / ``dense`` entry per layer, both spellings agreeing
    where both are given, the dense layers leading the stack (llama.cpp's leading_dense_block_count names the first
    layers only); neither list: every layer MoE (transformers' default)."""
    types, freq = raw.get("mlp_layer_types"), raw.get("moe_layer_freq")
    for key, value, ok in (("mlp_layer_types", types, lambda t: t in ("sparse", "dense")),
                           ("moe_layer_freq", freq, lambda f: f in (0, 1) and not isinstance(f, float))):
        if value is None:
            continue
        if not isinstance(value, list) or len(value) != layers or not all(ok(v) for v in value):
            what = "sparse / dense" if key == "mlp_layer_types" else "1 (MoE) / 0 (dense)"
            got = f"{len(value)} entries" if isinstance(value, list) else repr(value)
            raise InputError(f"{key} must list num_hidden_layers={layers} entries of {what}, got {got}", path=path,
                             where=key, fix=f"give {key} one entry per layer (or drop it: every layer MoE)")
    if isinstance(types, list) and isinstance(freq, list) and [t == "sparse" for t in types] != [bool(f) for f in freq]:
        raise InputError(f"mlp_layer_types {types} disagrees with moe_layer_freq {freq}", path=path,
                         where="mlp_layer_types", fix="make both name the same dense layers")
    kinds = mlp_kinds(raw) or ["sparse"] * layers
    dense = [i for i, k in enumerate(kinds) if k == "dense"]
    if dense != list(range(len(dense))):
        raise InputError(f"dense MLP layers {dense} do not lead the stack: llama.cpp's leading_dense_block_count names "
                         "the first layers only", path=path, where="mlp_layer_types",
                         fix="make the dense layers the first ones")
    return set(range(len(dense), layers))


def _lists_dense(raw: dict) -> bool:
    """A per-layer MLP list (transformers' mlp_layer_types, the hub's moe_layer_freq) that names a dense layer."""
    types, freq = raw.get("mlp_layer_types"), raw.get("moe_layer_freq")
    return ((isinstance(types, list) and "dense" in types)
            or (isinstance(freq, list) and any(not f for f in freq)))


def moe_layers_of(policy: str, raw: dict, layers: int, num_experts: int, path: str | None = None) -> set[int]:
    """The layers that hold routed experts under a spec's ``dense_layers`` policy (see the schema); a ``layer_list``
    that cannot say is one :class:`InputError` naming ``path``."""
    def opt_int(key: str, default: int) -> int:
        v = raw.get(key)
        return int(v) if v and not isinstance(v, list) else default  # a list: another policy's per-layer spelling

    if policy == "sparse_step":
        step = opt_int("decoder_sparse_step", 1)
        mlp_only = set(raw.get("mlp_only_layers") or [])
        return {i for i in range(layers) if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0}
    if policy == "layer_list":
        return _layer_list(raw, layers, path)
    if policy == "first_k_dense":
        types = raw.get("mlp_layer_types")
        if "first_k_dense_replace" not in raw and isinstance(types, list) and len(types) == layers:
            # transformers 5's spelling of the dense layers (GLM-5 / GLM-5-Next save no first_k_dense_replace)
            return {i for i, t in enumerate(types) if t == "sparse"}
        first_dense = opt_int("first_k_dense_replace", 0)
        freq = opt_int("moe_layer_freq", 1)
        return {i for i in range(layers) if i >= first_dense and i % freq == 0}
    return set(range(layers))


class DenseMlp(MechanismBase):
    """No parse step of its own: its layers and width are the MLP part's (``MoeConfig.mlp``), which every family
    has (``moe.parse_mlp``)."""

    name = "dense_mlp"
    gguf_keys: dict = {}

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        mlp_tensors(add, cfg.hidden_size, f"{layer_prefix(layer)}.{cfg.ffn_name(layer)}", cfg.mlp.intermediate_size)

    def layer_modules(self, node, cfg: MoeConfig) -> None:
        mlp_modules(node, cfg.dense_block_name, f"{cfg.spec.prefix}MLP")


MECHANISM = DenseMlp()
