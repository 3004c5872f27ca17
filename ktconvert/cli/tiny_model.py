"""``ktconvert tiny-model FAMILY OUT_DIR``: write a deterministic tiny checkpoint (no torch needed)."""

from __future__ import annotations

import json

import click

from ktconvert import families
from ktconvert.families.config import FAMILIES
from ktconvert.model.tiny_release import FORMATS as RELEASE_FORMATS

_FP8 = ", ".join(f for f in FAMILIES if families.spec(f).tiny.get("fp8"))
_VARIANTS = ", ".join(f"{f} {v}" for f in FAMILIES for v in families.spec(f).tiny.get("variants") or {}) or "none"


@click.command("tiny-model")
@click.argument("family", type=click.Choice(FAMILIES), metavar="FAMILY")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it is not empty.")
@click.option("--fp8", is_flag=True, help=f"The FP8 block-scaled variant (F8_E4M3 weights + _scale_inv; {_FP8}).")
@click.option("--quant", type=click.Choice(RELEASE_FORMATS), default=None,
              help="A tiny release in that format's released layout (names, dtypes, scale shapes, config keys): "
                   "routed experts quantized (every linear layer for fp8-perchannel); a family whose releases "
                   "store them otherwise gets that layout (its spec's checkpoint.releases).")
@click.option("--variant", default=None, metavar="NAME",
              help=f"A released configuration of FAMILY (its spec's tiny.variants: {_VARIANTS}).")
@click.option("--lora", "lora", metavar="DIR", type=click.Path(file_okay=False),
              help="Also write the tiny model's MoE LoRA adapter (kt-kernel's raw training form, with "
              "kt_adapter_manifest.json) into DIR; ktconvert convert-lora makes every other form of it.")
@click.option("-o", "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(family: str, out_dir: str, force: bool, fp8: bool, quant: str | None, variant: str | None,
            lora: str | None, fmt: str) -> None:
    """Write a tiny FAMILY checkpoint (any family with a spec in rules/families/) (config.json, model.safetensors, BPE tokenizer) into OUT_DIR.

    The bytes depend on nothing but ktconvert's source: the sha256 of each file is recorded in
    golden/tiny-models.yaml and checked by the tests.
    """
    from ktconvert.model.tiny import write_tiny

    if fp8 and quant:
        raise click.UsageError("--fp8 and --quant are two different releases; pick one")
    hashes, lora_hashes = write_tiny(family, out_dir, lora_dir=lora, force=force, fp8=fp8, quant=quant,
                                     variant=variant)
    if fmt == "json":
        click.echo(json.dumps({"family": family, "out_dir": out_dir, "sha256": hashes,
                               **({"lora": {"out_dir": lora, "sha256": lora_hashes}} if lora else {})}, indent=2))
        return
    if lora_hashes:
        click.echo(f"wrote the tiny {family} MoE LoRA adapter (raw training form) to {lora}")
    what = " FP8" if fp8 else f" {quant}" if quant else ""
    click.echo(f"wrote tiny {family}{what}{f' ({variant})' if variant else ''} checkpoint to {out_dir}")
    for name, digest in hashes.items():
        click.echo(f"  {digest}  {name}")
