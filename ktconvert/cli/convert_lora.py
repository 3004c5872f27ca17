"""``ktconvert convert-lora``: options -> :func:`ktconvert.convert.lora.convert_lora` -> one line or JSON."""

from __future__ import annotations

import json

import click


@click.command("convert-lora")
@click.argument("src", type=click.Path(path_type=str))
@click.argument("out", type=click.Path(path_type=str))
@click.option("--to", "to", type=click.Choice(["sglang", "kt"]), default=None,
              help="sglang: the adapter sglang-kt serves (default for a fused input); kt: a raw kt-kernel training "
                   "directory with kt_adapter_manifest.json (default for a per-expert input).")
@click.option("--expert-only", is_flag=True, help="With --to sglang: only the expert tensors, for --kt-expert-lora-path.")
@click.option("--base-model", "base_model", metavar="DIR", type=click.Path(path_type=str),
              help="The base model (directory or config.json): every MoE layer, E, H and I checked against it.")
@click.option("--base-config", "base_config", metavar="FILE", type=click.Path(path_type=str), hidden=True)
@click.option("--base-model-name-or-path", "base_name", metavar="NAME",
              help="Written as base_model_name_or_path (default: the manifest's, the input config's, or --base-model).")
@click.option("--lora-alpha", type=float, help="LoRA alpha, when adapter_config.json does not say it.")
@click.option("--force", is_flag=True, help="Replace an existing OUT.")
@click.option("--allow-nonfinite", is_flag=True, help="Convert an adapter holding NaN/Inf (refused by default).")
@click.option("-o", "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.pass_context
def command(ctx, src, out, to, expert_only, base_model, base_config, base_name, lora_alpha, force, allow_nonfinite,
            fmt):
    """Convert a MoE LoRA adapter between the forms of the kt-kernel / sglang-kt 0.7.2 stack.

    SRC: a raw training directory (fused_expert_lora.safetensors, kt_adapter_manifest.json), the fused file alone,
    a converted sglang adapter directory (merged or expert-only) or a PEFT per-expert save. Checked before anything
    is written: NaN/Inf, lora_B with no effect (warning), ranks, stray keys, rsLoRA/DoRA/rank_pattern, F32
    (warning), the manifest's sizes and sha256, alpha, and with --base-model every MoE layer, E, H and I. A
    DeepSeek-V4 MXFP4 adapter is checked and left as is (sglang-kt serves it raw).

    Exit codes: 0 done, 2 usage error, 3 input error or refused adapter (nothing written).
    """
    from ktconvert.convert.lora import convert_lora
    from ktconvert.convert.lora_checks import finding_dict, finding_line

    r = convert_lora(src, out, base_config=base_model or base_config, lora_alpha=lora_alpha, to=to,
                     expert_only=expert_only, base_model_name=base_name, force=force, allow_nonfinite=allow_nonfinite)
    obj = ctx.find_object(dict) or {}
    if fmt == "json":
        click.echo(json.dumps({"direction": r.direction, "form": r.form, "out": str(r.out), "files": r.files,
                               "rank": r.rank, "alpha": r.alpha, "layers": r.layers, "experts": r.experts,
                               "findings": [finding_dict(f) for f in r.findings], "notes": r.notes}, indent=2))
        return
    for f in r.findings:
        click.echo(f"ktconvert: {f.severity}: {finding_line(f)}", err=True)
    if obj.get("verbosity", 1) > 0:
        if r.direction == "none":
            click.echo(r.notes[0])
        else:
            click.echo(f"{r.direction}: wrote {r.out} ({', '.join(r.files)}; rank {r.rank}, alpha {r.alpha:g}, "
                       f"{len(r.layers)} layer(s), {r.experts} experts)")
