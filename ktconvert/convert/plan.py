"""recipe + analysed input -> the plan: every output tensor with its sources, operation, type, bytes, file and
offset, every output file with its header. Pure data, computed from headers and shapes alone.

All validation that does not need tensor data happens here (types the rows cannot hold, types that cannot be
decoded, tensors no rule matches), so a conversion that would fail is refused before its output directory
exists. The plan is also what ``--dry-run`` prints, what the manifest summarises and what ``--resume`` checks
an interrupted run against.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path

from ktconvert import __version__
from ktconvert.convert import metadata
from ktconvert.convert.imatrix_plan import attach_imatrix, read_selection, refuse_without_imatrix
from ktconvert.convert.items import OutFile, Plan, PlanTensor  # noqa: F401 (callers import them from here too)
from ktconvert.convert.recipe import KEEP, ModelFacts, Recipe, Rule
from ktconvert.io.sizes import format_size
from ktconvert.convert.source import Item, Segment, SourceModel
from ktconvert.convert.tokenizer import convert_tokenizer
from ktconvert.errors import InputError, UsageProblem
from ktconvert.formats.gguf_write import DEFAULT_ALIGNMENT, layout_gguf
from ktconvert.formats.safetensors_write import layout_safetensors
from ktconvert.formats.fp8 import FP8_DTYPE
from ktconvert.formats.quantized import FORMATS as RELEASE_FORMATS
from ktconvert.io.dtypes import FLOAT_DTYPES, INT_DTYPES
from ktconvert.quant import as_qtype, block_size, dequantizable, type_size

FORMATS = ("gguf", "safetensors", "kt-amx")
DEFAULT_SAFETENSORS_SHARD = 5 * 1024**3


def _qt(name: str):

    return as_qtype(name)


def _block(name: str) -> tuple[int, int]:

    return block_size(name), type_size(name)


def _decodable(src_dtype: str, container: str) -> bool:
    if src_dtype in ("AMXINT8", "AMXINT4"):  # kt-amx experts: unpacked and dequantized
        return True
    if container == "safetensors":  # FP8 reaches a plan only with its scales checked (formats.fp8)
        return src_dtype in FLOAT_DTYPES or src_dtype == FP8_DTYPE or src_dtype in RELEASE_FORMATS

    try:
        return _qt(src_dtype) in dequantizable()
    except Exception:
        return False


def _lossy(type_name: str) -> bool:
    """A quantized ggml type (blocks with scales), not a float or integer one."""
    try:
        return _block(type_name)[0] > 1
    except Exception:
        return False


def _keep_type(item: Item, container: str) -> str | None:
    if item.src_dtype == "mixed":
        return None
    if container == "safetensors":
        return item.src_dtype if item.src_dtype in ("F32", "F16", "BF16") else None
    return item.src_dtype


def model_facts(src: SourceModel) -> ModelFacts:
    """The facts recipe rules may depend on (``when``, ``more_bits_counted``), from the analysed input."""
    n_experts = src.layout.dims.n_experts or max((ly.n_experts or 0 for ly in src.layout.layers), default=0) or None
    names = tuple(sorted((it.name for it in src.items), key=ModelFacts.order_key))
    return ModelFacts(expert_count=n_experts, tied_embeddings="output.weight" not in names, arch=src.arch, names=names,
                      n_gqa=_n_gqa(src))


def _n_gqa(src: SourceModel) -> int | None:
    """llama.cpp's ``hparams.n_gqa()`` of the output model (layer 0): head_count / head_count_kv of a GGUF input, of
    config.json otherwise (head_count_kv 1 where the family writes MLA as MQA, as the GGUF metadata will say)."""
    def first(v):
        return v if type(v) is int else (v[0] if isinstance(v, (list, tuple)) and v and type(v[0]) is int else None)

    if src.checkpoint.container == "gguf":
        kv = src.checkpoint.metadata
        heads = first(kv.get(f"{src.arch}.attention.head_count"))
        kv_heads = first(kv.get(f"{src.arch}.attention.head_count_kv"))
    else:
        from ktconvert import families

        c = src.config or {}
        c = c["text_config"] if isinstance(c.get("text_config"), dict) else c
        heads, kv_heads = first(c.get("num_attention_heads")), first(c.get("num_key_value_heads"))
        spec = families.find(src.model_type)
        if spec is not None and spec.gguf.mla_mqa:
            kv_heads = 1
    if not heads:
        return None
    kv_heads = kv_heads if kv_heads is not None else heads
    return heads // kv_heads if kv_heads else 0


def _choose(item: Item, recipe: Recipe, n_layers: int | None, container: str, facts: ModelFacts | None = None) -> tuple:
    """``(type, rule, fallback_from, problem)`` for one item."""
    names = (item.name, item.hf_name or "")
    rule = next((r for r in recipe.rules if r.applies(names, item.layer, n_layers, facts)), None)
    if rule is None:
        return None, None, None, (f"no rule of recipe {recipe.name} matches {item.name}", recipe.source,
                                  "end the recipe with a catch-all rule such as {match: '.', type: keep}")
    if container == "safetensors" and item.src_dtype in INT_DTYPES:
        # an index table (token id -> expert ids): llama.cpp gathers with it as I32, whatever type the rule names
        return "I32", rule, None, None
    tried = []
    for cand in (rule.type, *rule.fallback):
        t = _keep_type(item, container) if cand == KEEP else cand
        if t is None:
            tried.append(f"keep ({item.src_dtype} cannot be written as is)")
            continue
        if cand == KEEP and item.reshaped and _block(t)[0] > 1:
            tried.append(f"keep ({t} blocks cannot be reordered without requantizing)")
            continue
        bs = _block(t)[0]
        if item.row_len % bs:
            tried.append(f"{t} (rows of {item.row_len} are not a multiple of its {bs}-element block)")
            continue
        if t != item.src_dtype and not _decodable(item.src_dtype, container):
            tried.append(f"{t} (cannot decode {item.src_dtype} to convert it)")
            continue
        if cand != rule.type and not recipe.allow_fallback:
            fix = ("pass --allow-fallback to write it as " + t if recipe.source.startswith("--type")
                   else "set allow_fallback: true in the recipe") + ", or add a rule for this tensor before it"
            return None, rule, None, (f"{item.name} cannot be stored as " + "; nor as ".join(tried)
                                      + f"; its fallback {t} is not allowed", rule.where, fix)
        return t, rule, (rule.type if cand != rule.type else None), None
    fix = ("add `fallback: [Q8_0, F16]` to the rule, or a rule for this tensor before it"
           if not rule.fallback else "add a usable type to the rule's fallback, or a rule for this tensor before it")
    return None, rule, None, (f"{item.name} cannot be stored as " + "; nor as ".join(tried), rule.where, fix)


# --- building --------------------------------------------------------------------------------------------------------


def build_plan(src: SourceModel, recipe: Recipe, *, format: str | None = None, shard_size: int | None = None,
               tokenizer: bool = True, allow_requantize: bool = False, imatrix: str | Path | None = None,
               include_weights: tuple[str, ...] = (), exclude_weights: tuple[str, ...] = ()) -> Plan:
    """The complete plan, or :class:`InputError` naming the first problem (recipe line, tensor, fix).

    As ``llama-quantize`` does, a tensor stored in a quantized (lossy) type is not quantized again to another
    quantized type unless ``allow_requantize`` (``--allow-requantize``): the errors of two roundings add
    up. Copying it (the same type) or decoding it to F32/F16/BF16 needs no permission.
    """
    fmt = format or recipe.format or "gguf"
    if fmt == "kt-amx":
        raise UsageProblem("--to kt-amx takes its method from --type", fix="pass --type AMXINT8 or --type AMXINT4")
    if fmt not in FORMATS:
        raise UsageProblem(f"output format {fmt!r} is not one of {', '.join(FORMATS)}")
    shard = shard_size if shard_size is not None else recipe.shard_size
    if shard is None:
        shard = 0 if fmt == "gguf" else DEFAULT_SAFETENSORS_SHARD
    if imatrix is not None and fmt != "gguf":
        raise UsageProblem(f"--imatrix applies to GGUF output, not {fmt}", fix="drop --imatrix, or write GGUF (--to gguf)")
    container = src.checkpoint.container
    chosen = []
    problems = []
    facts = model_facts(src)
    whole = None if imatrix is None else read_selection(imatrix, tuple(include_weights), tuple(exclude_weights))
    if whole is not None and whole.select(tuple(include_weights), tuple(exclude_weights)).values:
        facts = replace(facts, imatrix=True)  # llama-quantize's has_imatrix: some mixes choose differently with one
    overridden = tuple(r.match for r in recipe.rules if r.where == "overrides" and r.index > 0)
    if overridden:  # tensors an override takes out of the mix do not advance llama-quant.cpp's counters
        facts = replace(facts, overridden=overridden)
    recipe = _with_unquantized(recipe, src.arch)
    for item in src.items:
        t, rule, fb, prob = _choose(item, recipe, src.n_layers, container, facts)
        if prob:
            problems.append(prob)
        else:
            chosen.append((item, t, rule, fb))
    if not problems and not allow_requantize:
        for item, t, rule, fb in chosen:
            # a release format (MXFP4, NVFP4 also name ggml types) is the release itself, decoded exactly: the
            # only way to a GGUF, so not refused as a second rounding
            if (item.src_dtype not in RELEASE_FORMATS and _lossy(item.src_dtype) and _lossy(t)
                    and (t != item.src_dtype or item.reshaped)):
                raise InputError(
                    f"already {item.src_dtype}; quantizing it again to {t} (rule {rule.index} of {recipe.name}) adds a "
                    "second rounding, which llama-quantize refuses too",
                    path=str(src.path), where=f"tensor {item.name}",
                    fix="pass --allow-requantize to requantize anyway, or convert from the F32/F16/BF16 original")
    if problems:
        msg, where, fix = problems[0]
        more = f" (and {len(problems) - 1} more tensor(s) the recipe cannot place)" if len(problems) > 1 else ""
        raise InputError(msg + more, path=where.split(":")[0] if ":" in where else where,
                         where=":".join(where.split(":")[1:]) or None, fix=fix)

    tensors: list[PlanTensor] = []
    in_bytes: dict[str, int] = {}
    ck = src.checkpoint
    for item, t, rule, fb in chosen:
        bs, ts = _block(t)
        nbytes = item.rows * (item.row_len // bs) * ts
        copy = t == item.src_dtype and not item.reshaped
        in_bytes[item.name] = sum(_segment_bytes(ck[s.source], s) for s in item.segments)
        st_dtype = st_shape = None
        if fmt == "safetensors":
            if bs == 1:
                st_dtype, st_shape = t, item.shape
            else:
                st_dtype, st_shape = "U8", (*item.shape[:-1], item.row_len // bs * ts)
        tensors.append(PlanTensor(
            name=item.name, shape=item.shape, type=t, nbytes=nbytes, file=0, offset=0, segments=item.segments,
            copy_bytes=copy, rule=rule.index, fallback_from=fb, hf_name=item.hf_name, group=item.group,
            layer=item.layer, src_dtype=item.src_dtype, st_dtype=st_dtype, st_shape=st_shape))
        if fmt == "safetensors":
            tensors.append(_companion(item.name, t))

    plan = Plan(source=str(src.path), container=container, arch=src.arch, model_type=src.model_type, format=fmt,
                recipe=recipe, tensors=tensors, files=[], notes=list(src.notes), sources=fingerprints(ck),
                input_files=[str(f) for f in ck.files])
    plan._in_bytes = in_bytes
    if imatrix is None:
        refuse_without_imatrix(plan)
    if fmt == "gguf":
        if imatrix is not None:
            attach_imatrix(plan, imatrix, include=tuple(include_weights), exclude=tuple(exclude_weights), whole=whole)
        _lay_out_gguf(plan, src, shard, tokenizer)
    else:
        _lay_out_safetensors(plan, src, shard)
    return plan


def _with_unquantized(recipe: Recipe, arch: str) -> Recipe:
    """A shipped preset or ``--type`` recipe with, first, an F32 rule for the tensors llama-quantize never quantizes for
    ``arch`` (its naming map's ``unquantized``: glm5-next's hyper-connections, indexer, KDA gates); a recipe file is
    taken as written."""
    from dataclasses import replace

    from ktconvert.formats.naming import naming_map

    if not recipe.source.startswith(("--type", "preset ")):
        return recipe
    try:
        keep = naming_map(arch).unquantized
    except InputError:  # no naming map: nothing to add (the source analysis names the problem)
        return recipe
    if not keep:
        return recipe
    first = Rule(index=0, match=keep, type="F32", where=f"rules/naming/{arch}.yaml:unquantized",
                 note=f"{arch}: tensors llama-quantize never quantizes for this architecture")
    return replace(recipe, rules=(first, *(replace(r, index=r.index + 1) for r in recipe.rules)))


def _segment_bytes(info, s: Segment) -> int:
    """Input bytes a segment reads: its rows of the source, or for a transpose its columns of one expert slab."""
    shape = info.shape or (1,)
    if s.op == "kt-amx":  # one whole expert projection: every part's weight bytes
        return info.nbytes * s.parts
    if s.op == "transpose":
        return info.nbytes // shape[0] * s.rows // shape[-1]
    if s.op == "block_t":
        return info.nbytes * s.t_rows // (math.prod(shape[:-1]) or 1)
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return info.nbytes * s.rows // (rows or 1)


def _companion(name: str, t: str) -> PlanTensor:
    """``blk.L.ffn_gate_exps.ggml_type``: the scalar ktransformers' safetensors loader reads to learn a type."""
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    value = int(_qt(t)).to_bytes(4, "little", signed=True)
    return PlanTensor(name=f"{base}.ggml_type", shape=(), type="I32", nbytes=4, file=0, offset=0, const=value,
                      st_dtype="I32", st_shape=())


