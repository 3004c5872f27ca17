"""The registered mechanisms by name, and the one place that picks a layer's: ``attention_for``,
``feed_forward_for``, ``residual_for``. Everything else (the tensor walker of ``tensors.py``, the module tree of
``ktconvert/rules/modeltree.py``, the GGUF keys of ``ktconvert/convert/metadata.py``, the reference layers of
``ktconvert/model/reference.py``) asks these and never tests the config for a kind itself
(``tests/test_architecture.py`` checks that)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, TYPE_CHECKING

from ktconvert.arch.base import AttentionMechanism, KeyWriter, Mechanism, ParseStep

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig

#: the modules of this package that are not a mechanism; every other one is, and names its instance ``MECHANISM``
_MACHINERY = ("attention_part", "base", "indexer", "registry", "rope", "tensors")


def _discover() -> dict[str, Mechanism]:
    """Every mechanism module of ``ktconvert/arch/`` (a new one registers itself by being there), by name."""
    found: dict[str, Mechanism] = {}
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda i: i.name):
        if info.name not in _MACHINERY:
            m = importlib.import_module(f"ktconvert.arch.{info.name}").MECHANISM
            found[m.name] = m
    return found


MECHANISMS: dict[str, Mechanism] = _discover()


def mechanism(name: str) -> Mechanism:
    return MECHANISMS[name]


def attention_for(cfg: MoeConfig, layer: int) -> str:
    """The attention mechanism of ``layer``: the spec names it as data. A layer config.json's ``layer_types`` marks
    ``linear_attention`` runs the spec's ``attention.linear_attention`` (``kda``), else a hybrid's Gated DeltaNet;
    every other layer runs ``attention.kind`` (a Gated DeltaNet hybrid's full layers: ``gqa``)."""
    spec = cfg.spec.attention
    if cfg.attention.layer_types and cfg.attention.layer_types[layer] == "linear_attention":
        return spec.linear_attention or "gated_deltanet"
    return _of_kind(spec.kind)


def _of_kind(kind: str) -> str:
    return "gqa" if kind == "gated_deltanet_hybrid" else kind


def kind_mechanism(kind: str) -> AttentionMechanism:
    """The attention mechanism a spec's ``attention.kind`` names (a Gated DeltaNet hybrid's: its full layers'
    ``gqa``): what sizes the heads and the rope of the model (``head_dims``, ``ropes``)."""
    return MECHANISMS[_of_kind(kind)]


def attention(cfg: MoeConfig, layer: int) -> AttentionMechanism:
    return MECHANISMS[attention_for(cfg, layer)]


def feed_forward_for(cfg: MoeConfig, layer: int) -> str:
    """``dense_mlp`` on the config's dense layers, ``hash_routing`` on its hash-routed ones, else ``moe``."""
    if layer not in cfg.mlp.moe_layers:
        return "dense_mlp"
    return "hash_routing" if layer in cfg.routing.hash_layers else "moe"


def residual_for(cfg: MoeConfig) -> str | None:
    """``hyper_connections`` where the spec gives the model several residual streams; None for the plain one."""
    return "hyper_connections" if cfg.residual is not None else None


def gguf_keys(model_keys: Mapping[str, KeyWriter] = MappingProxyType({})) -> dict[str, KeyWriter]:
    """``model_keys`` (the model's own, whatever its mechanisms) and every mechanism's GGUF keys, by their
    ``gguf.metadata`` name; a name written twice is refused (each is owned by one writer)."""
    return _owned("gguf_keys", "GGUF keys {} written twice", dict(model_keys))


def _owned(attr: str, clash_message: str, out: dict) -> dict:
    """``out`` with each mechanism's ``attr`` mapping added, refusing a key two of them own."""
    for m in MECHANISMS.values():
        mine = getattr(m, attr)
        clash = set(out) & set(mine)
        if clash:
            raise AssertionError(f"{clash_message.format(sorted(clash))} (mechanism {m.name})")
        out.update(mine)
    return out


def parse_steps() -> list[ParseStep]:
    """Every mechanism's config parsers in the order ``ktconvert/families/config.py`` runs them (each step's
    ``order``: a refusal of an earlier step comes first, and a step reads what the earlier ones gave); two steps of
    one order are refused (their refusals' order would hang on the modules' names)."""
    steps = sorted((s for m in MECHANISMS.values() for s in m.parsers), key=lambda s: s.order)
    orders = [s.order for s in steps]
    if len(set(orders)) != len(orders):
        raise AssertionError(f"two mechanisms' parse steps share an order: {orders}")
    return steps


def count_limits(core: Mapping[str, tuple[int, int]] = MappingProxyType({})) -> dict[str, tuple[int, int]]:
    """``core`` (the model's own count bounds, ``ktconvert/families/limits.py``'s) and every mechanism's config.json
    count bounds (``count_limits``) by key; a key bounded twice is refused (each count belongs to one owner)."""
    return _owned("count_limits", "config counts {} bounded twice", dict(core))


def role_fills() -> dict:
    """Every mechanism's own tensor roles and how the tiny models fill them (``fills``); a role two own is refused."""
    return _owned("fills", "tensor roles {} filled twice", {})
