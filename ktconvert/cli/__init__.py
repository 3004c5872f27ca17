"""The ``ktconvert`` click group: thin option parsing, one library call, rendering, exit codes.

Subcommands load lazily (``COMMANDS`` maps a name to ``module:attribute``) so that a fast path such as
``check-rules`` never pays for, or even imports, torch.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import click

from ktconvert import __version__
from ktconvert.errors import KtError

COMMANDS: dict[str, str] = {
    "check-rules": "ktconvert.cli.check_rules:command",
    "demo": "ktconvert.cli.demo:command",
    "gate": "ktconvert.cli.gate:command",
    "tiny-model": "ktconvert.cli.tiny_model:command",
    "golden": "ktconvert.cli.golden:command",
    "inspect": "ktconvert.cli.inspect_cmd:command",
    "verify": "ktconvert.cli.verify:command",
    "quantize": "ktconvert.cli.quantize:command",
    "convert-lora": "ktconvert.cli.convert_lora:command",
    "doctor": "ktconvert.cli.doctor:command",
    "preflight": "ktconvert.cli.preflight:command",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KtError as exc:
            _report(ctx, f"error: {exc.one_line()}")
            ctx.exit(exc.exit_code)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            _report(ctx, "interrupted")
            ctx.exit(130)
        except Exception as exc:  # a bug in ktconvert itself: say so in one line, details with -v
            _report(ctx, f"internal error: {type(exc).__name__}: {exc} (rerun with -v for the traceback and report it)")
            ctx.exit(3)


def _report(ctx: click.Context, line: str) -> None:
    obj = ctx.find_object(dict) or {}
    if obj.get("verbosity", 1) > 1:
        traceback.print_exc()
    click.echo(f"ktconvert: {line}", err=True)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("-v", "--verbose", count=True, help="More output; tracebacks on errors.")
@click.option("-q", "--quiet", count=True, help="Less output.")
@click.version_option(__version__, prog_name="ktconvert")
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: int) -> None:
    """Validate optimize rules, convert MoE expert layouts, and gate numerics against golden outputs.

    Exit codes: 0 clean, 1 findings or regression, 2 usage error, 3 input or environment error.
    """
    ctx.ensure_object(dict)
    ctx.obj["verbosity"] = 1 + verbose - quiet
    ctx.obj["color"] = None if os.environ.get("NO_COLOR") is None else False


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv if argv is not None else sys.argv[1:], prog_name="ktconvert")
