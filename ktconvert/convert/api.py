"""The two calls everything else uses: :func:`plan_conversion` (no data read, nothing written) and
:func:`convert` (plan, check the paths, execute)."""

from __future__ import annotations

import dataclasses
import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from ktconvert.cluster import check_executor, check_fits, connect
from ktconvert.convert.execute import (Progress, RunResult, execute, execute_all, finished_output, input_roots,
                                       ray_task_memory)
from ktconvert.convert.hf_out import build_hf_plan
from ktconvert.convert.plan import KEEP_SPLIT, Plan, build_plan
from ktconvert.convert.pool import workers_started
from ktconvert.convert.recipe import Recipe, load_recipe, presets, recipe_for_type, with_overrides
from ktconvert.convert.targets import check_target
from ktconvert.io.sizes import parse_size
from ktconvert.convert.source import analyze
from ktconvert.errors import UsageProblem
from ktconvert.io.atomic import check_separate, claim_output, output_lock, partial_dir
from ktconvert.quant import WRITABLE
from ktconvert.convert.kt_amx_plan import build_kt_amx_plan
from ktconvert.convert.lora_merge import attach_lora
from ktconvert.convert.kt_tree_out import check_tree_paths, finish_tree, scratch_dir, write_tree

DEFAULT_MAX_MEMORY = "2GiB"


def resolve_recipe(recipe: Recipe | str | Path | None = None, type: str | None = None,
                   allow_fallback: bool | None = None) -> Recipe:
    """A :class:`Recipe` from a recipe object, a file, a preset name, or ``type`` (``--type`` shorthand).
    ``allow_fallback`` overrides the recipe's own setting (``--type``: no fallback unless asked)."""
    r = _resolve(recipe, type, bool(allow_fallback))
    if allow_fallback is not None and r.allow_fallback != allow_fallback:
        r = dataclasses.replace(r, allow_fallback=allow_fallback)
    return r


def _resolve(recipe, type, allow_fallback: bool) -> Recipe:
    if recipe is not None and type is not None:
        raise UsageProblem("give a recipe or a type, not both", fix="--type T is shorthand for a one-type recipe")
    if isinstance(recipe, Recipe):
        return recipe
    if recipe is not None:
        return load_recipe(recipe)
    if type is not None:
        if str(type).upper() in ("AMXINT8", "AMXINT4"):
            raise UsageProblem(f"--type {type} is a kt-kernel method, not a ggml type", fix="add --to kt-amx")
        return recipe_for_type(type, allow_fallback)
    raise UsageProblem("no recipe and no type given",
                       fix="pass --type (e.g. --type Q8_0 or --type keep) or --recipe (a file or a preset such as Q4_K_M)")


def plan_conversion(src: str | Path, recipe: Recipe | str | Path | None = None, *, type: str | None = None,
                    format: str | None = None, config: str | Path | dict | None = None,
                    shard_size: int | str | None = None, tokenizer: bool = True, threadpool_count: int | None = None,
                    allow_requantize: bool = False, allow_fallback: bool | None = None,
                    lora: str | Path | None = None, lora_alpha: float | None = None,
                    imatrix: str | Path | None = None, include_weights: tuple[str, ...] = (),
                    exclude_weights: tuple[str, ...] = (), target: str | None = None) -> Plan:
    """Validate everything that can be validated without reading tensor data and return the plan.

    ``lora``: an adapter (any form convert-lora reads) merged in float32 into the weights it adapts
    (:mod:`ktconvert.convert.lora_merge`).
    ``format="kt-amx"`` with ``type="AMXINT8"``/``"AMXINT4"`` plans kt-kernel's expert directory for
    ``threadpool_count`` parts (default 2; :mod:`ktconvert.convert.kt_amx_plan`).
    ``imatrix``: llama.cpp's importance matrix (GGUF or legacy .dat), used as llama-quantize uses it
    (:mod:`ktconvert.convert.imatrix_plan`); ``include_weights``/``exclude_weights`` llama-quantize's
    ``--include-weights``/``--exclude-weights``.
    ``target``: ``"kt-llamafile"`` refuses a plan whose expert tensors LLAMAFILE cannot run
    (:mod:`ktconvert.convert.targets`).

    Raises :class:`~ktconvert.errors.InputError` (bad input, impossible type, recipe problem: exit 3) or
    :class:`~ktconvert.errors.UsageProblem` (contradicting options: exit 2).
    """
    plan = _plan(src, recipe, type, format, config, shard_size, tokenizer, threadpool_count, allow_requantize,
                 allow_fallback, imatrix, include_weights, exclude_weights)
    if lora is not None:
        plan = attach_lora(plan, lora, lora_alpha=lora_alpha)
    elif lora_alpha is not None:
        raise UsageProblem("--lora-alpha without --lora", fix="add --lora ADAPTER or drop --lora-alpha")
    check_target(plan, target)
    return plan


