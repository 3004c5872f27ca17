"""``ktconvert imatrix MODEL OUT``: llama.cpp's importance matrix from the release, streamed layer by layer."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ktconvert.errors import InputError, UsageProblem


def _ids(value: str | None) -> tuple[list[int] | None, str | None]:
    """``--prompt-ids``: comma-separated ids, or a file of them (commas or whitespace); (ids, the file or None)."""
    if value is None:
        return None, None
    source, text = None, value
    if Path(value).is_file():
        from ktconvert.io.files import regular_file_size

        regular_file_size(Path(value), "prompt ids file", limit=256 * 1024**2)
        source, text = value, Path(value).read_text(encoding="utf-8", errors="replace")
    words = text.replace(",", " ").split()
    try:
        return [int(w) for w in words], source
    except ValueError:
        bad = next(w for w in words if not w.lstrip("-").isdigit())
        what = f"{source} holds {bad!r}" if source else f"--prompt-ids holds {bad!r}"
        err = InputError if source else UsageProblem
        raise err(f"{what}; token ids are integers", path=source, where="--prompt-ids",
                  fix="give comma-separated token ids, or a file of them") from None


@click.command("imatrix")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path())
@click.option("--text-file", type=click.Path(dir_okay=False), help="Calibration text (UTF-8), tokenized by MODEL's tokenizer.")
@click.option("--prompt-ids", help="The calibration text as token ids (BOS included): comma-separated, or a file of them.")
@click.option("--chunk-size", type=int, default=512, show_default=True,
              help="Tokens per chunk (llama-imatrix's -c): each chunk runs on its own, BOS first when the model adds one.")
@click.option("--chunks", type=click.IntRange(min=1), help="Use only the first N chunks (llama-imatrix's --chunks).")
@click.option("--max-memory", metavar="SIZE",
              help="Memory budget for the weights resident at once (1GiB, 512MiB; default: half the memory available).")
@click.option("--threads", type=click.IntRange(min=1), help="torch CPU threads (default: torch's).")
@click.option("--force", is_flag=True, help="Replace an existing OUT.")
@click.option("-o", "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(model, out, text_file, prompt_ids, chunk_size, chunks, max_memory, threads, force, fmt) -> None:
    """Compute llama.cpp's importance matrix of a calibration text on MODEL (a Hugging Face release, any format
    quantize reads) and write it to OUT in llama-imatrix's GGUF format, for quantize --imatrix or llama-quantize.

    Matrices and experts that got no data are listed by name; the exit code stays 0 (llama-quantize handles them).
    """
    from ktconvert.golden.stream import default_budget
    from ktconvert.imatrix import make_imatrix
    from ktconvert.io.sizes import format_size, parse_size

    ids, source = _ids(prompt_ids)
    budget = default_budget() if max_memory is None else parse_size(max_memory, what="--max-memory")
    run = make_imatrix(model, out, text_file=text_file, prompt_ids=ids, prompt_ids_source=source,
                       chunk_size=chunk_size, chunks=chunks, max_memory=budget, threads=threads, force=force)
    if fmt == "json":
        click.echo(json.dumps(run.summary(), indent=2))
        return
    st = run.stream
    click.echo(f"wrote {out}: {len(run.entries)} matrices, {run.chunks} chunk(s) of {run.chunk_size} tokens, "
               f"{format_size(st['bytes_read'])} read, peak {format_size(st['peak_resident_weights'])} of weights "
               f"resident (budget {format_size(budget)}), {st['seconds']:.1f} s")
    for name in run.tensors_without:
        click.echo(f"  no data: {name}")
    for name, experts in sorted(run.experts_without.items()):
        click.echo(f"  no data for expert(s) {', '.join(map(str, experts))} of {name}")