#: ``shard_size`` that keeps the input's split: ``llama-quantize --keep-split`` (src/llama-quant.cpp of the pinned
#: llama.cpp, ggml-org/llama.cpp@0c1e57098: tensors sorted by input split, then by offset in it; split i of the input is split i of the output;
#: every split gets split.no / split.count / split.tensors.count, only the first the model's keys).
KEEP_SPLIT = "keep"


def _keep_split(plan: Plan, ck) -> list[int]:
    """Put ``plan.tensors`` in the input split set's order; the input split of each."""
    if ck.container != "gguf":
        raise UsageProblem("--keep-split keeps the split of a split GGUF input; this input is "
                           f"{ck.container}", fix="use --shard-size SIZE to split the output")
    index = {Path(f): i for i, f in enumerate(ck.files)}

    def place(t: PlanTensor) -> tuple[int, int]:
        info = ck[t.segments[0].source]
        return index[Path(info.file)], info.offset

    plan.tensors = sorted(plan.tensors, key=place)
    return [place(t)[0] for t in plan.tensors]


def _shards(sizes: list[int], limit: int) -> list[int]:
    """Shard index of each tensor, in order, starting a new shard when the next tensor would pass ``limit``."""
    out, cur, used = [], 0, 0
    for n in sizes:
        if limit and used and used + n > limit:
            cur, used = cur + 1, 0
        out.append(cur)
        used += n
    return out


