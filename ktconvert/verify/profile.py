"""Tolerance profiles: the limits a verify run is held to, as data (``rules/tolerances/*.yaml`` or any file).

Nothing in code says how close is close enough; a profile names each limit, and the report says which
limit a run breached, by how much, and where.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ktconvert.errors import InputError, UsageProblem
from ktconvert.io.datafile import load_yaml, validate
from ktconvert.families import families as all_families, find as find_family
from ktconvert.io.resources import rules_dir
from ktconvert.verify.metrics import LogitStats, compare_logits, tie_margins

KIND = "tolerance-profile"
DEFAULT_MIN_SHARE = 0.1  # localisation heuristic when a profile does not set one (not a pass/fail limit)
DEFAULT_EXPERT_OUTLIER = 3.0  # an expert this many times its layer's median NMSE stands out (not a limit)


@dataclass
class Profile:
    name: str
    source: str
    data: dict
    family: str | None = None  # set by :meth:`for_family`: its overrides are merged into ``data``

    def for_family(self, family: str) -> "Profile":
        """The limits that hold for ``family``: the base ones with every matching override applied in order."""
        data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.data.items() if k != "overrides"}
        for ov in self.data.get("overrides", []):
            if family in ov["families"]:
                for section in ("logits", "hidden_states"):
                    if section in ov:
                        data[section] = {**data.get(section, {}), **ov[section]}
        return Profile(self.name, self.source, data, family)

    @property
    def logits(self) -> dict:
        return self.data.get("logits", {})

    @property
    def hidden_nmse(self) -> float | None:
        return self.data.get("hidden_states", {}).get("nmse_max")

    @property
    def topk(self) -> int:
        return int(self.logits.get("topk", {}).get("k", 5))

    @property
    def top1_tie_margin(self) -> float | None:
        m = self.logits.get("top1_tie_margin")
        return None if m is None else float(m)

    def compare(self, golden, candidate) -> LogitStats:
        """Golden vs candidate logits ``[T, V]`` as this profile judges them: top-k with its k, top-1 with the
        near-ties of its noise set aside (:func:`ktconvert.verify.metrics.tie_margins`)."""
        margins = tie_margins(golden, self.logits.get("nmse_max"), self.top1_tie_margin)
        return compare_logits(golden, candidate, self.topk, margins)

    @property
    def not_emulated_policy(self) -> str:
        return self.data.get("not_emulated", "warn")

    @property
    def min_share(self) -> float:
        return float(self.data.get("localization", {}).get("min_share", DEFAULT_MIN_SHARE))

    @property
    def expert_outlier(self) -> float:
        return float(self.data.get("localization", {}).get("expert_outlier", DEFAULT_EXPERT_OUTLIER))

    def as_dict(self) -> dict:
        limits = {k: v for k, v in self.data.items() if k in ("logits", "hidden_states", "not_emulated")}
        return {"name": self.name, "source": self.source, "family": self.family, "limits": limits}


@dataclass
class Breach:
    """One limit a phase broke: ``value`` vs ``limit`` (``op`` says which side is allowed) and where."""

    phase: str
    metric: str
    value: float | None
    limit: float | None
    op: str  # "<=" or ">="
    where: str = ""

    def as_dict(self) -> dict:
        return {"phase": self.phase, "metric": self.metric, "value": _json(self.value), "limit": self.limit,
                "op": self.op, "where": self.where}

    def line(self) -> str:
        v = "NaN/Inf" if self.value is None or not math.isfinite(self.value) else f"{self.value:.4g}"
        lim = "" if self.limit is None else f" (limit {self.op} {self.limit:g})"
        at = f"; {self.where}" if self.where else ""
        return f"{self.phase}: {self.metric} {v}{lim}{at}"


def _json(v):
    if v is None:
        return None
    return float(v) if math.isfinite(float(v)) else None


def shipped_profiles() -> dict[str, Path]:
    """Name -> file of every profile under ``rules/tolerances/``."""
    root = rules_dir() / "tolerances"
    return {p.stem: p for p in sorted(root.glob("*.yaml"))} if root.is_dir() else {}


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, or a profile file by path; validated against its schema with positions."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists() or "/" in name_or_path:
        if not p.is_file():
            raise InputError("tolerance profile not found", path=str(p), fix="pass a profile name or a YAML file")
        return _load_file(p)
    known = shipped_profiles()
    if name_or_path not in known:
        raise InputError(f"no tolerance profile named {name_or_path!r} (shipped: {', '.join(known) or 'none'})",
                         fix="pick a shipped profile or pass a YAML file with kind: tolerance-profile")
    return _load_file(known[name_or_path])


def _load_file(path: Path) -> Profile:

    loaded = load_yaml(path)
    data = loaded.data
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise InputError(f"not a tolerance profile (needs `kind: {KIND}`)", path=str(path), where="1:1",
                         fix="see schemas/tolerance-profile.schema.json")
    validate(data, loaded.where, KIND, str(path), "tolerance profile")
    for i, ov in enumerate(data.get("overrides") or ()):
        for j, family in enumerate(ov["families"]):
            if find_family(family) is None:
                raise InputError(f"unknown family {family!r}", path=str(path),
                                 where="{}:{}".format(*loaded.where(("overrides", str(i), "families", str(j)))),
                                 fix=f"name a family of rules/families/ ({', '.join(all_families())})")
    return Profile(name=data["name"], source=str(path), data=data)


def _bits(qtype: str) -> float:

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    except KeyError:
        return float("inf")
    return 8.0 * size / block


def auto_profile(expert_types: set[str]) -> Profile:
    """The shipped profile for the experts' least precise type (fewest bits per weight), for ``--tolerance
    auto``: a Q4_K_M file (Q4_K gate/up, Q6_K down) is held to the Q4_K limits."""
    if not expert_types:
        raise UsageProblem("the model has no expert tensors to choose a profile by", fix="pass --tolerance NAME|FILE")
    qtype = min(sorted(expert_types), key=_bits)
    for path in shipped_profiles().values():
        prof = _load_file(path)
        if qtype in prof.data.get("ggml_types", []):
            return prof
    raise UsageProblem(f"no shipped tolerance profile is meant for {qtype} experts",
                       fix=f"pass --tolerance NAME|FILE (shipped: {', '.join(shipped_profiles())})")


def evaluate(profile: Profile, phase: str, summary: dict, layer_nmse: list[tuple[str, float]]) -> list[Breach]:
    """Every limit of ``profile`` that ``phase``'s numbers break (NaN counts as broken)."""
    out: list[Breach] = []
    lg = profile.logits

    def upper(metric: str, value: float, limit, where: str = "") -> None:
        if limit is not None and not (value <= limit):  # NaN fails
            out.append(Breach(phase, metric, value, float(limit), "<=", where))

    def lower(metric: str, value: float, limit, where: str = "") -> None:
        if limit is not None and not (value >= limit):
            out.append(Breach(phase, metric, value, float(limit), ">=", where))

    upper("max_abs_diff", summary["max_abs_diff"], lg.get("max_abs_diff"), f"position {summary['max_abs_diff_position']}")
    upper("nmse_max", summary["nmse_max"], lg.get("nmse_max"), f"position {summary['nmse_max_position']}")
    upper("kl_mean", summary["kl_mean"], lg.get("kl_mean"))
    upper("kl_p99", summary["kl_p99"], lg.get("kl_p99"))
    upper("kl_max", summary["kl_max"], lg.get("kl_max"), f"position {summary['kl_max_position']}")
    first = summary.get("first_top1_mismatch")
    ties = summary.get("top1_near_ties") or []
    where = "; ".join(x for x in (f"first mismatch: position {first}" if first is not None else "",
                                  f"{len(ties)} near-tie position(s) set aside" if ties else "") if x)
    lower("top1_agreement", summary["top1_agreement"], lg.get("top1_agreement_min"), where)
    tk = lg.get("topk", {})
    lower(f"top{summary['topk']}_overlap_mean", summary["topk_overlap_mean"], tk.get("overlap_mean_min"))
    lower(f"top{summary['topk']}_overlap_min", summary["topk_overlap_min"], tk.get("overlap_min"))
    limit = profile.hidden_nmse
    if limit is not None:
        for name, value in layer_nmse:
            if not (value <= limit):
                out.append(Breach(phase, "hidden_nmse", value, float(limit), "<=", name))
                break  # the first layer over the limit; later ones inherit its error
    return out

