"""``ktconvert verify``: thin wrapper over ktconvert.verify (options -> run_verify -> render -> exit code)."""

from __future__ import annotations

import click


@click.command("verify")
@click.option("--model", "model_dir", required=True, type=click.Path(path_type=str),
              help="Hugging Face model directory (config.json; its own weights also drive module-level localisation).")
@click.option("--rules", "rules", required=True, type=click.Path(path_type=str), help="Optimize-rule YAML file to inject.")
@click.option("--weights", type=click.Path(path_type=str),
              help="Converted weights: .gguf, .safetensors or a directory (default: the model's own weights).")
@click.option("--prefill-weights", type=click.Path(path_type=str),
              help="What prefill ops read during layer-wise prefill (default: --weights), e.g. the original "
                   "checkpoint a GPU prefill loads while the CPU experts read the conversion.")
@click.option("--golden", "golden", required=True, type=click.Path(path_type=str),
              help="Golden directory (manifest.yaml + golden.safetensors) made from --model, or a llama.cpp "
                   "KL-divergence base file (llama-perplexity --kl-divergence-base, golden --kl-base): KL and "
                   "top-1/top-k at its scored positions, no hidden states.")
@click.option("--tolerance", "tolerance", default="auto", show_default=True, metavar="NAME|FILE|auto",
              help="Tolerance profile: a shipped name (rules/tolerances/), a YAML file, or auto (the profile for "
                   "the experts' least precise ggml type).")
@click.option("-o", "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=str),
              help="Write per-layer hidden-state NMSE (prefill and decode) to this PNG (needs matplotlib).")
@click.option("--compute-dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Dtype of the model and of dequantizing ops (KLinearTorch, KExpertsTorch).")
@click.option("--cpu-hidden-dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True,
              help="Hidden-state type the CPU experts kernel reads and writes (upstream: BF16).")
@click.option("--act-quant/--no-act-quant", default=True, show_default=True,
              help="CPU experts: round activations to the weight type's vec_dot type (Q8_0, Q8_K, ...), as the kernel.")
@click.option("--catalog", "catalogs", multiple=True, type=click.Path(path_type=str),
              help="Extra operator catalog layered over the built-in one (repeatable).")
@click.option("--backend", type=click.Choice(["auto", "ktransformers", "balance_serve"]), default="auto", show_default=True,
              help="Backend the rule file is checked for (auto: from the file name, as check-rules).")
@click.option("--threads", type=click.IntRange(min=1), help="torch threads (default: the golden's).")
@click.option("--kernel", type=click.Choice(["emulate", "kt-kernel", "both"]), default="emulate", show_default=True,
              help="Who computes the CPU experts: ktconvert's emulation, the real kt-kernel (in a child process, "
                   "LLAMAFILE for a GGUF, BF16 for HF bf16 experts, AMXINT8/4 for --kt-weights), or both, reporting "
                   "their agreement per layer.")
@click.option("--kt-weights", type=click.Path(path_type=str),
              help="A kt-amx directory the kernel's CPU experts read (as --kt-weight-path at launch); needs --kernel.")
@click.option("--lora", "lora", type=click.Path(path_type=str),
              help="A MoE LoRA adapter (any form convert-lora reads) applied as W + alpha/r * B @ A to the weights it "
                   "adapts; --golden must be made with `ktconvert golden --lora` of the same adapter.")
@click.option("--lora-alpha", type=float, help="LoRA alpha, when the adapter does not say it.")
@click.option("--max-memory", metavar="SIZE",
              help="Memory budget for the weights resident at once (1GiB, 512MiB): the reference and the candidate "
                   "then run layer by layer from disk, with the same numbers. Default: half the memory available, "
                   "everything in memory when both float32 models fit it.")
@click.option("--progress/--no-progress", default=None,
              help="Per-layer progress on stderr (default: on when stderr is a terminal).")
@click.pass_context
def command(ctx, model_dir, rules, weights, prefill_weights, golden, tolerance, fmt, plot_path, compute_dtype,
            cpu_hidden_dtype, act_quant, catalogs, backend, threads, kernel, kt_weights, lora, lora_alpha, max_memory,
            progress):
    """Run the model as --rules injects it, on --weights, against --golden: prefill over the golden prompt,
    then token-by-token decode with a KV cache; per position max |diff|, NMSE, KL, top-1/top-k agreement;
    per-layer hidden-state NMSE per phase; the first layer and module where error jumps.

    Exit codes: 0 within the profile's limits, 1 a limit broken, 2 usage error, 3 unusable input or missing
    dependency (e.g. --plot without matplotlib).
    """
    from ktconvert.verify.report import render_json, render_text, require_matplotlib

    if plot_path:
        from ktconvert.io.atomic import check_output_file

        check_output_file(plot_path, "--plot")  # fail before the run, not after
        require_matplotlib()
    from ktconvert.io.sizes import parse_size
    from ktconvert.model.inject import EmulationOptions
    from ktconvert.rules.catalog import load_catalog
    from ktconvert.verify import run_verify

    options = EmulationOptions(compute_dtype=compute_dtype, cpu_hidden_dtype=cpu_hidden_dtype, cpu_act_quant=act_quant,
                               kernel=kernel)
    report = run_verify(model_dir, rules, golden, weights=weights, prefill_weights=prefill_weights, profile=tolerance,
                        options=options, catalog=load_catalog(catalogs), backend=backend, threads=threads,
                        kt_weights=kt_weights, lora=lora, lora_alpha=lora_alpha,
                        max_memory=None if max_memory is None else parse_size(max_memory, what="--max-memory"),
                        progress=_progress if (progress if progress is not None else _tty()) else None)
    if plot_path:
        from ktconvert.verify.report import plot

        plot(report, plot_path)
    click.echo(render_json(report) if fmt == "json" else render_text(report))
    ctx.exit(0 if report.passed else 1)


def _tty() -> bool:
    import sys

    return sys.stderr.isatty()


def _progress(phase: str, done: int, layers: int, seconds: float) -> None:
    """One line per layer on stderr (rewritten in place on a terminal)."""
    end = "\n" if done == layers or not _tty() else ""
    click.echo(f"\r{phase}: layer {done}/{layers} ({seconds:.1f} s)", err=True, nl=False)
    if end:
        click.echo("", err=True)