def _names(stem: str, ext: str, count: int) -> list[str]:
    if count == 1:
        return [f"{stem}.{ext}"]
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.{ext}" for i in range(count)]


def _lay_out_gguf(plan: Plan, src: SourceModel, shard: int, tokenizer: bool) -> None:

    ck = src.checkpoint
    by_type: Counter = Counter()
    for t in plan.tensors:
        by_type[t.type] += t.nbytes
    quantized = any(_block(t.type)[0] > 1 for t in plan.tensors)
    alignment = DEFAULT_ALIGNMENT
    if ck.container == "gguf":
        unchanged = all(t.copy_bytes for t in plan.tensors)
        ftype = None if unchanged and not plan.recipe.file_type else metadata.file_type(plan.recipe.file_type, by_type)
        kv = metadata.carried_kv(ck.files[0], src.arch, ftype, quantized)
        a = ck.metadata.get("general.alignment")
        alignment = a if type(a) is int else DEFAULT_ALIGNMENT
        plan.tokenizer = "carried over from the input GGUF" if "tokenizer.ggml.model" in ck.metadata else "none"
    else:
        embd = next((t for t in plan.tensors if t.name == "token_embd.weight"), None)
        n_vocab = embd.shape[0] if embd else int(src.config.get("vocab_size", 0))
        model_dir = src.path if src.path.is_dir() else src.path.parent
        vocab = convert_tokenizer(model_dir, n_vocab, src.config) if tokenizer else None
        plan.tokenizer = (f"{vocab.model} (pre {vocab.pre}, {len(vocab.tokens)} tokens, {len(vocab.merges)} merges)"
                          if vocab else "none (tokenizer.ggml.model = none)")
        ftype = metadata.file_type(plan.recipe.file_type, by_type)
        card = metadata.model_card(model_dir, [(t.name, t.shape) for t in plan.tensors if t.const is None])
        plan.notes += metadata.utf8_card(card)
        # general.quantization_version always, as convert_hf_to_gguf writes it (also for F32/F16/BF16 outputs)
        kv = metadata.hf_kv(src.arch, src.config, card, src.n_layers, n_vocab, vocab, ftype, True, src.config_path)
    kv = [*kv, *plan.extra_kv]
    plan.kv_keys = [k for k, _ in kv]
    if shard == KEEP_SPLIT:
        idx = _keep_split(plan, ck)
        count = len(ck.files)
    else:
        idx = _shards([t.nbytes for t in plan.tensors], shard)
        count = max(idx) + 1 if idx else 1
    names = _names("model", "gguf", count)
    files, placed = [], []
    for f in range(count):
        members = [t for t, i in zip(plan.tensors, idx) if i == f]
        shard_kv = list(kv) if f == 0 else []
        if count > 1:
            shard_kv += metadata.split_kv(f, count, len(plan.tensors))
        header, slots, size = layout_gguf(shard_kv, [(t.name, tuple(reversed(t.shape)) or (1,), int(_qt(t.type)), t.nbytes)
                                                     for t in members], alignment)
        files.append(OutFile(names[f], header, size))
        for t, s in zip(members, slots):
            placed.append(_at(t, f, s.offset))
    plan.files = files
    plan.tensors = placed


