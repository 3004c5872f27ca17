"""Loading ktconvert's own YAML data files (catalogs, recipes, tolerance profiles, gate suites) the one way:
safe YAML with positions, duplicate keys refused, then the file's JSON Schema, each failure one InputError that
names the file, the line:column and where the schema is."""

from __future__ import annotations

from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.resources import load_schema
from ktconvert.rules import yamlpos


def load_yaml(path: str | Path, shown: str | None = None) -> yamlpos.Loaded:
    """Parse ``path``; ``shown`` is how messages name it (e.g. ``rules/convert/Q8_0.yaml`` for a preset)."""
    shown = shown or str(path)
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


def validate(data, where, schema: str, shown: str, what: str) -> None:
    """Raise for the most relevant schema error; ``where(path_tuple) -> (line, col)`` places it."""
    import jsonschema

    errors = jsonschema.Draft202012Validator(load_schema(schema)).iter_errors(data)
    error = jsonschema.exceptions.best_match(errors)
    if error is not None:
        line, col = where(tuple(str(p) for p in error.absolute_path))
        raise InputError(f"not a valid {what}: {error.message}", path=shown, where=f"{line}:{col}",
                         fix=f"see schemas/{schema}.schema.json")


def load_data_file(path: str | Path, schema: str, what: str, shown: str | None = None) -> yamlpos.Loaded:
    """``load_yaml`` then ``validate`` against ``schemas/<schema>.schema.json``."""
    loaded = load_yaml(path, shown)
    validate(loaded.data, loaded.where, schema, shown or str(path), what)
    return loaded
