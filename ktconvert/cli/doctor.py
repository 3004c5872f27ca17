"""``ktconvert doctor``: thin wrapper over ktconvert.kernel.doctor (collect -> render -> exit code)."""

from __future__ import annotations

import json

import click

from ktconvert.kernel.doctor import REQUIREMENTS, doctor, missing


def _yes(v) -> str:
    return "yes" if v else "no"


def render_text(report: dict, problems: list[str]) -> str:
    cpu, kt, ll = report["cpu"], report["kt_kernel"], report["llama_cpp"]
    f = cpu["features"]
    lines = [f"CPU        {cpu['model'] or '?'} ({cpu['logical_cpus']} logical CPUs, {cpu['machine']})",
             f"  AVX-512  F {_yes(f['avx512f'])}, BW {_yes(f['avx512bw'])}, VNNI {_yes(f['avx512_vnni'])}, "
             f"BF16 {_yes(f['avx512_bf16'])}",
             f"  AVX-VNNI {_yes(f['avx_vnni'])}   AVX2 {_yes(f['avx2'])}",
             f"  AMX      tile {_yes(f['amx_tile'])}, int8 {_yes(f['amx_int8'])}, bf16 {_yes(f['amx_bf16'])}"]
    if kt["available"]:
        over = f" (forced by KT_KERNEL_CPU_VARIANT={kt['variant_override']})" if kt.get("variant_override") else ""
        lines.append(f"kt-kernel  {kt['version']}, variant {kt['variant']}{over}, int8 kernel {kt.get('int8_kernel')}")
    else:
        lines.append(f"kt-kernel  not usable: {kt['error']}")
    lines.append("  methods with a kernel in this variant:")
    for row in report["methods"]:
        if row["runs"]:
            extra = f", {row['path']}" if row["path"] else ""
            ver = "" if row["ktconvert_verifies"] else "; not yet run by verify --kernel"
            lines.append(f"    {row['method']:<15} reads {row['reads']}{extra}{ver}")
    if kt["available"]:
        no = [r["method"] for r in report["methods"] if not r["runs"]]
        if no:
            lines.append(f"    not here: {', '.join(no)}")
    if ll.get("importable"):
        lines.append(f"llama.cpp  llama-cpp-python {ll['version']} ({ll['from']})")
        lines.append(f"  system   {ll['system_info'].strip()}")
        if ll.get("note"):
            lines.append(f"  note     {ll['note']}")
    else:
        lines.append(f"llama.cpp  not importable: {ll.get('error')}")
    for p in problems:
        lines.append(f"missing: {p}")
    return "\n".join(lines)


@click.command("doctor")
@click.option("-o", "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--require", "required", multiple=True, type=click.Choice(REQUIREMENTS, case_sensitive=False),
              metavar="NAME", help=f"Exit 3 unless this is usable here (repeatable): {', '.join(REQUIREMENTS)}.")
@click.option("--no-llama-cpp", is_flag=True, help="Skip the llama.cpp check (it imports llama.cpp in a child: seconds).")
@click.pass_context
def command(ctx, fmt, required, no_llama_cpp):
    """What is installed and usable here: CPU features (AVX-512 F/BW/VNNI/BF16, AVX-VNNI, AMX), kt-kernel's
    version, the variant it selects and the methods that run on this CPU, and llama-cpp-python.

    kt-kernel and llama.cpp are each imported in a child process, never in this one.
    Exit codes: 0 fine, 3 something --require names is missing.
    """

    want = [r.upper() if r.upper() in REQUIREMENTS else r.lower() for r in required]
    report = doctor(llama=not no_llama_cpp or "llama-cpp" in want)
    problems = missing(report, want)
    if fmt == "json":
        click.echo(json.dumps(report | {"required": want, "missing": problems}, indent=2, default=sorted))
    else:
        click.echo(render_text(report, problems))
    ctx.exit(3 if problems else 0)