def _at(t: PlanTensor, file: int, offset: int) -> PlanTensor:
    return PlanTensor(**{**t.__dict__, "file": file, "offset": offset})


def place_shards(plan: Plan, shards: list[tuple[str, list[PlanTensor], dict]]) -> dict[str, str]:
    """Lay each ``(file name, tensors, header metadata)`` shard out as one safetensors file, tensors back to back;
    sets ``plan.files`` and ``plan.tensors`` (now with file and offset) and returns the index's weight map. Every
    safetensors output form (kernel order, HF, kt-amx) is placed here."""
    files, placed, weight_map = [], [], {}
    for f, (name, members, meta) in enumerate(shards):
        header, slots, size = layout_safetensors([(t.name, t.st_dtype, t.st_shape, t.nbytes) for t in members], meta)
        files.append(OutFile(name, header, size))
        for t, s in zip(members, slots):
            placed.append(_at(t, f, s.offset))
            weight_map[t.name] = name
    plan.files, plan.tensors = files, placed
    return weight_map


def _lay_out_safetensors(plan: Plan, src: SourceModel, shard: int) -> None:

    # a tensor and its .ggml_type companion always share a shard
    pairs: list[list[PlanTensor]] = []
    for t in plan.tensors:
        if t.const is not None and pairs:
            pairs[-1].append(t)
        else:
            pairs.append([t])
    idx = _shards([sum(t.nbytes for t in p) for p in pairs], shard)
    count = max(idx) + 1 if idx else 1
    names = _names("model", "safetensors", count)
    meta = {"format": "ktconvert-kernel-order", "layout": "kernel", "architecture": plan.arch,
            "ktconvert_version": __version__}
    weight_map = place_shards(plan, [(names[f], [t for p, i in zip(pairs, idx) if i == f for t in p], meta)
                                     for f in range(count)])
    if count > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in plan.tensors)}, "weight_map": weight_map}
        plan.extra["model.safetensors.index.json"] = (json.dumps(index, indent=2) + "\n").encode()
    model_dir = src.path if src.path.is_dir() else src.path.parent
    if src.checkpoint.container == "safetensors":
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json"):
            p = model_dir / name
            if p.is_file() and p.stat().st_size < 64 * 1024**2:
                plan.extra[name] = p.read_bytes()
    plan.tokenizer = "copied (tokenizer files)" if "tokenizer.json" in plan.extra else "none"


