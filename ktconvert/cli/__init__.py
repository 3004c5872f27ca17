"""The ``ktconvert`` click group: thin option parsing, one library call, rendering, exit codes.

Subcommands load lazily (``COMMANDS`` maps a name to ``module:attribute``) so that a fast path such as
``check-rules`` never pays for, or even imports, torch.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
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
    "imatrix": "ktconvert.cli.imatrix:command",
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

    def make_context(self, info_name, args, parent=None, **extra):
        raw = _hoist_levels(list(args))
        args = list(raw)
        try:
            ctx = super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise _OneLineUsage(exc, raw) from None
        ctx.meta[_ARGV] = raw
        return ctx

    def invoke(self, ctx):
        """Run the subcommand. ``-q`` (text output) holds back its stdout and shows it only when the run fails:
        quiet means an exit code and nothing else on success, for every command alike."""
        raw = ctx.meta.get(_ARGV, [])
        if _level(raw) >= 0 or _wants_json(raw):
            return self._invoke(ctx, raw)
        held, ok = io.StringIO(), False
        try:
            with contextlib.redirect_stdout(held):
                rv = self._invoke(ctx, raw)
            ok = True
            return rv
        except click.exceptions.Exit as exc:
            ok = exc.exit_code == 0
            raise
        finally:
            if not ok:
                sys.stdout.write(held.getvalue())

    def _invoke(self, ctx, raw: list[str]):
        try:
            return super().invoke(ctx)
        except KtError as exc:
            _report(ctx, f"error: {exc.one_line()}")
            _json_error(raw, exc.exit_code, type(exc).__name__, exc.message, exc.path, exc.where, exc.fix)
            ctx.exit(exc.exit_code)
        except click.UsageError as exc:
            raise _OneLineUsage(exc, raw) from None
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            _report(ctx, "interrupted")
            ctx.exit(130)
        except Exception as exc:  # a bug in ktconvert itself: say so in one line, details with -v
            _report(ctx, f"internal error: {type(exc).__name__}: {exc} (rerun with -v for the traceback and report it)")
            _json_error(raw, 3, "InternalError", f"{type(exc).__name__}: {exc}", None, None,
                        "rerun with -v for the traceback and report it")
            ctx.exit(3)


_ARGV = "ktconvert.argv"
_LEVELS = {"-q": -1, "--quiet": -1, "-qq": -2, "-v": 1, "--verbose": 1, "-vv": 2}


def _hoist_levels(args: list[str]) -> list[str]:
    """``ktconvert CMD ... -q`` means ``ktconvert -q CMD ...``: the group's -q/-v are accepted after the command
    too (never after ``--``, where preflight takes a pasted command line)."""
    at = next((i for i, a in enumerate(args) if a in COMMANDS), None)
    if at is None:
        return args
    tail = args[at + 1:]
    end = tail.index("--") if "--" in tail else len(tail)
    moved = [a for a in tail[:end] if a in _LEVELS]
    return moved + args[: at + 1] + [a for a in tail[:end] if a not in _LEVELS] + tail[end:]


def _level(raw: list[str]) -> int:
    at = next((i for i, a in enumerate(raw) if a in COMMANDS), len(raw))
    return sum(_LEVELS.get(a, 0) for a in raw[:at])


class _OneLineUsage(click.UsageError):
    """A click usage error as one line (click prints usage, a hint and the error on three), plus the JSON error
    object when ``-o json`` was asked for."""

    def __init__(self, exc: click.UsageError, raw: list[str]):
        super().__init__(exc.format_message(), exc.ctx)
        self.raw = raw

    def show(self, file=None) -> None:
        cmd = self.ctx.command_path if self.ctx is not None else "ktconvert"
        fix = f"see '{cmd} --help'"
        click.echo(f"ktconvert: error: {cmd}: {self.format_message()} ({fix})", err=True)
        _json_error(self.raw, self.exit_code, "UsageError", self.format_message(), None, None, fix)


def _wants_json(raw: list[str]) -> bool:
    """``-o json`` / ``--format json`` anywhere in the command line (read from the words, so that it also works
    when parsing itself failed)."""
    for i, a in enumerate(raw):
        if a in ("-o", "--format") and raw[i + 1: i + 2] == ["json"]:
            return True
        if a in ("-ojson", "--format=json"):
            return True
    return False


def _json_error(raw: list[str], code: int, kind: str, message: str, path, where, fix) -> None:
    """The one JSON error object every command with ``-o json`` prints on stdout when it fails."""
    if not _wants_json(raw):
        return
    cmd = next((a for a in raw if a in COMMANDS), None)
    click.echo(json.dumps({
        "tool": f"ktconvert {cmd}" if cmd else "ktconvert", "version": __version__, "status": "error",
        "exit_code": code,
        "error": {"code": kind, "message": message, "file": None if path is None else str(path),
                  "place": where, "fix": fix},
    }, indent=2))


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
    # numpy's OpenBLAS starts a thread per core when numpy is imported, each spinning about 0.1 CPU-s before it
    # sleeps: per process (and -j worker, which inherits this), on every core, for a library ktconvert uses for
    # nothing it parallelizes itself (-j, --threads). Before any command imports numpy; a user's setting stands.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    cli.main(args=argv if argv is not None else sys.argv[1:], prog_name="ktconvert")
