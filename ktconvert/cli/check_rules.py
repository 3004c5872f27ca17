"""``ktconvert check-rules``: thin wrapper over ktconvert.rules (options -> check -> render -> exit code)."""

from __future__ import annotations

import json
import time

import click

from ktconvert.errors import UsageProblem


def _ids(value: str | None) -> tuple:
    if not value:
        return ()
    return tuple(v.strip().upper() for v in value.split(",") if v.strip())


@click.command("check-rules")
@click.argument("paths", nargs=-1, type=click.Path(path_type=str))
@click.option("--backend", type=click.Choice(["auto", "ktransformers", "balance_serve"]), default="auto", show_default=True,
              help="Backend the files are for; auto: a file name containing 'serve' means balance_serve, and a "
                   "'# ktconvert: backend=NAME' comment overrides the name.")
@click.option("--model", "model", metavar="CONFIG_OR_DIR", help="config.json (or its directory): check against the model's module tree.")
@click.option("--weights", metavar="PATH", help="Checkpoint (.gguf, split GGUF set, .safetensors or shard directory): check "
              "that the tensors the operators load exist, in types they can run (needs --model unless a config.json lies beside it).")
@click.option("--catalog", "catalogs", multiple=True, metavar="FILE", help="Operator catalog layered over the built-in one (repeatable).")
@click.option("-o", "--format", "fmt", type=click.Choice(["text", "json", "github"]), default="text", show_default=True)
@click.option("--strict", is_flag=True, help="Warnings fail too (exit 1).")
@click.option("--select", "select", metavar="IDS", help="Only these check IDs or prefixes, comma-separated (e.g. KT2,KT301).")
@click.option("--ignore", "ignore", metavar="IDS", help="Skip these check IDs or prefixes, comma-separated.")
@click.option("--list-checks", is_flag=True, help="List every check with its ID and severity, then exit.")
@click.option("--explain", is_flag=True, help="With --model: print the resolved injection plan (one row per module).")
@click.pass_context
def command(ctx, paths, backend, model, weights, catalogs, fmt, strict, select, ignore, list_checks, explain):
    """Validate ktransformers optimize-rule YAML files (files or directories, recursively).

    Exit codes: 0 clean, 1 findings (errors; warnings too with --strict), 2 usage error, 3 unreadable input.
    """
    from ktconvert.rules import findings, lint, report
    from ktconvert.rules.catalog import load_catalog

    if list_checks:
        click.echo(report.list_checks())
        return
    if not paths:
        raise UsageProblem("give at least one rule file or directory", where="PATH", fix="ktconvert check-rules rules/optimize/")
    if explain and not model:
        raise UsageProblem("--explain needs --model CONFIG_OR_DIR", where="--explain", fix="add --model path/to/config.json")
    known = findings.registry()
    for opt, ids in (("--select", _ids(select)), ("--ignore", _ids(ignore))):
        for i in ids:
            if not any(k.startswith(i) for k in known):
                raise UsageProblem(f"{i!r} names no check", where=opt, fix="see ktconvert check-rules --list-checks")
    started = time.perf_counter()
    catalog = load_catalog(catalogs)
    options = lint.Options(backend=backend, model=model, catalogs=tuple(catalogs), select=_ids(select), ignore=_ids(ignore),
                           explain=explain, weights=weights)
    result = lint.check_paths(paths, options, catalog)
    elapsed = time.perf_counter() - started
    verbosity = ctx.find_object(dict).get("verbosity", 1)
    if fmt == "json":
        click.echo(json.dumps(report.as_json(result, strict, elapsed), indent=2))
    elif fmt == "github":
        text = report.as_github(result)
        if text:
            click.echo(text)
    else:
        color = ctx.find_object(dict).get("color")
        text = report.as_text(result, verbosity, elapsed, style=lambda s, **kw: click.style(s, **kw) if color is not False else s)
        if text:
            click.echo(text, color=color)
    ctx.exit(result.exit_code(strict))

