"""Gate suites as data: cases of (family, rule file, conversion, golden, tolerance), validated with positions.

A case either converts a family's tiny model (``family`` + ``type``/``recipe``), or names a real checkpoint on disk
(``model``: its directory, ``candidate``: its conversion, both absolute or relative to the suite file, and an
optional ``max_memory`` budget for verify) so a team's CI can gate the conversions it serves. Every path is
checked when the suite loads, before any case runs."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from ktconvert import families
from ktconvert.errors import InputError
from ktconvert.golden.paths import golden_root
from ktconvert.io.datafile import load_data_file
from ktconvert.io.resources import rules_dir
from ktconvert.io.sizes import parse_size
from ktconvert.verify import shipped_profiles


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    rules: Path
    golden: Path
    tolerance: str  # a shipped profile name or a file path
    type: str | None = None
    recipe: str | None = None
    tags: tuple = ()
    kernel: str = "emulate"  # verify --kernel: emulate, kt-kernel or both
    to: str = "gguf"  # quantize --to: gguf, or kt-amx (verified as --kt-weights)
    variant: str | None = None  # a tiny variant of the family (spec tiny.variants) instead of its tiny model
    lora: str | None = None  # the family's tiny adapter: "verify" (verify --lora) or "quantize" (quantize --lora)
    model: Path | None = None  # a real model directory: the case verifies ``candidate`` against it, converting nothing
    candidate: Path | None = None  # its conversion: a GGUF, safetensors, or (to: kt-amx) a kt-amx directory
    max_memory: int | None = None  # verify --max-memory, in bytes

    @property
    def tiny(self) -> str:
        """The tiny model the case converts (``FAMILY`` or ``FAMILY-VARIANT``): cases sharing it share one model.
        A case naming a model directory has none: its key is its own name (it shares nothing)."""
        if self.model is not None:
            return f"model:{self.name}"
        return self.family if self.variant is None else f"{self.family}-{self.variant}"

    @property
    def conversion(self) -> str:
        """What ``ktconvert quantize`` is asked for: cases sharing it share one converted checkpoint."""
        if self.candidate is not None:
            return f"candidate:{self.candidate.name}"
        what = f"recipe:{self.recipe}" if self.recipe else f"type:{self.type}"
        if self.lora == "quantize":
            what = f"lora:{what}"
        return what if self.to == "gguf" else f"{self.to}:{what}"


@dataclass
class Suite:
    path: Path
    cases: list[Case] = field(default_factory=list)
    description: str = ""

    def select(self, pattern: str | None) -> list[Case]:
        """``-k``: a substring or glob of case names and tags (``q4_k``, ``deepseek*``, ``serve``)."""
        if not pattern:
            return list(self.cases)
        glob = any(c in pattern for c in "*?[")

        def hit(text: str) -> bool:
            return fnmatch.fnmatch(text, pattern) if glob else pattern in text

        return [c for c in self.cases if hit(c.name) or any(hit(t) for t in c.tags)]


def default_suite_path() -> Path:

    return golden_root() / "suite.yaml"


def load_suite(path: str | Path, check_profiles: bool = True) -> Suite:
    """Read and validate a suite; every reference (rules, golden, profile) must resolve before anything runs.

    ``check_profiles=False`` is for measuring a suite whose profiles are still to be written.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError("gate suite not found", path=str(path), fix="pass a gate-suite YAML file (e.g. golden/suite.yaml)")
    loaded = load_data_file(path, "gate-suite", "gate suite")
    data = loaded.data
    cases, seen = [], set()
    for i, raw in enumerate(data["cases"]):
        where = "{}:{}".format(*loaded.where(("cases", str(i))))
        if raw["name"] in seen:
            raise InputError(f"case name {raw['name']!r} is used twice", path=str(path), where=where, fix="give every case its own name")
        seen.add(raw["name"])
        if "model" in raw:
            cases.append(_model_case(raw, path, where, check_profiles))
            continue
        if families.find(raw["family"]) is None:
            raise InputError(f"unknown family {raw['family']!r}", path=str(path), where=where,
                             fix=f"name a family of rules/families/ ({', '.join(families.families())})")
        cases.append(Case(
            name=raw["name"], family=raw["family"], rules=_rules(raw["rules"], path, where),
            golden=_golden(raw["golden"], path, where), tolerance=_tolerance(raw["tolerance"], path, where) if check_profiles else raw["tolerance"],
            type=raw.get("type"), recipe=raw.get("recipe"), tags=tuple(raw.get("tags", ())),
            kernel=raw.get("kernel", "emulate"), to=raw.get("to", "gguf"), variant=raw.get("variant"),
            lora=raw.get("lora"), max_memory=_budget(raw),
        ))
        if raw.get("lora") is not None and raw.get("variant") is not None:
            raise InputError("lora and variant together: the tiny adapter is made for the family's tiny model only",
                             path=str(path), where=where, fix="drop variant or lora")
        known = families.spec(raw["family"]).tiny.get("variants") or {}
        if raw.get("variant") is not None and raw["variant"] not in known:
            raise InputError(f"{raw['family']} has no tiny variant {raw['variant']!r}", path=str(path), where=where,
                             fix=f"choose one of {', '.join(known) or '(none)'} or drop variant")
    return Suite(path=path, cases=cases, description=data.get("description", ""))


