"""Reading and writing golden manifests (``manifest.yaml``), validated against the schema both ways."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from ktconvert.errors import InputError
from ktconvert.resources import load_schema

MANIFEST_NAME = "manifest.yaml"
SCHEMA_NAME = "golden-manifest"


def validate_manifest(data: object, *, path: str | None = None) -> None:
    """Raise :class:`InputError` naming the first schema violation (with its location in the document)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(load_schema(SCHEMA_NAME))
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise InputError(f"golden manifest does not match its schema: {err.message}{more}", path=path, where=where)


def read_manifest(golden_dir: str | os.PathLike) -> dict:
    path = Path(golden_dir) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("golden manifest not found", path=str(path), fix="pass a directory written by `ktconvert golden`")
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", path=str(path))
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{mark.line + 1}:{mark.column + 1}" if mark else None
        raise InputError(f"not valid YAML: {getattr(exc, 'problem', exc)}", path=str(path), where=where)
    validate_manifest(data, path=str(path))
    return data


class _Dumper(yaml.SafeDumper):
    """Block style for mappings, one-line flow style for lists of scalars (ids, shapes)."""


def _represent_list(dumper: yaml.SafeDumper, items: list):
    flow = all(not isinstance(x, (list, dict)) for x in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def dump_manifest(data: dict) -> str:
    """The manifest as YAML text (validated first, so an invalid manifest is never written)."""
    validate_manifest(data)
    header = "# Golden outputs of a Hugging Face transformers run; written by `ktconvert golden`, do not edit.\n"
    body = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120, allow_unicode=True)
    return header + body
