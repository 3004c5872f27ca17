"""``ktconvert preflight``: thin wrapper over ktconvert.preflight (flags -> Launch -> checks -> render)."""

from __future__ import annotations

import json

import click

from ktconvert.preflight import Launch, finding_line, parse_command, preflight


@click.command("preflight", context_settings={"ignore_unknown_options": False})
@click.option("--model-path", help="The HF model directory the launch passes as --model-path.")
@click.option("--kt-weight-path", help="Expert weights: kt-amx dir, GGUF file/dir, or the HF dir (BF16/FP8).")
@click.option("--kt-method", help="kt-kernel method (AMXINT4, AMXINT8, LLAMAFILE, BF16, FP8, ...).")
@click.option("--kt-cpuinfer", help="Total CPU threads for the experts.")
@click.option("--kt-threadpool-count", help="Threadpools (= numa parts of a kt-amx dir); sglang-kt default 2.")
@click.option("--kt-numa-nodes", multiple=True, help="NUMA node per threadpool (repeatable).")
@click.option("--kt-num-gpu-experts", help="GPU experts per MoE layer.")
@click.option("--kt-gpu-experts-ratio", help="GPU experts as a fraction (0-1) of all experts.")
@click.option("--kt-expert-lora-path", help="Converted expert-only LoRA adapter dir (sglang-kt 0.7.2).")
@click.option("--kt-lora-path", help="Deprecated alias of --kt-expert-lora-path.")
@click.option("--lora-paths", multiple=True, help="Merged adapter dir(s), NAME=DIR or DIR (repeatable).")
@click.option("--max-running-requests", help="sglang's request limit (LoRA serving needs at least 2).")
@click.option("--kt-moe-lora-path", help="Seed-era: the stacked MoE LoRA .safetensors.")
@click.option("--kt-moe-lora-rank", help="Seed-era: its rank.")
@click.option("--kt-moe-lora-alpha", help="Seed-era: its alpha.")
@click.option("--kt-moe-sft-method", help="Seed-era: the SFT kernel method.")
@click.option("--rules", type=click.Path(path_type=str), help="An optimize-rule file that should agree with the launch.")
@click.option("-o", "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def command(ctx, model_path, kt_weight_path, kt_method, kt_cpuinfer, kt_threadpool_count, kt_numa_nodes,
            kt_num_gpu_experts, kt_gpu_experts_ratio, kt_expert_lora_path, kt_lora_path, lora_paths,
            max_running_requests, kt_moe_lora_path, kt_moe_lora_rank, kt_moe_lora_alpha, kt_moe_sft_method, rules, fmt, command):
    """Check a kt-kernel launch before it loads: the --kt-* flags (or the whole launch command pasted after
    --) against the model, the weight directory and the LoRA adapter, reading headers only.

    \b
      ktconvert preflight --model-path M --kt-weight-path W --kt-method AMXINT8 --kt-cpuinfer 32 \\
          --kt-threadpool-count 2 --kt-num-gpu-experts 0
      ktconvert preflight -- python -m sglang.launch_server --model-path M --kt-weight-path W ...

    Flags given to preflight override the pasted command's. One line per finding with its fix.
    Exit codes: 0 no errors (warnings allowed), 1 an error finding, 2 usage error, 3 an unreadable file.
    """

    explicit = Launch(model_path=model_path, weight_path=kt_weight_path, method=kt_method, cpuinfer=kt_cpuinfer,
                      threadpools=kt_threadpool_count, numa_nodes=list(kt_numa_nodes) or None,
                      gpu_experts=kt_num_gpu_experts, gpu_ratio=kt_gpu_experts_ratio,
                      expert_lora_path=kt_expert_lora_path, kt_lora_path=kt_lora_path,
                      lora_paths=list(lora_paths) or None, max_running_requests=max_running_requests,
                      moe_lora_path=kt_moe_lora_path,
                      moe_lora_rank=kt_moe_lora_rank, moe_lora_alpha=kt_moe_lora_alpha, moe_sft_method=kt_moe_sft_method,
                      seed_flags=[f for f, v in (("--kt-moe-lora-path", kt_moe_lora_path),
                                                 ("--kt-moe-lora-rank", kt_moe_lora_rank),
                                                 ("--kt-moe-lora-alpha", kt_moe_lora_alpha),
                                                 ("--kt-moe-sft-method", kt_moe_sft_method)) if v is not None])
    launch = parse_command(list(command)).merged(explicit) if command else explicit
    report = preflight(launch, rules)
    if fmt == "json":
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        for f in report.findings:
            click.echo(finding_line(f))
        d = report.as_dict()
        verdict = "OK" if report.passed else "FAIL"
        click.echo(f"{verdict}: {d['counts']['error']} error(s), {d['counts']['warning']} warning(s) "
                   f"({d['flag_set']} flags; {report.seconds:.2f} s)")
    ctx.exit(0 if report.passed else 1)