#: what a case naming a model directory must not say: its family comes from the model's config.json, and it
#: converts nothing (no tiny model, no variant or adapter of one)
_TINY_ONLY = ("family", "type", "recipe", "variant", "lora")


def _model_case(raw: dict, suite: Path, where: str, check_profiles: bool) -> Case:
    """A case verifying a real conversion on disk: ``model`` and ``candidate`` resolved against the suite file and
    checked to exist (with the kind the case says), ``max_memory`` parsed; its family read from config.json."""
    from ktconvert.families.config import load_config

    name = raw["name"]
    extra = [k for k in _TINY_ONLY if k in raw]
    if extra:
        raise InputError(f"case {name!r} names a model directory and also {extra[0]}", path=str(suite), where=where,
                         fix=f"drop {extra[0]}: a model case converts nothing, its family comes from its config.json")
    kt_amx = raw.get("to") == "kt-amx"
    model = _existing(raw["model"], suite, where, name, "model", directory=True,
                      fix="give the model directory (config.json and its weights), absolute or relative to the suite file")
    if not (model / "config.json").is_file():
        raise InputError(f"case {name!r}: model {raw['model']!r} has no config.json", path=str(suite), where=where,
                         fix="give the Hugging Face model directory the candidate was converted from")
    candidate = _existing(raw["candidate"], suite, where, name, "candidate", directory=True if kt_amx else None,
                          fix="give the converted checkpoint: a .gguf, a .safetensors file or directory, or with "
                              "to: kt-amx a kt-amx directory; absolute or relative to the suite file")
    if candidate.is_file() and candidate.suffix not in (".gguf", ".safetensors"):
        raise InputError(f"case {name!r}: candidate {raw['candidate']!r} is neither a .gguf nor a .safetensors file",
                         path=str(suite), where=where, fix="give the converted checkpoint (a GGUF, safetensors, or a directory)")
    if kt_amx and raw.get("kernel", "emulate") == "emulate":
        raise InputError(f"case {name!r}: a kt-amx candidate is read by the real kernel only", path=str(suite),
                         where=where, fix="add kernel: kt-kernel (or both)")
    return Case(
        name=name, family=load_config(model).family, rules=_rules(raw["rules"], suite, where),
        golden=_golden(raw["golden"], suite, where),
        tolerance=_tolerance(raw["tolerance"], suite, where) if check_profiles else raw["tolerance"],
        tags=tuple(raw.get("tags", ())), kernel=raw.get("kernel", "emulate"), to=raw.get("to", "gguf"),
        model=model, candidate=candidate, max_memory=_budget(raw))


def _budget(raw: dict) -> int | None:
    """The case's ``max_memory`` in bytes (verify --max-memory), None when not given (the schema's pattern has
    already refused anything but a size)."""
    return None if "max_memory" not in raw else parse_size(raw["max_memory"], what="max_memory")


def _existing(ref: str, suite: Path, where: str, case: str, what: str, directory: bool | None, fix: str) -> Path:
    """``ref`` absolute or relative to the suite file's directory; it must exist (a directory when ``directory``)."""
    p = Path(ref).expanduser()
    p = p if p.is_absolute() else suite.parent / p
    if not p.exists():
        raise InputError(f"case {case!r}: {what} {ref!r} not found", path=str(suite), where=where, fix=fix)
    if directory and not p.is_dir():
        raise InputError(f"case {case!r}: {what} {ref!r} is not a directory", path=str(suite), where=where, fix=fix)
    return p


def _rules(ref: str, suite: Path, where: str) -> Path:
    shipped = rules_dir() / "optimize" / f"{ref}.yaml"
    for p in (shipped, (suite.parent / ref)):
        if p.is_file():
            return p
    raise InputError(f"rule file {ref!r} is neither shipped (rules/optimize/{ref}.yaml) nor a file", path=str(suite),
                     where=where, fix="name a shipped rule file or give a path relative to the suite")


def _golden(ref: str, suite: Path, where: str) -> Path:

    for p in (golden_root() / ref, suite.parent / ref):
        if (p / "manifest.yaml").is_file():
            return p
    raise InputError(f"golden {ref!r} not found (no manifest.yaml)", path=str(suite), where=where,
                     fix="name a golden under golden/ or a directory made by `ktconvert golden`")


def _tolerance(ref: str, suite: Path, where: str) -> str:

    if ref in shipped_profiles():
        return ref
    p = suite.parent / ref
    if p.is_file():
        return str(p)
    raise InputError(f"tolerance profile {ref!r} is neither shipped nor a file", path=str(suite), where=where,
                     fix=f"use one of {', '.join(sorted(shipped_profiles()))} or a profile file")
