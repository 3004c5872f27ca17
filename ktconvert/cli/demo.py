"""``ktconvert demo``: the main job end to end on the embedded default tiny model, with a short summary per step."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import click

from ktconvert import families


@click.command("demo")
@click.option("--family", type=click.Choice(families.FAMILIES),
              default=families.DEFAULT_FAMILY, show_default=True, help="Which tiny model to run the job on.")
@click.option("--keep", metavar="DIR", type=click.Path(file_okay=False, path_type=str),
              help="Keep the model, the conversion and the reports in DIR (must not exist) instead of a temp dir.")
@click.pass_context
def command(ctx, family, keep):
    """Make a tiny MoE model, check its rules, quantize it to Q4_K_M, and verify it against its golden.

    Exit codes: 0 every step passed, 1 a check or the verification failed, 3 an environment problem.
    """
    from ktconvert.demo import run_demo
    from ktconvert.errors import UsageProblem

    if keep and Path(keep).exists():
        raise UsageProblem("the --keep directory already exists", where="--keep", fix="name a new directory")
    workdir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="ktconvert-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    n = [0]

    def show(step):
        n[0] += 1
        mark = click.style("ok", fg="green") if step.ok else click.style("FAILED", fg="red", bold=True)
        click.echo(f"[{n[0]}/5] {step.name}: {mark} ({step.seconds:.1f} s)")
        for line in step.lines:
            click.echo(f"      {line}")

    try:
        result = run_demo(workdir, family, on_step=show)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    total = sum(s.seconds for s in result.steps)
    if result.ok:
        click.echo(f"demo passed in {total:.1f} s" + (f"; files kept in {workdir}" if keep else ""))
    else:
        click.echo(f"demo FAILED at step {len(result.steps)} after {total:.1f} s")
    ctx.exit(0 if result.ok else 1)
