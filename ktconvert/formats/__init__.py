"""Checkpoint readers, naming maps and expert-layout detection: the layer every later command reads through.

Public API (everything else in this package is an implementation detail):

``open_checkpoint(path) -> Checkpoint``
    Opens a ``.safetensors`` file, a directory of shards (with or without ``*.safetensors.index.json``), the index
    itself, a ``.gguf`` file or a split GGUF set (``-00001-of-0000N.gguf``; any shard or the directory). Only
    headers are read, and validated; a hostile or broken file raises :class:`ktconvert.errors.InputError` with
    ``path``, ``where`` (tensor name and/or byte offset) and ``fix``.

``Checkpoint``
    A mapping ``name -> TensorInfo`` in file order, plus ``container`` (``"safetensors"``/``"gguf"``), ``files``,
    ``metadata`` (GGUF KV or safetensors ``__metadata__``), ``kv(key)`` (KV with arrays read in full), ``config``
    (the ``config.json`` next to it, if any), ``architecture``, ``dims(config=None) -> ModelDims``, ``notes``,
    ``read(name)`` (zero-copy read-only memmap of one tensor's stored data) and ``read_float32(name, index=None)``
    (decoded float32 copy of a tensor or of its slice ``[index]``, e.g. one expert).

``TensorInfo``
    ``name``, ``shape`` (numpy order), ``ne`` (ggml order, the reverse), ``dtype`` (safetensors dtype or ggml type
    name), ``ggml_type`` (id, GGUF only), ``file``, ``offset`` (absolute), ``nbytes``, ``n_elements``.

``detect_layout(checkpoint, config=None) -> LayoutReport``
    Per layer: layout (``hf-split``, ``hf-fused``, ``gguf-merged``, ``gguf-split``, ``kt-amx``, or ``mixed``), E, I,
    H, fused orientation, per-projection dtypes/shapes/bytes, router / score-bias / shared-expert tensor names, and
    findings (:class:`ktconvert.diagnostics.Diagnostic`, ``extra``: ``layer``, ``tensors``); ``matches`` classifies every tensor name, ``unknown`` lists the rest. ``config`` is a
    ``config.json`` path or dict and overrides the one found next to the checkpoint.

``naming_map(arch_or_model_type) -> NamingMap``, ``naming_maps()``, ``to_gguf_name(name, arch)``,
``to_hf_name(name, arch)``, ``guess_arch(names)``
    llama.cpp <-> HF names from ``rules/naming/*.yaml``. ``NamingMap.lookup(name) -> NameMatch | None`` says what a
    name is (group, layer, expert, projection, layout, counterpart names); ``expert_name(layout, projection, layer,
    expert=None, numa=None, scale=False)`` renders any expert tensor name; ``tensor_entries(model_type)`` lists the
    non-expert tensors a model type has.

``scan_checkpoint(checkpoint, names=None, matches=None, progress=None, fp8=None) -> ScanResult``
    Reads data one expert / one bounded chunk at a time; reports NaN, Inf and all-zero experts (FP8 weights
    dequantized, their scales checked for NaN, Inf, zero and negative values).

``ktconvert.formats.fp8``: ``analyze_fp8(checkpoint, config=None) -> Fp8Map`` (FP8 block-scaled weights paired with
    their ``_scale_inv``, the block size, problems), ``require_fp8`` (the same, raising the first problem),
    ``read_rows(checkpoint, weight, r0, r1)`` / ``read_float32`` (exact float32 dequantization of a row range).

``ktconvert.formats.quantized``: ``analyze(checkpoint, config=None) -> QuantMap`` / ``require`` (every quantized
    release format: FP8, MXFP8, FP8_PERCHANNEL, MXFP4, NVFP4, RAWINT4, GPTQ_INT4; weights with their scales, group
    sizes, problems), ``read_rows`` / ``read_row_ids`` / ``read_float32`` (exact float32 decoding), ``check_scale``.
    Packed weights are recognised when a checkpoint is opened (``Checkpoint.packed``) and shown as their logical
    ``X.weight [N, K]``.

``ktconvert.formats.kt_amx``
    kt-kernel's AMXINT8/AMXINT4 expert format: ``pack_matrix``/``pack_expert`` (bytes equal to kt-kernel's
    packer), ``unpack_matrix``, ``dequantize_matrix``, ``check_alignment``, ``tensor_name``.

``open_release(path) -> Release`` (:mod:`ktconvert.formats.release`)
    A model directory opened once for a run: ``config.json`` read once (``config_sha256``, ``raw``, the normalised
    ``config`` and its family ``spec``), the ``checkpoint`` with every header validated once (``source_records()``
    from those headers), the quantized-release analysis (``quant``, ``qmap``), whole-file hashes once per file
    (``file_sha256``), ``tokenizer_files``. verify, golden and imatrix build one and hand it down.

``build_inspect_report(path, config=None, tensors=None, scan=False, progress_factory=None) -> dict``
    What ``ktconvert inspect`` prints, as data matching ``schemas/inspect-report.schema.json``.
"""

from ktconvert.io.lazy import lazy_exports

# loaded on first use: reading tensor data (a conversion worker) needs neither the naming maps nor the families
_MODULES = {
    "ktconvert.formats.checkpoint": ("Checkpoint", "open_checkpoint"),
    "ktconvert.formats.config": ("ModelDims", "dims_from_gguf", "dims_from_hf_config"),
    "ktconvert.formats.gguf_header": ("GGUFArray",),
    "ktconvert.formats.inspect_report": ("build_inspect_report",),
    "ktconvert.formats.layout": ("LayerLayout", "LayoutReport", "ProjectionInfo", "detect_layout"),
    "ktconvert.formats.naming": ("LAYOUTS", "PROJECTIONS", "NameMatch", "NamingMap", "TensorEntry", "guess_arch",
                                 "load_naming_map", "naming_map", "naming_maps", "to_gguf_name", "to_hf_name"),
    "ktconvert.formats.release": ("Release", "open_release"),
    "ktconvert.formats.scan": ("ScanFinding", "ScanResult", "scan_checkpoint"),
    "ktconvert.formats.tensor_info": ("TensorInfo",),
}
__getattr__ = lazy_exports(__name__, {name: mod for mod, names in _MODULES.items() for name in names})

__all__ = [
    "LAYOUTS",
    "PROJECTIONS",
    "Checkpoint",
    "GGUFArray",
    "LayerLayout",
    "LayoutReport",
    "ModelDims",
    "NameMatch",
    "NamingMap",
    "ProjectionInfo",
    "Release",
    "ScanFinding",
    "ScanResult",
    "TensorEntry",
    "TensorInfo",
    "build_inspect_report",
    "detect_layout",
    "dims_from_gguf",
    "dims_from_hf_config",
    "guess_arch",
    "load_naming_map",
    "naming_map",
    "naming_maps",
    "open_checkpoint",
    "open_release",
    "scan_checkpoint",
    "to_gguf_name",
    "to_hf_name",
]