def _plan(src, recipe, type, format, config, shard_size, tokenizer, threadpool_count, allow_requantize,
          allow_fallback, imatrix=None, include_weights=(), exclude_weights=()) -> Plan:
    if format == "kt-amx":
        _gguf_only(imatrix, format)
        if recipe is not None or type is None:
            raise UsageProblem("--to kt-amx needs --type AMXINT8 or --type AMXINT4 (and no recipe)")
        return build_kt_amx_plan(analyze(src, config), type, 2 if threadpool_count is None else threadpool_count)
    if threadpool_count is not None:
        raise UsageProblem("--threadpool-count only applies to --to kt-amx",
                           fix="drop it, or add --to kt-amx --type AMXINT8|AMXINT4")
    r = resolve_recipe(recipe, type, allow_fallback)
    if imatrix is None and r.imatrix is not None:  # the recipe's quantize.imatrix (the command line's wins)
        imatrix = r.imatrix
        include_weights, exclude_weights = include_weights or r.include_weights, exclude_weights or r.exclude_weights
    shard = (None if shard_size is None else shard_size if shard_size == KEEP_SPLIT
             else parse_size(shard_size, what="--shard-size"))
    if shard == KEEP_SPLIT and (format or r.format or "gguf") != "gguf":
        raise UsageProblem("--keep-split writes the input's split GGUF set: GGUF output only", fix="drop --keep-split")
    if (format or r.format) == "hf":  # the input's own names and layout, FP8 dequantized (convert/hf_out.py)
        _gguf_only(imatrix, "hf")
        return build_hf_plan(src, r, type, config=config, shard_size=shard)
    source = analyze(src, config)
    return build_plan(source, r, format=format, shard_size=shard, tokenizer=tokenizer,
                      allow_requantize=allow_requantize, imatrix=imatrix, include_weights=include_weights,
                      exclude_weights=exclude_weights)


def _gguf_only(imatrix, format: str) -> None:
    if imatrix is not None:
        raise UsageProblem(f"--imatrix applies to GGUF output, not {format}", fix="drop --imatrix, or write GGUF (--to gguf)")


