"""The shape every mechanism module of :mod:`ktconvert.arch` has, and the small helpers they share.

A mechanism (an attention kind, the MoE block, hash routing, hyper-connections) lists, for one layer of a parsed
:class:`~ktconvert.families.config.MoeConfig`:

- its tensors (``layer_tensors``: name, shape and role; the role says how the tiny models fill it, see
  ``ktconvert/model/tiny_weights.py``),
- its modules in the module tree check-rules matches (``layer_modules``, adding nodes under the decoder layer's
  node of ``ktconvert/rules/modeltree.py``),
- its GGUF keys (``gguf_keys``: a spec's ``gguf.metadata`` entry -> a writer of ``(w, c, n)``: the gguf-py writer,
  the config and the block count),
- how the tiny models fill a tensor role only it has (``fills``: hash routing's ``tid2eid`` table).

It defines its part of the config and parses it (``parsers``: each a step of :class:`ParseContext` -> its part's
fields, or None where the spec does not use it; ``ktconvert/families/config.py`` runs every registered mechanism's
steps in their ``order``) through :class:`Getter`, and bounds the counts config.json gives it (``count_limits``,
gathered by ``ktconvert/families/limits.py``). Its torch computation is registered under the same name in
``ktconvert/model/mechanisms.py``.
Torch-free; no gguf import at module level either (check-rules runs without numpy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Protocol

from ktconvert.arch.rope import RopeSpec, parse_rope, rotary_dim
from ktconvert.errors import InputError

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


#: ``add(name, shape, role)``: how a mechanism hands the tensor walker one tensor
Add = Callable[[str, tuple, str], None]
#: ``write(w, c, n)``: one GGUF key (or a few) of a spec's ``gguf.metadata`` list
KeyWriter = Callable[[Any, "MoeConfig", int], None]
#: ``fill(cfg, name, shape, draws)``: the tiny models' values of a tensor of a mechanism's own role (a numpy array;
#: ``draws``: the seeded streams of ``ktconvert/model/tiny_weights.py``, which arch cannot import)
RoleFill = Callable[["MoeConfig", str, tuple, Any], Any]


class Mechanism(Protocol):
    name: str
    gguf_keys: Mapping[str, KeyWriter]
    #: its steps parsing config.json (``()``: it has no part of its own)
    parsers: tuple[ParseStep, ...]
    #: config.json count -> (smallest legal value, largest accepted value): ``ktconvert/families/limits.py``
    count_limits: Mapping[str, tuple[int, int]]
    #: role -> how the tiny models fill its tensors, for a role only this mechanism's tensors have (the shared roles,
    #: ``linear``, ``norm``, ..., are ``ktconvert/model/tiny_weights.py``'s)
    fills: Mapping[str, RoleFill]

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        """The tensors of ``layer`` this mechanism holds (``experts=False``: leave out the routed experts)."""

    def layer_modules(self, node: Any, cfg: MoeConfig) -> None:
        """Add this mechanism's modules under the decoder layer's module-tree node ``node``."""


@dataclass(frozen=True)
class ParseContext:
    """What a mechanism's parse step reads: config.json (``g``, ``raw``: its text view), the family spec's sections
    that name the mechanisms (the raw ``attention`` / ``config`` / ``routing`` dicts ``families/config.py`` reads),
    the core sizes parsed before the parts, and ``attention``, the attention fields the earlier steps gave (a
    later step builds on them: DSA's shared layers on Kimi Delta Attention's layer kinds)."""

    g: Getter
    raw: dict
    attention_spec: dict
    config_spec: dict
    routing_spec: dict
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_dim: int
    compress_rope: RopeSpec | None  # the second rope of the attention kind's ``ropes`` (compressed MQA's), else None
    moe_layers: tuple[int, ...]
    rms_norm_eps: float
    path: str | None
    attention: dict = field(default_factory=dict)


#: what a parse step gives: ``MoeConfig`` field -> value, where ``attention`` and ``routing`` map their parts' fields
Parsed = Mapping[str, Any]


class ParseStep(NamedTuple):
    """One parser of a mechanism: ``families/config.py`` runs every registered mechanism's steps by ``order`` (a
    refusal of a lower one comes first; a step reads what the lower ones gave), ``parse`` returning None where the
    spec does not use the mechanism."""

    order: int
    parse: Callable[[ParseContext], Parsed | None]


class MechanismBase:
    """The protocol's values a mechanism has unless it says: no parse step, no counts and no tensor role of its
    own (each mechanism class derives from this, the attention ones through :class:`AttentionMechanism`)."""

    parsers: tuple[ParseStep, ...] = ()
    count_limits: Mapping[str, tuple[int, int]] = {}
    fills: Mapping[str, RoleFill] = {}


class AttentionMechanism(MechanismBase):
    """What every attention mechanism has besides the protocol, with the common values: ``attr``, the decoder layer's
    attribute holding it (``self_attn`` / ``linear_attn``); ``recurrent``, a recurrent state instead of a KV cache
    (GGUF head_count_kv 0 where the spec writes it per layer; tagged as linear attention)."""

    attr = "self_attn"
    recurrent = False

    def head_dims(self, g: Getter, facts: dict, hidden: int, heads: int, path: str | None) -> tuple[int, int]:
        """``(head_dim, rope_dim)`` of a model whose spec's ``attention.kind`` (``facts``: that section) names this
        mechanism, read before the parts: config.json's ``head_dim`` (else hidden / heads) and its rotated part
        (``partial_rotary_factor`` / ``rotary_dim``, unless the spec says transformers ignores ``rotary_dim``)."""
        head_dim = g.opt("head_dim")
        head_dim = int(head_dim) if head_dim else hidden // heads
        raw = g.raw
        seen = raw if not facts.get("rotary_dim_ignored") else {k: v for k, v in raw.items() if k != "rotary_dim"}
        return head_dim, rotary_dim(seen, head_dim, facts.get("partial_rotary_factor", 1.0), path)

    def ropes(self, raw: dict, default_theta: float, rope_dim: int, max_pos: int,
              path: str | None) -> tuple[RopeSpec, RopeSpec | None]:
        """``(rope, second rope)``: the model's rope, and a second one where this kind rotates some layers with
        another (:class:`ParseContext`'s ``compress_rope``); None here."""
        return parse_rope(raw, default_theta, rope_dim, max_pos, path), None


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


def norm_role(cfg: MoeConfig) -> str:
    """The role of a norm weight: ``norm0`` where the family's norms are zero-centred (scaled by 1 + weight)."""
    return "norm0" if cfg.spec.zero_centered_norm else "norm"


def when(cond, write: Callable[[], Any]) -> None:
    """Run ``write`` only if ``cond``: a key written only when the config has the feature."""
    if cond:
        write()


class Getter:
    """config.json's values as the parsers read them (``families/config.py`` and each mechanism's ``parse``): an
    optional key with its default, a required integer, the first of several spellings; a wrong one is one
    :class:`~ktconvert.errors.InputError` naming the key."""

    def __init__(self, raw: dict, path: str | None):
        self.raw = raw
        self.path = path

    def opt(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key, default)
        return default if value is None and default is not None else value

    def int(self, key: str) -> int:
        value = self.raw.get(key)
        if value is None:
            raise InputError(f"missing required field {key!r}", path=self.path, where=key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise InputError(f"{key} must be an integer, got {value!r}", path=self.path, where=key)
        return int(value)

    def first_int(self, *keys: str) -> int:
        for key in keys:
            if self.raw.get(key) is not None:
                return self.int(key)
        raise InputError(f"missing the expert count (one of {', '.join(keys)})", path=self.path, where=keys[0])

    def choice(self, choice: dict) -> Any:
        """A spec ``choice``: a fixed value or a config key with its default."""
        return choice["fixed"] if "fixed" in choice else self.opt(choice["key"], choice["default"])
