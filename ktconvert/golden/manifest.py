"""Reading and writing golden manifests (``manifest.yaml``), validated against the schema both ways."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from ktconvert.io.datafile import load_data_file, validate

MANIFEST_NAME = "manifest.yaml"
SCHEMA_NAME = "golden-manifest"


def validate_manifest(data: object, *, path: str | None = None) -> None:
    """Raise :class:`InputError` naming the first schema violation (with its location in the document)."""
    validate(data, None, SCHEMA_NAME, path, "golden manifest")


def read_manifest(golden_dir: str | os.PathLike) -> dict:
    path = Path(golden_dir) / MANIFEST_NAME
    return load_data_file(path, SCHEMA_NAME, "golden manifest",
                          missing_fix="pass a directory written by `ktconvert golden`").data


class _Dumper(yaml.SafeDumper):
    """Block style for mappings, one-line flow style for lists of scalars (ids, shapes)."""


def _represent_list(dumper: yaml.SafeDumper, items: list):
    flow = all(not isinstance(x, (list, dict)) for x in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def dump_manifest(data: dict) -> str:
    """The manifest as YAML text (validated first, so an invalid manifest is never written)."""
    validate_manifest(data)
    who = ("ktconvert's reference modules, streamed from disk" if data["producer"].get("engine") == "stream"
           else "Hugging Face transformers")
    header = f"# Golden outputs of a run of {who}; written by `ktconvert golden`, do not edit.\n"
    body = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120, allow_unicode=True)
    return header + body