def convert(src: str | Path, out: str | Path, recipe: Recipe | str | Path | None = None, *, type: str | None = None,
            format: str | None = None, config: str | Path | dict | None = None,
            shard_size: int | str | None = None, tokenizer: bool = True,
            max_memory: int | str = DEFAULT_MAX_MEMORY, jobs: int = 1, resume: bool = False, force: bool = False,
            progress: Progress | None = None, threadpool_count: int | None = None,
            allow_requantize: bool = False, allow_fallback: bool | None = None, form: str | None = None,
            lora: str | Path | None = None, lora_alpha: float | None = None, executor: str = "local",
            ray_address: str | None = None, imatrix: str | Path | None = None,
            include_weights: tuple[str, ...] = (), exclude_weights: tuple[str, ...] = (),
            target: str | None = None) -> RunResult:
    """Convert ``src`` into the directory ``out`` (``model.gguf`` or safetensors shards, plus ``manifest.json``).

    ``executor="ray"`` runs the units as Ray tasks (``jobs`` at a time) on the cluster at ``ray_address`` (or the
    one ``ray.init`` already joined, or a new local one); SRC and OUT must be on a filesystem every node mounts at
    the same path. The output is byte-identical to the local executor's.

    Example (a test converting a tiny model)::

        from ktconvert.convert import convert
        result = convert("tiny/qwen3_moe", tmp / "q8", type="Q8_0")
        gguf_path = result.out / "model.gguf"
    """
    if jobs < 1:
        raise UsageProblem(f"--jobs {jobs} must be at least 1")
    check_executor(executor, ray_address)
    budget = parse_size(max_memory, what="--max-memory")
    if form not in (None, "merged", "kt-tree"):
        raise UsageProblem(f"--form {form}: unknown", fix="use merged or kt-tree")
    if form == "kt-tree" and (format != "kt-amx" or str(type).upper() != "AMXINT8"):
        raise UsageProblem("--form kt-tree is kt-kernel's persistent INT8 tree: it needs --to kt-amx --type AMXINT8",
                           fix="add --to kt-amx --type AMXINT8, or drop --form kt-tree")
    with workers_started(jobs, executor):  # the -j workers start while the run is planned
        plan = plan_conversion(src, recipe, type=type, format=format, config=config, shard_size=shard_size,
                               tokenizer=tokenizer, threadpool_count=threadpool_count,
                               allow_requantize=allow_requantize, allow_fallback=allow_fallback, lora=lora,
                               lora_alpha=lora_alpha, imatrix=imatrix, include_weights=include_weights,
                               exclude_weights=exclude_weights, target=target)
        inputs = input_roots(Path(src), [Path(f) for f in plan.input_files])
        with claim_output(Path(out), inputs=inputs, force=force):
            if executor == "ray":  # before anything is written: ray installed, the cluster reachable, a node fits
                ray = connect(ray_address)
                check_fits(ray, ray_task_memory(budget, jobs), "one conversion task")
            if form in (None, "merged"):
                return execute(plan, out, max_memory=budget, jobs=jobs, resume=resume, force=force,
                               progress=progress, executor=executor)
            out = Path(out)
            check_tree_paths(out, force)
            merged = scratch_dir(out)
            run = execute(plan, merged, max_memory=budget, jobs=jobs, resume=resume, force=True, progress=progress,
                          executor=executor)
            kt = write_tree(merged, out, force=force)
            return dataclasses.replace(run, out=out, manifest=finish_tree(run.manifest, merged, out, kt))


# --- several outputs from one read (quantize --output TYPE=DIR ...) ---------------------------------------------

KT_AMX_METHODS = ("AMXINT8", "AMXINT4")


@dataclass(frozen=True)
class OutputSpec:
    """One ``--output TYPE=DIR``: what to write (a preset recipe, a recipe file, a ggml type, or a kt-amx method)
    and where."""

    spec: str
    out: Path
    recipe: str | None = None
    type: str | None = None
    format: str | None = None


def parse_output(value: str) -> OutputSpec:
    """``TYPE=DIR`` -> :class:`OutputSpec`. TYPE is, in this order: AMXINT8/AMXINT4 (kt-kernel's expert directory,
    as ``--to kt-amx --type``), a preset recipe (``--recipe``: Q4_K_M, ...), a recipe file (``.yaml``/``.yml``), or a
    ggml type or ``keep`` (``--type``). Raises :class:`UsageProblem` naming ``--output`` and the value."""
    spec, eq, out = value.partition("=")
    spec, out = spec.strip(), out.strip()
    if not eq or not spec or not out:
        raise UsageProblem(f"{value!r} is not TYPE=DIR", where="--output",
                           fix="write --output TYPE=DIR, e.g. --output Q4_K_M=out-q4 --output AMXINT4=out-amx")
    if spec.upper() in KT_AMX_METHODS:
        return OutputSpec(spec, Path(out), type=spec.upper(), format="kt-amx")
    preset = next((k for k in presets() if k.lower() == spec.lower()), None)
    if preset is not None:
        return OutputSpec(spec, Path(out), recipe=preset)
    if spec.endswith((".yaml", ".yml")):
        if not Path(spec).is_file():
            raise UsageProblem(f"{value!r}: the recipe file {spec} does not exist", where="--output",
                               fix="give an existing recipe file, a preset (--list-recipes) or a type")
        return OutputSpec(spec, Path(out), recipe=spec)
    if spec == "keep" or spec.upper() in WRITABLE:
        return OutputSpec(spec, Path(out), type=spec if spec == "keep" else spec.upper())
    raise UsageProblem(f"{value!r}: {spec} is not a preset recipe, a ggml type, AMXINT8/AMXINT4 or a recipe file",
                       where="--output", fix="ktconvert quantize --list-recipes lists the presets; the ggml types "
                       f"are {' '.join(WRITABLE)}")


