"""Rotary embedding parameters (``MoeConfig.rope``; not a mechanism of its own): :class:`RopeSpec` and
:func:`parse_rope`, which ``families/config.py`` and ``compressed_mqa.py`` (its two ropes) read config.json with."""

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
