"""``ktconvert inspect``: thin wrapper over ktconvert.formats (options -> report -> render -> exit code)."""

from __future__ import annotations

import json
import sys

import click


def _progress_factory(enabled: bool):
    """A tqdm byte bar on stderr when it is a terminal; nothing otherwise (logs stay clean)."""

    def factory(total: int):
        if not enabled or not sys.stderr.isatty():
            return None
        from tqdm import tqdm  # shipped with the gguf package

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="scan", file=sys.stderr, leave=False)
        factory.bars.append(bar)
        return bar.update

    factory.bars = []
    return factory


@click.command("inspect")
@click.argument("path", type=click.Path(path_type=str))
@click.option("-o", "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--tensors", "tensors", metavar="REGEX",
              help="List the tensors whose names match (re.search) with both shape orders; with --scan, scan only those.")
@click.option("--config", "config", metavar="FILE", type=click.Path(path_type=str),
              help="config.json to check shapes against (default: the one next to the checkpoint, else GGUF metadata).")
@click.option("--scan", is_flag=True, help="Read the data: report NaN/Inf values and all-zero experts by name.")
@click.pass_context
def command(ctx, path, fmt, tensors, config, scan):
    """Show what a checkpoint holds: architecture, expert layout per layer, shapes in numpy and ggml order,
    quant types, bytes per tensor group, and problems.

    PATH is a .safetensors file, a directory of shards or its *.safetensors.index.json, a .gguf file, or a split
    GGUF set (any shard or the directory). Only headers are read unless --scan is given.

    Exit codes: 0 no errors, 1 problems of severity error (NaN/Inf found by --scan included), 2 usage error,
    3 unreadable or malformed input.
    """
    from ktconvert.formats.inspect_report import build_inspect_report
    from ktconvert.formats.inspect_text import render_text

    obj = ctx.find_object(dict) or {}
    factory = _progress_factory(obj.get("verbosity", 1) > 0)
    try:
        report = build_inspect_report(path, config=config, tensors=tensors, scan=scan, progress_factory=factory)
    finally:
        for bar in factory.bars:
            bar.close()
    if fmt == "json":
        click.echo(json.dumps(report, indent=2))
    else:
        color = obj.get("color")
        style = (lambda s, **kw: click.style(s, **kw)) if color is not False else (lambda s, **kw: s)
        click.echo(render_text(report, style=style), color=color)
    ctx.exit(report["exit_code"])
