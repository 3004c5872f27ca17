"""The operator catalog: data describing what each upstream operator accepts, loaded and layered.

check-rules never imports the classes a rule names; everything it knows about an operator comes from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.io.datafile import load_data_file
from ktconvert.io.resources import rules_dir

#: the ``ggml_types`` set whose members are measured, not listed (ktconvert/quant/kt_llamafile.py)
MEASURED_LLAMAFILE = "kt-llamafile"
SECTIONS = ("backends", "module_types", "ggml_type_sets", "ops", "kwarg_sets", "operators")


@dataclass(frozen=True)
class OpSlot:
    """One ``*_op`` kwarg of a wrapper: which op kind it selects and which kwarg holds its device."""

    name: str
    kind: str
    device_kwarg: str
    default: str | None
    default_device: str | None
    unused: bool


@dataclass
class Operator:
    path: str
    role: str
    backends: list
    contract: str
    replaces: list
    kwargs: dict
    calls: dict = field(default_factory=dict)
    ops: dict = field(default_factory=dict)
    none_ok: list = field(default_factory=list)
    none_note: str = ""
    required_when_kwargs: list = field(default_factory=list)
    emulation: str | None = None
    note: str = ""
    variant: str = ""

    @property
    def short(self) -> str:
        return self.path.rsplit(".", 1)[-1]


@dataclass
class Catalog:
    """Merged catalog with the lookups the checks need (all pure dictionary work)."""

    raw: dict
    sources: list

    def __post_init__(self):
        raw = self.raw
        self.backends: dict = raw.get("backends", {})
        self.module_types: dict = raw.get("module_types", {})
        self.ops: dict = raw.get("ops", {})
        self.type_sets: dict = raw.get("ggml_type_sets", {})
        self.alias_to_type = {}
        self._ancestry: dict[str, frozenset] = {}
        self._may_replace: dict[tuple, bool] = {}
        for type_id, spec in self.module_types.items():
            for alias in spec.get("aliases", []):
                self.alias_to_type[alias] = type_id
        self.op_classes = {spec["class"]: name for name, spec in self.ops.items() if "class" in spec}
        sets = raw.get("kwarg_sets", {})
        self.operators: dict[str, Operator] = {}
        for path, spec in raw.get("operators", {}).items():
            kwargs = {}
            for set_name in spec.get("kwarg_sets", []):
                kwargs.update(sets.get(set_name, {}))
            kwargs.update(spec.get("kwargs", {}))
            ops = {
                name: OpSlot(name, o["kind"], o["device_kwarg"], o.get("default"), o.get("default_device"),
                             bool(o.get("unused", False)))
                for name, o in spec.get("ops", {}).items()
            }
            self.operators[path] = Operator(
                path=path, role=spec["role"], backends=list(spec["backends"]), contract=spec["contract"],
                replaces=list(spec["replaces"]), kwargs=kwargs, calls=dict(spec.get("calls", {})), ops=ops,
                none_ok=list(spec.get("none_ok", [])), none_note=spec.get("none_note", ""),
                required_when_kwargs=list(spec.get("required_when_kwargs", [])), emulation=spec.get("emulation"),
                note=spec.get("note", ""), variant=spec.get("variant", ""),
            )
        self.all_kwarg_names = sorted(
            {k for op in self.operators.values() for k in op.kwargs}
            | {k for spec in self.ops.values() for k in spec.get("kwargs", {})}
            | {slot for op in self.operators.values() for slot in op.ops}
        )

    def decoder_contract(self, backend: str | None, op: Operator) -> str | None:
        """How ``backend``'s decoder layer calls a norm / MLP operator like ``op``: the backend's contract, unless
        the operator's variant runs only inside models whose decoder layer calls it another way."""
        spec = self.backends.get(backend, {}) if backend else {}
        return spec.get("variant_contracts", {}).get(op.variant, spec.get("contract"))

    # --- module types -------------------------------------------------------------------------------
    def type_of_class(self, class_path: str) -> str | None:
        return self.alias_to_type.get(class_path)

    def ancestry(self, type_id: str) -> frozenset:
        """The type and every base: what ``isinstance`` would accept for a module of this type."""
        known = self._ancestry.get(type_id)
        if known is not None:
            return known
        seen, todo = set(), [type_id]
        while todo:
            t = todo.pop()
            if t in seen:
                continue
            seen.add(t)
            todo.extend(self.module_types.get(t, {}).get("bases", []))
        self._ancestry[type_id] = frozenset(seen)
        return self._ancestry[type_id]

    def is_instance(self, module_type: str, class_type: str) -> bool:
        known = self._ancestry.get(module_type)
        return class_type in (known if known is not None else self.ancestry(module_type))

    def role_of(self, type_id: str) -> str:
        return self.module_types.get(type_id, {}).get("role", "any")

    def may_replace(self, op: Operator, module_type: str) -> bool:
        key = (op.path, module_type)
        hit = self._may_replace.get(key)
        if hit is None:
            lineage = self.ancestry(module_type)
            roles = {self.role_of(t) for t in lineage}
            hit = "any" in op.replaces or any(r in roles or r in lineage for r in op.replaces)
            self._may_replace[key] = hit
        return hit

    # --- ops ----------------------------------------------------------------------------------------
    def op_kwargs(self, op_name: str) -> dict:
        return self.ops.get(op_name, {}).get("kwargs", {})

    def ggml_type_set(self, op_name: str, backend: str | None = None) -> list | str:
        """What the catalog says an op runs, unresolved: a list of ggml type names, ``'any'`` or a set's name."""
        spec = self.ops.get(op_name, {})
        if backend and backend in spec.get("backend_ggml_types", {}):
            return spec["backend_ggml_types"][backend]
        return spec.get("ggml_types", "any")

    def ggml_types(self, op_name: str, backend: str | None = None) -> list | str:
        """Weight types an op can run: ``'any'`` or a list of ggml type names. The set ``kt-llamafile`` is the
        measured table of kt-kernel's LLAMAFILE method (``rules/kernels/kt-llamafile.yaml``)."""
        value = self.ggml_type_set(op_name, backend)
        if value == MEASURED_LLAMAFILE:
            from ktconvert.quant import kt_llamafile  # numpy and gguf: only on the --weights path

            return kt_llamafile.runnable()
        if isinstance(value, str) and value != "any":
            return self.type_sets.get(value, "any")
        return value

    def ops_of_kind(self, kind: str) -> list[str]:
        return sorted(name for name, spec in self.ops.items() if spec["kind"] == kind)


def _load_one(path: Path) -> dict:

    return load_data_file(path, "operator-catalog", "operator catalog").data


BUILTIN = "catalog/ktransformers.yaml"


@lru_cache(maxsize=8)
def _load_cached(paths: tuple) -> Catalog:
    merged: dict = {s: {} for s in SECTIONS}
    for p in paths:
        data = _load_one(Path(p))
        for section in SECTIONS:
            merged[section].update(data.get(section) or {})
    return Catalog(raw=merged, sources=list(paths))


def load_catalog(extra: list | tuple = ()) -> Catalog:
    """The built-in catalog with ``extra`` catalog files layered over it, later files winning per entry."""
    paths = (str(rules_dir() / BUILTIN),) + tuple(str(Path(p)) for p in extra)
    for p in paths[1:]:
        if not Path(p).is_file():
            raise InputError("catalog file not found", path=p, fix="pass an operator-catalog YAML file to --catalog")
    return _load_cached(paths)
