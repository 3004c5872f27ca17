"""Hash routing (DeepSeek-V4's first layers, spec ``routing.hash_layers``): an MoE block whose experts are looked up
by token id in a ``tid2eid`` table instead of scored; the rest of the block is the MoE block of ``moe.py``.
Its part of the config is ``MoeConfig.routing.hash_layers``, parsed here by :func:`parse`. Torch: ``model/compressed.py``
``HashRoutedMoE``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, Getter, ParseContext, Parsed, ParseStep
from ktconvert.arch.moe import Moe
from ktconvert.errors import InputError

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


def parse(ctx: ParseContext) -> Parsed | None:
    """The hash-routed layers (spec ``routing.hash_layers``): transformers' ``mlp_layer_types`` (``hash_moe`` /
    ``moe``) or the release's ``num_hash_layers`` leading layers."""
    if "hash_layers" not in ctx.routing_spec:
        return None
    return {"routing": {"hash_layers": _hash_layers(ctx.g, ctx.raw, ctx.routing_spec["hash_layers"], ctx.layers,
                                                    ctx.path)}}


def _hash_layers(g: Getter, raw: dict, choice: dict, layers: int, path: str | None) -> tuple[int, ...]:
    types = raw.get("mlp_layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) < layers or any(t not in ("hash_moe", "moe") for t in types[:layers]):
            raise InputError(f"mlp_layer_types must list {layers} entries of hash_moe / moe, got {types!r}", path=path,
                             where="mlp_layer_types")
        hashed = tuple(i for i, t in enumerate(types[:layers]) if t == "hash_moe")
        if hashed != tuple(range(len(hashed))):
            raise InputError(f"hash_moe layers {list(hashed)} do not lead the stack: the release's num_hash_layers and "
                             "llama.cpp's hash_layer_count name the first layers only", path=path,
                             where="mlp_layer_types", fix="list hash_moe for the first layers, then moe")
        return hashed
    n = g.choice(choice)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InputError(f"num_hash_layers must be a non-negative integer, got {n!r}", path=path,
                         where="num_hash_layers")
    return tuple(range(min(n, layers)))


def fill_tid2eid(cfg: MoeConfig, name: str, shape: tuple, draws):
    """The tiny models' table: each token's experts are its routing code's pair through a permutation of the
    layer's own."""
    import numpy as np  # here, not at import: check-rules reads this package without numpy

    layer = name.split(".")[2]
    perm = draws.permutation("hash-perm", layer, n=cfg.num_experts)
    return np.asarray(perm)[draws.token_codes()].astype(np.int64)


class HashRouting(Moe):
    name = "hash_routing"
    parsers = (ParseStep(80, parse),)
    count_limits = {"num_hash_layers": (0, 1024)}
    fills = {"tid2eid": fill_tid2eid}

    def router_tensors(self, cfg: MoeConfig, m: str, add: Add) -> None:
        """Each token's experts: the table instead of a score bias."""
        add(f"{m}.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "tid2eid")

    def router_type(self, cfg: MoeConfig) -> str:
        return f"{cfg.spec.prefix}HashRouter"

    gguf_keys = {
        "hash_layers": lambda w, c, n: w.add_uint32(f"{w.arch}.hash_layer_count", len(c.routing.hash_layers)),
    }


MECHANISM = HashRouting()