def plan_outputs(src: str | Path, outputs: list[OutputSpec], *, overrides: dict | None = None,
                 threadpool_count: int | None = None, imatrix: str | Path | None = None,
                 include_weights: tuple[str, ...] = (), exclude_weights: tuple[str, ...] = (),
                 target: str | None = None, shard_size: int | str | None = None, **common) -> list[Plan]:
    """One plan per output, each the plan of that output's own ``quantize`` (:func:`plan_conversion`).

    ``threadpool_count`` applies to the kt-amx outputs; ``imatrix``, ``include_weights``/``exclude_weights``,
    ``target``, ``overrides`` (:func:`~ktconvert.convert.recipe.with_overrides`' llama-quantize options) and a
    ``shard_size`` of :data:`KEEP_SPLIT` to the GGUF ones; ``common`` (config, tokenizer, allow_requantize,
    allow_fallback, lora, lora_alpha) and any other ``shard_size`` to all."""
    if not outputs:
        raise UsageProblem("no output given", where="--output", fix="add --output TYPE=DIR")
    check_separate([o.out for o in outputs], where="--output")
    plans = []
    for o in outputs:
        if o.format == "kt-amx":
            plans.append(plan_conversion(src, type=o.type, format="kt-amx", threadpool_count=threadpool_count,
                                         shard_size=None if shard_size == KEEP_SPLIT else shard_size, **common))
            continue
        recipe = resolve_recipe(o.recipe, o.type, common.get("allow_fallback"))
        if overrides:
            recipe = with_overrides(recipe, **overrides)
        gguf = (recipe.format or "gguf") == "gguf"
        plans.append(plan_conversion(
            src, recipe, config=common.get("config"), tokenizer=common.get("tokenizer", True),
            allow_requantize=common.get("allow_requantize", False), allow_fallback=common.get("allow_fallback"),
            lora=common.get("lora"), lora_alpha=common.get("lora_alpha"),
            shard_size=shard_size if gguf or shard_size != KEEP_SPLIT else None,
            imatrix=imatrix if gguf else None, include_weights=include_weights if gguf else (),
            exclude_weights=exclude_weights if gguf else (), target=target if gguf else None))
    return plans


def convert_outputs(src: str | Path, outputs: list[OutputSpec], *, max_memory: int | str = DEFAULT_MAX_MEMORY,
                    jobs: int = 1, resume: bool = False, force: bool = False, progress: Progress | None = None,
                    executor: str = "local", ray_address: str | None = None, **planning) -> list[RunResult]:
    """Write every output from one read of ``src`` (``quantize --output TYPE=DIR ...``): each output is byte for
    byte what its own :func:`convert` writes, with its own manifest, ``--resume`` and rename
    (:func:`~ktconvert.convert.execute.execute_all`). ``planning``: :func:`plan_outputs`' options. Every output is
    planned, claimed and checked before anything is written. With ``resume``, an output that a stopped run already
    completed and renamed (its files as its manifest records, for this plan) is kept as it is."""
    if jobs < 1:
        raise UsageProblem(f"--jobs {jobs} must be at least 1")
    check_executor(executor, ray_address)
    budget = parse_size(max_memory, what="--max-memory")
    kept: dict[int, RunResult] = {}
    with ExitStack() as held:
        held.enter_context(workers_started(jobs, executor))  # the -j workers start while the run is planned
        plans = plan_outputs(src, outputs, **planning)
        for k, (o, plan) in enumerate(zip(outputs, plans)):
            if resume and not force and o.out.is_dir() and not partial_dir(o.out).exists():
                with ExitStack() as lock:
                    lock.enter_context(output_lock(o.out))
                    if finished_output(o.out, plan.fingerprint()):  # renamed before the run stopped: kept as it is
                        kept[k] = RunResult(o.out, json.loads((o.out / "manifest.json").read_text()), 0, 0, 0.0, 0)
                        held.push(lock.pop_all())
                        continue
            held.enter_context(claim_output(o.out, inputs=input_roots(Path(src), [Path(f) for f in plan.input_files]),
                                            force=force))
        todo = [(plan, o.out) for k, (o, plan) in enumerate(zip(outputs, plans)) if k not in kept]
        if executor == "ray" and todo:
            ray = connect(ray_address)
            check_fits(ray, ray_task_memory(budget, jobs), "one conversion task")
        done = iter(execute_all(todo, max_memory=budget, jobs=jobs, resume=resume, force=force, progress=progress,
                                executor=executor) if todo else [])
        return [kept[k] if k in kept else next(done) for k in range(len(outputs))]
