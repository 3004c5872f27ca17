"""``ktconvert quantize`` as a library: recipe -> plan (pure data, validated on shapes alone) -> execute
(streaming, bounded memory, ``jobs`` processes, atomic write, manifest, resume).

Public API (everything else in this package is an implementation detail):

``convert(src, out, recipe=None, *, type=None, format=None, config=None, shard_size=None, tokenizer=True,
max_memory="2GiB", jobs=1, resume=False, force=False, progress=None, executor="local", ray_address=None)
-> RunResult``
    Convert any checkpoint :func:`ktconvert.formats.open_checkpoint` reads into the directory ``out``:
    ``model.gguf`` (llama.cpp names and metadata) or kernel-order safetensors shards, plus ``manifest.json``.
    ``recipe`` is a :class:`Recipe`, a recipe file or a preset name (``"Q4_K_M"``); ``type="Q8_0"`` (or
    ``"keep"``) is the one-type shorthand. Raises :class:`~ktconvert.errors.InputError` (exit 3) before
    anything is written for bad input, a recipe problem or a type a tensor's rows cannot hold. ``executor="ray"``
    runs the units as Ray tasks on a cluster (:mod:`ktconvert.cluster`), byte-identical to the local executor.

``plan_conversion(src, recipe=None, *, type=None, format=None, config=None, shard_size=None, tokenizer=True) -> Plan``
    The same validation, no data read, nothing written: ``Plan.to_dict()``, ``plan_text(plan)``.

``format="kt-amx", type="AMXINT8"|"AMXINT4", threadpool_count=P`` (both calls): kt-kernel's AMX expert directory
    (experts only, one shard per MoE layer, byte-identical to kt-kernel's own packer); a kt-amx directory is also
    accepted as ``src`` (unpacked and dequantized). Packing itself: :mod:`ktconvert.formats.kt_amx`.

``RunResult``: ``out``, ``manifest`` (the dict written to ``manifest.json``), ``units``, ``units_resumed``,
``seconds``, ``in_bytes``.

``load_recipe(path_or_preset) -> Recipe``, ``recipe_for_type(T) -> Recipe``, ``presets() -> {name: path}``.

``convert_lora(src, out, *, to=None, expert_only=False, base_config=None, lora_alpha=None, base_model_name=None,
force=False, allow_nonfinite=False) -> LoraResult``
    MoE LoRA adapters between the forms of the kt-kernel / sglang-kt 0.7.2 stack, checked first (see
    :mod:`ktconvert.convert.lora`; ``convert(..., lora=ADAPTER)`` merges one into the weights).

Importing this package does not import torch; the quantizing workers do.
"""

from __future__ import annotations

from ktconvert.io.lazy import lazy_exports

# loaded on first use: a worker process importing ktconvert.convert.worker needs none of the planning modules
_MODULES = {
    "ktconvert.convert.api": ("DEFAULT_MAX_MEMORY", "OutputSpec", "convert", "convert_outputs", "parse_output",
                              "plan_conversion", "plan_outputs", "resolve_recipe"),
    "ktconvert.convert.execute": ("RunResult", "partial_dir"),
    "ktconvert.convert.lora": ("LoraResult", "convert_lora"),
    "ktconvert.convert.plan": ("KEEP_SPLIT", "Plan", "PlanTensor", "plan_llama_text", "plan_text"),
    "ktconvert.convert.recipe": ("Recipe", "Rule", "load_recipe", "presets", "recipe_for_type", "with_overrides"),
}
__getattr__ = lazy_exports(__name__, {name: mod for mod, names in _MODULES.items() for name in names})

__all__ = [
    "KEEP_SPLIT",
    "DEFAULT_MAX_MEMORY",
    "LoraResult",
    "OutputSpec",
    "Plan",
    "PlanTensor",
    "Recipe",
    "Rule",
    "RunResult",
    "convert",
    "convert_lora",
    "convert_outputs",
    "parse_output",
    "plan_outputs",
    "load_recipe",
    "partial_dir",
    "plan_conversion",
    "plan_llama_text",
    "plan_text",
    "presets",
    "recipe_for_type",
    "with_overrides",
    "resolve_recipe",
]