# --- fingerprints ------------------------------------------------------------------------------------------------------


def fingerprints(ck) -> list[dict]:
    """Per input file: name, size, mtime and the sha256 of its header (everything before the first tensor byte).
    Cheap on a 700 GB checkpoint, and enough to notice a file replaced or rewritten under an interrupted run."""
    first: dict[Path, int] = {}
    for info in ck.values():
        first[info.file] = min(first.get(info.file, info.offset), info.offset)
    out = []
    for f in ck.files:
        st = os.stat(f)
        n = min(first.get(f, st.st_size), 64 * 1024**2)
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            h.update(fh.read(n))
        out.append({"file": Path(f).name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "header_sha256": h.hexdigest()})
    return out


# --- text ----------------------------------------------------------------------------------------------------------


def plan_text(plan: Plan, *, tensors: bool = True) -> str:
    """The plan for humans (``--dry-run``): summary, files, types, then one line per output tensor."""
    s = plan.summary()
    lines = [
        f"ktconvert quantize plan: {plan.source}",
        f"  input         {plan.container}, {plan.arch}" + (f" ({plan.model_type})" if plan.model_type else ""),
        f"  recipe        {plan.recipe.name} ({plan.recipe.source})",
        f"  output        {plan.format}, kernel order, {len(plan.files)} data file(s), {format_size(s['output_bytes'])}"
        f" from {format_size(s['input_bytes'])} read",
        f"  tokenizer     {plan.tokenizer}",
    ]
    for f in s["files"]:
        lines.append(f"    {f['name']:<40} {format_size(f['bytes']):>12}")
    lines.append("  types")
    for k, v in s["types"].items():
        lines.append(f"    {k:<8} {v['tensors']:>6} tensor(s) {format_size(v['bytes']):>12}")
    for n in plan.notes:
        lines.append(f"  note: {n}")
    if tensors:
        lines.append("")
        lines.append(f"  {'tensor':<34} {'type':<6} {'numpy shape':<18} {'ggml ne':<18} {'bytes':>10}  rule  operation")
        for t in plan.tensors:
            if t.const is not None:
                continue
            fb = f" (fallback from {t.fallback_from})" if t.fallback_from else ""
            lines.append(f"  {t.name:<34} {t.type:<6} {str(list(t.shape)):<18} {str(list(reversed(t.shape))):<18} "
                         f"{format_size(t.nbytes):>10}  {t.rule!s:>4}  {t.operation()}{fb}")
    return "\n".join(lines) + "\n"


