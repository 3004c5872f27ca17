"""``ktconvert convert-lora``: options -> :func:`ktconvert.convert.lora.convert_lora` -> one line or JSON."""

from __future__ import annotations

import json

import click


@click.command("convert-lora")
@click.argument("src", type=click.Path(path_type=str))
@click.argument("out", type=click.Path(path_type=str))
@click.option("--base-config", metavar="FILE", type=click.Path(path_type=str),
              help="The base model's config.json: check experts, H, I and MoE layers against it.")
@click.option("--lora-alpha", type=float, help="LoRA alpha, when the input has no adapter_config.json saying it.")
@click.option("--force", is_flag=True, help="Replace an existing OUT.")
@click.option("--allow-nonfinite", is_flag=True, help="Convert an adapter holding NaN/Inf (refused by default).")
@click.option("-o", "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.pass_context
def command(ctx, src, out, base_config, lora_alpha, force, allow_nonfinite, fmt):
    """Convert a MoE LoRA adapter between kt-kernel's stacked form and the per-expert PEFT form.

    The direction follows from SRC's tensor names: layers.L.experts.{gate,up,down}_lora_{a,b} ([E,r,H],
    [E,I,r], ...) become model.layers.L.mlp.experts.E.{gate,up,down}_proj.lora_{A,B}.weight plus
    adapter_config.json, and back. Always real safetensors; pickles are refused, never loaded.

    Exit codes: 0 done, 2 usage error, 3 input error (nothing written).
    """
    from ktconvert.convert.lora import convert_lora

    r = convert_lora(src, out, base_config=base_config, lora_alpha=lora_alpha, force=force,
                     allow_nonfinite=allow_nonfinite)
    obj = ctx.find_object(dict) or {}
    if fmt == "json":
        click.echo(json.dumps({"direction": r.direction, "out": str(r.out), "files": r.files, "rank": r.rank,
                               "layers": r.layers, "experts": r.experts}, indent=2))
    elif obj.get("verbosity", 1) > 0:
        click.echo(f"{r.direction}: wrote {r.out} ({', '.join(r.files)}; rank {r.rank}, {len(r.layers)} layer(s), "
                   f"{r.experts} experts)")
