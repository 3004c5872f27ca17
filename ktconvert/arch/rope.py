"""Rotary embedding parameters (``MoeConfig.rope``; not a mechanism of its own): :class:`RopeSpec`,
:func:`parse_rope` and :func:`rotary_dim`, which the attention mechanisms' ``head_dims`` / ``ropes`` read config.json
with (``base.py``'s defaults, ``mla.py``, ``compressed_mqa.py`` with its two ropes)."""

from __future__ import annotations

from dataclasses import dataclass

from ktconvert.errors import InputError


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters; ``kind`` is ``default``, ``linear`` or ``yarn``."""

    kind: str
    theta: float
    dim: int
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def parse_rope(raw: dict, default_theta: float, dim: int, max_pos: int, path: str | None) -> RopeSpec:
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
    else:
        params = dict(params)
    if "rope_layers" in params or any(isinstance(v, dict) for v in params.values()):
        raise InputError("per-layer rope_parameters are not supported", path=path, where="rope_parameters")
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeSpec(kind="default", theta=float(theta), dim=dim)
    if kind == "linear":
        return RopeSpec(kind="linear", theta=float(theta), dim=dim, factor=float(params["factor"]))
    if kind == "yarn":
        omax = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings", max_pos))
        factor = params.get("factor")
        factor = float(max_pos / omax) if factor is None else float(factor)

        def _f(key: str) -> float | None:
            v = params.get(key)
            return None if v is None else float(v)

        return RopeSpec(
            kind="yarn",
            theta=float(theta),
            dim=dim,
            factor=factor,
            original_max_position_embeddings=int(omax),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=_f("mscale"),
            mscale_all_dim=_f("mscale_all_dim"),
            attention_factor=_f("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )
    raise InputError(f"rope type {kind!r} is not supported (default, linear, yarn)", path=path, where="rope_scaling")


def rotary_dim(raw: dict, head_dim: int, default: float, path: str | None) -> int:
    """How many leading dims of each head are rotated: ``partial_rotary_factor`` as transformers 5 writes it
    (inside ``rope_parameters``) or as the hub configs do (top level), a hub ``rotary_dim`` (MiniMax-M2), else
    the family's default."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling")
    params = params if isinstance(params, dict) else {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    rotary_dim = raw.get("rotary_dim")
    if factor is None and rotary_dim is not None:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not 0 < rotary_dim <= head_dim:
            raise InputError(f"rotary_dim must be an integer in 1..head_dim ({head_dim}), got {rotary_dim!r}",
                             path=path, where="rotary_dim")
        factor = rotary_dim / head_dim
    factor = default if factor is None else factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise InputError(f"partial_rotary_factor must be a number in (0, 1], got {factor!r}", path=path,
                         where="partial_rotary_factor")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise InputError(f"partial_rotary_factor={factor} rotates {dim} of {head_dim} head dims; rope needs an even "
                         "count of at least 2", path=path, where="partial_rotary_factor")
    return dim
