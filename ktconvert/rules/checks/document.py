"""KT1xx on a file as a whole: the optimize-rules schema, keys upstream ignores, the backend comment, and the
schema of a ktconvert data file (``kind: ...``)."""

from __future__ import annotations

from ktconvert.io.datafile import schema_errors
from ktconvert.io.resources import schemas_dir
from ktconvert.rules.checks import check
from ktconvert.rules.suggest import suggest


@check("KT101", stage="load")
def yaml_syntax_error(ctx) -> None:
    exc = ctx.syntax_error
    if exc is not None:
        ctx.add("KT101", (), f"YAML error: {exc.message}", "fix the YAML syntax at this position", at=(exc.line, exc.col))


@check("KT102", stage="load")
def duplicate_keys(ctx) -> None:
    """The loader's findings (duplicate keys): PyYAML and upstream silently keep the last value."""
    for p in ctx.loaded.problems:
        ctx.add(p.id, (), p.message, p.fix, at=(p.line, p.col))


@check("KT103", stage="document")
def schema_violations(ctx, data: list) -> None:
    """Everything the optimize-rules schema refuses, except the keys KT104 and the ``recursive`` KT105 report."""
    for err in ctx.schema_errors:
        path = tuple(str(p) for p in err.absolute_path)
        if err.validator == "additionalProperties" or (path and path[-1] == "recursive" and err.validator == "type"):
            continue
        ctx.add("KT103", path, _schema_message(err), _schema_fix(err, path))


@check("KT104", stage="document")
def ignored_keys(ctx, data: list) -> None:
    for err in ctx.schema_errors:
        if err.validator != "additionalProperties":
            continue
        path = tuple(str(p) for p in err.absolute_path)
        known = list(err.schema.get("properties", {}))
        for k in (k for k in err.instance if k not in known):
            where = path + (str(k),)
            if path[1:] == ("replace",) and k == "device":
                ctx.add("KT104", where, "replace.device is ignored upstream (the line that read it is commented out)",
                        "set kwargs.generate_device and kwargs.prefill_device instead", key=True)
                continue
            hint = suggest(str(k), known)
            ctx.add("KT104", where, f"key {k!r} is ignored upstream" + (f"; did you mean {hint!r}?" if hint else ""),
                    f"use one of: {', '.join(known)}", key=True)


@check("KT105", stage="document")
def recursive_not_boolean(ctx, data: list) -> None:
    for err in ctx.schema_errors:
        path = tuple(str(p) for p in err.absolute_path)
        if path and path[-1] == "recursive" and err.validator == "type":
            v = err.instance
            truth = "true" if bool(v) else "false"
            ctx.add("KT105", path, f"recursive is {v!r}, not a boolean; upstream applies bool() so it means {truth}",
                    "write recursive: false (no quotes)")


@check("KT103", stage="document")
def backend_comment_unknown(ctx, data: list) -> None:
    if ctx.result.backend_source == "comment" and ctx.result.backend is None:
        line, name = ctx.backend_comment
        ctx.add("KT103", (), f"backend comment names {name!r}, not a known backend",
                f"use one of: {', '.join(ctx.catalog.backends)}", at=(line, 1))


@check("KT103", stage="data-file")
def data_file_schema(ctx, data: dict) -> None:
    """A ktconvert data file (``kind: ...``) checked against the schema of its kind."""
    kind = data["kind"]
    if not (schemas_dir() / f"{kind}.schema.json").is_file():
        ctx.add("KT103", ("kind",), f"unknown kind {kind!r}: no schema for it",
                "a rule file is a YAML list; ktconvert data files name a kind that has a schema in schemas/")
        return
    for err in sorted(schema_errors(data, kind), key=lambda e: list(map(str, e.absolute_path))):
        ctx.add("KT103", tuple(str(p) for p in err.absolute_path), f"{kind}: {err.message}",
                f"see schemas/{kind}.schema.json")


def _schema_message(err) -> str:
    if err.validator == "required":
        missing = [r for r in err.validator_value if r not in (err.instance or {})]
        return f"missing {', '.join(repr(m) for m in missing)}"
    if err.validator == "anyOf" and list(err.absolute_path)[-1:] == ["match"]:
        return "match needs at least one of 'name' and 'class' (upstream raises an Exception)"
    if err.validator == "type":
        return f"{err.instance!r} is not of type {err.validator_value}"
    return err.message


def _schema_fix(err, path) -> str:
    if err.validator == "required" and "replace" in err.validator_value:
        return "add replace: {class: default} or an operator class"
    if err.validator == "required" and "match" in err.validator_value:
        return "add match: {name: '^model\\\\.layers\\\\..*$'} (a regex) and/or class"
    if path and path[-1] == "kwargs":
        return "kwargs is a mapping of keyword arguments (remove the key if there are none)"