def ggml_type_name(t: str) -> str:
    """ggml's own spelling of a type (``ggml_type_name``): q4_K, q8_0, f32, bf16."""
    return t.lower().replace("_k", "_K")


def plan_llama_text(plan: Plan) -> str:
    """The plan as ``llama-quantize --dry-run`` prints it: its fallback warnings, then one line per tensor in its
    order (layer, then name) with the type it reads and the type it writes, then the totals.

    The input side is what llama-quantize would read: the GGUF itself for a GGUF input, for a Hugging Face input
    the F32 GGUF ``ktconvert quantize --type F32`` (or convert_hf_to_gguf ``--outtype f32``) makes of it.
    """
    from ktconvert.convert.recipe import FILE_TYPE_DEFAULT, ModelFacts

    gguf_in = plan.container == "gguf"
    tensors = sorted((t for t in plan.tensors if t.const is None), key=lambda t: ModelFacts.order_key(t.name))
    default = FILE_TYPE_DEFAULT.get(plan.recipe.file_type or "")
    tied = not any(t.name == "output.weight" for t in tensors)
    output_like = {"output.weight"} | ({"token_embd.weight", "per_layer_token_embd.weight"} if tied else set())
    lines, table = [], []
    size_org = size_new = n_elements = n_fallback = 0
    for i, t in enumerate(tensors, 1):
        src = t.src_dtype if gguf_in else "F32"
        ne = list(reversed(t.shape)) + [1] * (4 - len(t.shape))
        n = math.prod(t.shape)
        bs, ts = _block(src)
        org = n // bs * ts
        n_elements += n
        fallback_from = t.fallback_from
        if (fallback_from and t.name in output_like and default and _block(default)[0] > 1
                and ne[0] % _block(default)[0]):
            # llama.cpp gives an output tensor whose rows its ftype's type cannot hold Q8_0 outright (no warning)
            fallback_from = "Q8_0" if t.type != "Q8_0" else None
        if fallback_from:
            n_fallback += 1
            lines.append(f"warning: {t.name:<36} - ncols {ne[0]:6d} not divisible by {_block(fallback_from)[0]:3d} "
                         f"(required for type {ggml_type_name(fallback_from):>7s}) "
                         + ("(WARNING: must use F16 due to unusual shape) " if t.type == "F16" else "")
                         + f"-> falling back to {ggml_type_name(t.type):>7s}")
        head = (f"[{i:4d}/{len(tensors):4d}] {t.name:<36} - [{', '.join(f'{d:6d}' for d in ne)}], "
                f"type = {ggml_type_name(src):>6s}, ")
        if t.type != src:
            table.append(head + f"size = {org / 1048576:8.2f} MiB -> {t.nbytes / 1048576:8.2f} MiB "
                         f"({ggml_type_name(t.type)})")
        else:
            table.append(head + f"size = {org / 1048576:8.3f} MiB")
        size_org += org
        size_new += t.nbytes if t.type != src else org
    lines += table
    lines.append(f"llama_model_quantize_impl: model size  = {size_org / 1048576:8.2f} MiB "
                 f"({size_org * 8.0 / n_elements:.2f} BPW)")
    lines.append(f"llama_model_quantize_impl: quant size  = {size_new / 1048576:8.2f} MiB "
                 f"({size_new * 8.0 / n_elements:.2f} BPW)")
    if n_fallback:
        lines.append(f"llama_model_quantize_impl: WARNING: {n_fallback} of {len(tensors)} tensor(s) required "
                     "fallback quantization")
    return "\n".join(lines) + "\n"
