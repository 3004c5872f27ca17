"""``ktconvert quantize``: options -> :mod:`ktconvert.convert` -> rendering; nothing heavy imported before use."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from tqdm import tqdm

from ktconvert.convert import (
    KEEP_SPLIT,
    convert,
    convert_outputs,
    parse_output,
    plan_outputs,
    load_recipe,
    partial_dir,
    plan_conversion,
    plan_text,
    presets,
    resolve_recipe,
    with_overrides,
)
from ktconvert.convert.execute import describe
from ktconvert.cli.executor import executor_options
from ktconvert.errors import UsageProblem
from ktconvert.quant import WRITABLE


def _list_recipes(ctx, _param, value):
    if not value or ctx.resilient_parsing:
        return

    for name in presets():
        click.echo(f"{name:<18} {load_recipe(name).description}")
    ctx.exit(0)


def _bar(enabled: bool):
    """A tqdm byte bar (MB/s, ETA) on stderr when it is a terminal; ``(callback, close)``."""
    if not enabled or not sys.stderr.isatty():
        return None, lambda: None

    bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1000, desc="quantize", file=sys.stderr, leave=False,
               dynamic_ncols=True)

    def update(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.n = done
        bar.refresh()

    return update, bar.close


@click.command("quantize")
@click.argument("src", type=click.Path(path_type=str))
@click.argument("out", type=click.Path(path_type=str), required=False)
@click.option("--output", "outputs", metavar="TYPE=DIR", multiple=True,
              help="Several outputs from one read of SRC, instead of OUT (repeatable): TYPE is AMXINT8|AMXINT4 "
              "(a kt-amx directory), a preset recipe (Q4_K_M, ...), a recipe file, or a ggml type; each DIR is what "
              "that output's own run writes, with its own manifest.json and --resume.")
@click.option("--type", "qtype", metavar="T",
              help=f"One type for every weight (routers, norms, biases stay F32): {' '.join(WRITABLE)}, or keep.")
@click.option("--recipe", metavar="FILE|PRESET", help="A recipe file (schemas/convert-recipe.schema.json) or a preset "
              "name (--list-recipes).")
@click.option("--to", "to", type=click.Choice(["gguf", "safetensors", "hf", "kt-amx"]),
              help="Output container (default: the recipe's, else gguf). hf: the input's Hugging Face names and "
              "layout, FP8 weights dequantized to --type BF16|F16|F32, loadable by transformers. kt-amx: kt-kernel's "
              "AMXINT8/AMXINT4 expert directory (--type AMXINT8|AMXINT4).")
@click.option("--threadpool-count", type=click.IntRange(min=1), default=None,
              help="kt-amx: parts per expert (default 2); must equal the launch's --kt-threadpool-count.")
@click.option("--form", "form", type=click.Choice(["merged", "kt-tree"]), default=None,
              help="kt-amx: merged safetensors (default, the inference methods), or kt-tree: kt-kernel's persistent "
              "INT8 tree for SFT (_layer_L/_numa_n/*.kt + kt-weight-manifest.json; ktconvert's manifest goes "
              "beside it as OUT.manifest.json). AMXINT8 only.")
@click.option("--lora", "lora", metavar="ADAPTER", type=click.Path(path_type=str),
              help="Merge this MoE LoRA adapter (any form convert-lora reads) into the weights in float32 first: "
              "W + alpha/r * B @ A; manifest.json records its files' sha256.")
@click.option("--imatrix", "imatrix", metavar="FILE", type=click.Path(path_type=str),
              help="llama.cpp's importance matrix (llama-imatrix's GGUF or the legacy .dat): every tensor it has "
              "data for is quantized with it, the others without, as llama-quantize --imatrix (GGUF output).")
@click.option("--include-weights", "include_weights", metavar="NAME", multiple=True,
              help="With --imatrix: use it only for tensors whose name contains NAME (repeatable; llama-quantize's).")
@click.option("--exclude-weights", "exclude_weights", metavar="NAME", multiple=True,
              help="With --imatrix: not for tensors whose name contains NAME (repeatable; llama-quantize's).")
@click.option("--tensor-type", "tensor_types", metavar="REGEX=TYPE", multiple=True,
              help="llama-quantize's --tensor-type: tensors whose llama.cpp name REGEX finds get TYPE (repeatable; "
              "the first that matches wins).")
@click.option("--output-tensor-type", metavar="TYPE", help="output.weight's type (llama-quantize's option).")
@click.option("--token-embedding-type", metavar="TYPE", help="token_embd.weight's type (llama-quantize's option).")
@click.option("--leave-output-tensor", is_flag=True, help="Keep output.weight in its input type (llama-quantize's "
              "option).")
@click.option("--pure", is_flag=True, help="One type for every weight: the recipe's file type's (llama-quantize "
              "--pure); --type T already is.")
@click.option("--keep-split", is_flag=True, help="A split GGUF input gives the same split set (llama-quantize "
              "--keep-split): model-0000i-of-0000n.gguf, split i holding input split i's tensors.")
@click.option("--lora-alpha", type=float, help="The adapter's alpha when its adapter_config.json does not say it.")
@click.option("--config", metavar="FILE", type=click.Path(path_type=str),
              help="config.json (default: the one beside the checkpoint).")
@click.option("--shard-size", metavar="SIZE", help="Largest output file, e.g. 5GiB (0: one file).")
@click.option("--max-memory", metavar="SIZE", default="2GiB", show_default=True,
              help="Working-set budget for all jobs together (1GiB, 512MiB, ...).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Worker processes (with --executor ray: Ray tasks at a time, each asking for --max-memory / --jobs).")
@click.option("--allow-fallback", is_flag=True, default=None,
              help="Where a tensor's rows cannot hold the type (K-quants need multiples of 256), write llama.cpp's "
              "fallback type instead of refusing; each one is printed on stderr and recorded in manifest.json. "
              "A recipe file allows its rules' fallbacks unless it says allow_fallback: false.")
@click.option("--dry-run", is_flag=True, help="Validate and print the plan; read no tensor data, write nothing.")
@click.option("--resume", is_flag=True, help="Continue an interrupted conversion to OUT (or start one).")
@click.option("--force", is_flag=True, help="Replace an existing OUT; discard an interrupted run.")
@click.option("--no-tokenizer", is_flag=True, help="Write tokenizer.ggml.model = none instead of converting "
              "tokenizer.json (GGUF output).")
@click.option("--allow-requantize", is_flag=True, help="Quantize tensors already in a quantized type to another "
              "quantized type (llama-quantize's flag of the same name; refused without it).")
@click.option("-o", "--format", "fmt", type=click.Choice(["text", "json", "llama"]), default="text", show_default=True,
              help="llama (with --dry-run): the per-tensor table llama-quantize --dry-run prints for the same choice.")
@click.option("--for", "target", type=click.Choice(["kt-llamafile"]), default=None,
              help="kt-llamafile: the GGUF is for kt-kernel's LLAMAFILE method; an expert tensor the plan would write "
              "in a type it cannot run (measured: rules/kernels/kt-llamafile.yaml) is refused before anything is "
              "written, naming the closest type that runs.")
@click.option("--list-recipes", is_flag=True, expose_value=False, is_eager=True, callback=_list_recipes,
              help="List the preset recipes and exit.")
@executor_options("the conversion's units")
@click.pass_context
def command(ctx, src, out, outputs, qtype, recipe, to, threadpool_count, form, lora, imatrix, include_weights, exclude_weights,
            tensor_types, output_tensor_type,
            token_embedding_type, leave_output_tensor, pure, keep_split, lora_alpha, config, shard_size, max_memory,
            jobs, allow_fallback, dry_run, resume, force, no_tokenizer, allow_requantize, fmt, target, executor,
            ray_address):
    """Convert or requantize SRC into the directory OUT, experts in the order the CPU kernels read.

    SRC: a .safetensors file, a shard directory or its index, a .gguf file or split GGUF set. OUT receives
    model.gguf (llama.cpp names and metadata) or kernel-order safetensors shards, plus manifest.json with a
    sha256 per file. OUT is built under a hidden temporary name and renamed when complete.

    Exit codes: 0 done, 2 usage error, 3 input error (nothing written).
    """

    obj = ctx.find_object(dict) or {}
    if outputs:
        _several(ctx, obj, src, out, outputs, qtype, recipe, to, form, keep_split, shard_size, dry_run, fmt, dict(
            overrides=dict(tensor_types=tensor_types, output_tensor_type=output_tensor_type,
                           token_embedding_type=token_embedding_type, leave_output_tensor=leave_output_tensor,
                           pure=pure) if (tensor_types or output_tensor_type or token_embedding_type
                                          or leave_output_tensor or pure) else None,
            threadpool_count=threadpool_count, imatrix=imatrix, include_weights=include_weights,
            exclude_weights=exclude_weights, target=target, config=config, tokenizer=not no_tokenizer,
            allow_requantize=allow_requantize, allow_fallback=allow_fallback, lora=lora, lora_alpha=lora_alpha),
            dict(max_memory=max_memory, jobs=jobs, resume=resume, force=force, executor=executor,
                 ray_address=ray_address))
        return
    if out is None:
        raise UsageProblem("missing the output directory OUT", where="quantize",
                           fix="add OUT after SRC, or --output TYPE=DIR (repeatable) for several outputs")
    if fmt == "llama" and not dry_run:
        raise click.UsageError("-o llama prints llama-quantize's --dry-run table; add --dry-run")
    if (include_weights or exclude_weights) and imatrix is None:
        raise click.UsageError("--include-weights/--exclude-weights choose entries of --imatrix; add --imatrix FILE")
    if tensor_types or output_tensor_type or token_embedding_type or leave_output_tensor or pure:
        recipe = with_overrides(resolve_recipe(recipe, qtype, allow_fallback), tensor_types=tensor_types,
                                output_tensor_type=output_tensor_type, token_embedding_type=token_embedding_type,
                                leave_output_tensor=leave_output_tensor, pure=pure)
        qtype = None
    if keep_split:
        if shard_size is not None:
            raise click.UsageError("--keep-split keeps the input's split; --shard-size makes another: give one")
        shard_size = KEEP_SPLIT
    if dry_run:
        plan = plan_conversion(src, recipe, type=qtype, format=to, config=config, shard_size=shard_size,
                               tokenizer=not no_tokenizer, threadpool_count=threadpool_count,
                               allow_requantize=allow_requantize, allow_fallback=allow_fallback, lora=lora,
                               lora_alpha=lora_alpha, imatrix=imatrix, include_weights=include_weights,
                               exclude_weights=exclude_weights, target=target)
        if fmt == "llama":
            from ktconvert.convert import plan_llama_text

            click.echo(plan_llama_text(plan), nl=False)
            return
        click.echo(json.dumps(plan.to_dict(), indent=2) if fmt == "json" else plan_text(plan), nl=fmt == "json")
        return
    update, close = _bar(obj.get("verbosity", 1) > 0)
    try:
        result = convert(src, out, recipe, type=qtype, format=to, config=config, shard_size=shard_size,
                         tokenizer=not no_tokenizer, max_memory=max_memory, jobs=jobs, resume=resume, force=force,
                         progress=update, threadpool_count=threadpool_count, allow_requantize=allow_requantize,
                         allow_fallback=allow_fallback, form=form, lora=lora, lora_alpha=lora_alpha,
                         executor=executor, ray_address=ray_address, imatrix=imatrix,
                         include_weights=include_weights, exclude_weights=exclude_weights, target=target)
    except KeyboardInterrupt:
        close()
        click.echo(f"ktconvert: interrupted; rerun with --resume to continue ({partial_dir(Path(out))})", err=True)
        ctx.exit(130)
    finally:
        close()
    if obj.get("verbosity", 1) > 0:
        for fb in result.manifest["plan"].get("fallbacks", []):
            click.echo(f"ktconvert: fallback: {fb['tensor']} written as {fb['written']}, not {fb['asked']} "
                       f"(rows of {fb['row']}); recorded in manifest.json", err=True)
    if fmt == "json":
        m = result.manifest
        click.echo(json.dumps({"out": str(result.out), "files": m["files"], "plan": m["plan"],
                               "units": result.units, "units_resumed": result.units_resumed,
                               "seconds": round(result.seconds, 3)}, indent=2))
    elif obj.get("verbosity", 1) > 0:

        click.echo(describe(result))
        for note in result.manifest["plan"]["notes"]:
            click.echo(f"note: {note}")


def _several(ctx, obj, src, out, values, qtype, recipe, to, form, keep_split, shard_size, dry_run, fmt, planning,
             running) -> None:
    """``--output TYPE=DIR ...``: every output from one read of SRC (:func:`ktconvert.convert.convert_outputs`)."""
    for flag, given in (("OUT", out), ("--type", qtype), ("--recipe", recipe), ("--to", to), ("--form", form)):
        if given is not None:
            raise UsageProblem(f"{flag} {given} with --output: each --output names its own type and directory",
                               where="--output", fix=f"drop {flag}; write --output TYPE=DIR for each output")
    if fmt == "llama":
        raise UsageProblem("-o llama prints one plan; --output makes several", where="--output",
                           fix="run --dry-run -o llama on one output (OUT --recipe/--type)")
    if keep_split:
        if shard_size is not None:
            raise click.UsageError("--keep-split keeps the input's split; --shard-size makes another: give one")
        shard_size = KEEP_SPLIT
    specs = [parse_output(v) for v in values]
    if dry_run:
        plans = plan_outputs(src, specs, shard_size=shard_size, **planning)
        if fmt == "json":
            click.echo(json.dumps([{"output": str(s.out), "type": s.spec, "plan": p.to_dict()}
                                   for s, p in zip(specs, plans)], indent=2))
            return
        for s, p in zip(specs, plans):
            click.echo(f"== --output {s.spec}={s.out}")
            click.echo(plan_text(p), nl=False)
        return
    update, close = _bar(obj.get("verbosity", 1) > 0)
    try:
        results = convert_outputs(src, specs, progress=update, shard_size=shard_size, **running, **planning)
    except KeyboardInterrupt:
        close()
        where = ", ".join(str(partial_dir(s.out)) for s in specs)
        click.echo(f"ktconvert: interrupted; rerun with --resume to continue ({where})", err=True)
        ctx.exit(130)
    finally:
        close()
    if fmt == "json":
        click.echo(json.dumps([{"out": str(r.out), "files": r.manifest["files"], "plan": r.manifest["plan"],
                                "units": r.units, "units_resumed": r.units_resumed, "seconds": round(r.seconds, 3)}
                               for r in results], indent=2))
    elif obj.get("verbosity", 1) > 0:
        for r in results:
            click.echo(describe(r))
