"""Loading data files the one way: ktconvert's own YAML (catalogs, recipes, tolerance profiles, gate suites,
family specs, golden manifests) as safe YAML with positions, duplicate keys refused, then the file's JSON
Schema; JSON companions (config.json, indexes, state files) with one clear error. Each failure is one
InputError that names the file, the line:column (or JSON path) and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ktconvert.errors import InputError
from ktconvert.io import yamlpos
from ktconvert.io.files import regular_file_size
from ktconvert.io.resources import load_schema

if TYPE_CHECKING:
    import jsonschema


def load_yaml(path: str | Path, shown: str | None = None, *, missing_fix: str | None = None,
              what: str = "file") -> yamlpos.Loaded:
    """Parse ``path``; ``shown`` is how messages name it (e.g. ``rules/convert/Q8_0.yaml`` for a preset)."""
    shown = shown or str(path)
    if missing_fix and not Path(path).exists():
        raise InputError(f"{what} not found", path=shown, fix=missing_fix)
    text = yamlpos.read_text(Path(path))
    try:
        loaded = yamlpos.load_text(text, shown)
    except yamlpos.YamlSyntaxError as exc:
        raise InputError(f"invalid YAML: {exc.message}", path=shown, where=f"{exc.line}:{exc.col}",
                         fix="fix the YAML syntax") from None
    if loaded.problems:
        p = loaded.problems[0]
        raise InputError(p.message, path=shown, where=f"{p.line}:{p.col}", fix=p.fix)
    return loaded


def schema_errors(data, schema: str) -> list[jsonschema.ValidationError]:
    """Every violation of ``schemas/<schema>.schema.json``, the most relevant first."""
    import jsonschema  # on first use: a process that only reads JSON (a conversion worker) never validates

    errors = list(jsonschema.Draft202012Validator(load_schema(schema)).iter_errors(data))
    best = jsonschema.exceptions.best_match(iter(errors))
    return [best] + [e for e in errors if e is not best] if best is not None else []


def validate(data, where, schema: str, shown: str | None, what: str) -> None:
    """Raise for the most relevant schema error. ``where(path_tuple) -> (line, col)`` places it in the source
    text; without it (data built in memory) the place is the JSON path of the offending value."""
    errors = schema_errors(data, schema)
    if not errors:
        return
    error = errors[0]
    path = tuple(str(p) for p in error.absolute_path)
    if where is not None:
        line, col = where(path)
        place = f"{line}:{col}"
    else:
        place = "/".join(path) or "(top level)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    raise InputError(f"not a valid {what}: {error.message}{more}", path=shown, where=place,
                     fix=f"see schemas/{schema}.schema.json")


def load_data_file(path: str | Path, schema: str, what: str, shown: str | None = None, *,
                   missing_fix: str | None = None) -> yamlpos.Loaded:
    """``load_yaml`` then ``validate`` against ``schemas/<schema>.schema.json``."""
    loaded = load_yaml(path, shown, missing_fix=missing_fix, what=what)
    validate(loaded.data, loaded.where, schema, shown or str(path), what)
    return loaded


MAX_JSON_BYTES = 64 * 1024**2
"""config.json, indexes, tokenizer files and state files are small; anything larger is not one (refused unread)."""


def read_json(path: str | Path, what: str = "JSON file", *, shown: str | None = None, fix: str | None = None,
              obj: bool = True):
    """A JSON document (a JSON object unless ``obj=False``), or one InputError naming the file, the line:column of
    a syntax error and the fix. Every JSON companion file ktconvert reads comes through here."""
    shown = shown or str(path)
    return parse_json(read_json_bytes(path, what, shown=shown, fix=fix), what, shown=shown, fix=fix, obj=obj)


def read_json_bytes(path: str | Path, what: str = "JSON file", *, shown: str | None = None,
                    fix: str | None = None) -> bytes:
    """A JSON companion file's bytes (a regular file under :data:`MAX_JSON_BYTES`), for a caller that both hashes and
    parses it (:func:`parse_json`) from one read."""
    shown = shown or str(path)
    p = Path(path)
    try:
        regular_file_size(p, what, limit=MAX_JSON_BYTES, fix=fix)
        return p.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror}", path=shown, fix=fix) from None


def parse_json(data: bytes, what: str = "JSON file", *, shown: str = "<bytes>", fix: str | None = None,
               obj: bool = True):
    """:func:`read_json` of bytes already read."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not UTF-8 text (byte {exc.start})", path=shown, fix=fix) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{what} is not valid JSON: {exc.msg}", path=shown, where=f"{exc.lineno}:{exc.colno}",
                         fix=fix) from None
    except RecursionError:
        raise InputError(f"{what} nests too deeply to be real", path=shown, fix=fix) from None
    if obj and not isinstance(data, dict):
        raise InputError(f"{what} is not a JSON object", path=shown, fix=fix)
    return data
