"""``ktconvert gate``: thin wrapper over ktconvert.gate (suite -> run -> table / JSON / JUnit -> exit code)."""

from __future__ import annotations

import json

import click

from ktconvert.cli.executor import executor_options


@click.command("gate")
@click.argument("suite", required=False, type=click.Path(path_type=str))
@click.option("-k", "select", metavar="PATTERN", help="Only cases whose name or tag contains PATTERN (or matches it as a glob).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes (each takes whole conversions); with --executor ray, Ray tasks at a time.")
@click.option("--junit", "junit", metavar="FILE", type=click.Path(dir_okay=False, path_type=str), help="Write a JUnit XML report.")
@click.option("-o", "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--list", "list_cases", is_flag=True, help="List the selected cases and exit.")
@click.option("--regen", is_flag=True, help="Regenerate the goldens the selected cases use (refused when CI is set; logged in each manifest).")
@click.option("--reason", help="Why the goldens are regenerated (required with --regen, recorded in the manifests).")
@executor_options("the cases (whole conversions with their verifications)")
@click.pass_context
def command(ctx, suite, select, jobs, junit, fmt, list_cases, regen, reason, executor, ray_address):
    """Run a gate suite: convert each case's tiny model, verify it against its golden under its tolerance profile.

    SUITE defaults to the shipped suite (golden/suite.yaml). Exit codes: 0 every case within its limits,
    1 a regression (a limit broken), 2 usage error, 3 a case could not run or an input is unusable.
    """
    from ktconvert.errors import UsageProblem
    from ktconvert.gate import default_suite_path, junit_xml, load_suite, run_suite
    from ktconvert.io.atomic import check_output_file, write_file

    if junit:
        check_output_file(junit, "--junit")  # before the run, not after it
    loaded = load_suite(suite or default_suite_path())
    cases = loaded.select(select)
    if not cases:
        raise UsageProblem(f"-k {select!r} selects no case of {loaded.path}", where="-k", fix="see ktconvert gate --list")
    if list_cases:
        for c in cases:
            click.echo(f"{c.name:<28} {c.family:<12} rules={c.rules.name:<22} {c.conversion:<14} tolerance={c.tolerance}")
        return
    if regen:
        if not reason:
            raise UsageProblem("--regen needs --reason", where="--regen", fix='add --reason "why the goldens change"')
        from ktconvert.gate.regen import regenerate_goldens

        for path in regenerate_goldens(loaded, reason, select):
            click.echo(f"regenerated {path}")
        return
    quiet = ctx.find_object(dict).get("verbosity", 1) < 1
    total = len(cases)
    finished = []

    def progress(r):
        finished.append(r)
        if not quiet:
            verdict = "ERROR" if r.error else ("ok" if r.passed else "FAIL")
            click.echo(f"[{len(finished)}/{total}] {r.case.name:<28} {verdict:<5} {r.seconds:5.1f}s", err=True)

    result = run_suite(loaded, select, jobs=jobs, progress=progress, executor=executor, ray_address=ray_address)
    if junit:
        write_file(junit, junit_xml(result).encode("utf-8"))
    if fmt == "json":
        click.echo(json.dumps(result.as_dict(), indent=2))
    else:
        click.echo(_table(result))
    code = 0 if result.passed else (3 if any(c.error for c in result.cases) and not any(c.breaches for c in result.cases) else 1)
    ctx.exit(code)


def _table(result) -> str:
    head = ("case", "verdict", "tolerance", "decode KL mean", "decode top-1", "max|d|", "s")
    rows = []
    for r in result.cases:
        dec = r.summary.get("decode", {})
        worst_abs = max((ms.get("max_abs_diff") or 0.0) for ms in r.summary.values()) if r.summary else None
        rows.append((r.case.name, "error" if r.error else ("pass" if r.passed else "FAIL"), r.profile or r.case.tolerance,
                     _g(dec.get("kl_mean")), _g(dec.get("top1_agreement")), _g(worst_abs), f"{r.seconds:.1f}"))
    widths = [max(len(str(x[i])) for x in [head] + rows) for i in range(len(head))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    lines = [fmt.format(*head)] + [fmt.format(*row) for row in rows]
    for r in result.cases:
        if r.error:
            lines.append(f"{r.case.name}: {r.error}")
        for b in r.breaches:
            value = "NaN/Inf" if b.get("value") is None else f"{b['value']:.4g}"
            where = f" at {b['where']}" if b.get("where") else ""
            lines.append(f"{r.case.name}: {b['phase']} {b['metric']} = {value} (limit {b['op']} {b['limit']}){where}")
    passed = sum(c.passed for c in result.cases)
    lines.append(f"{passed}/{len(result.cases)} cases passed in {result.seconds:.1f} s: "
                 + ("gate green" if result.passed else "gate RED"))
    return "\n".join(lines)


def _g(v) -> str:
    return "-" if v is None else f"{v:.4g}"


