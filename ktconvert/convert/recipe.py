"""Conversion recipes: which ggml type each output tensor gets, as data (``rules/convert/*.yaml``).

A recipe is loaded safely (positions kept, so every error names ``file:line``), checked against
``schemas/convert-recipe.schema.json`` and then for what a schema cannot say: regexes that do not compile and
types ktconvert cannot write. ``--type T`` is shorthand for :func:`recipe_for_type`, the same rules a preset uses
with one type everywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from gguf import GGMLQuantizationType

from ktconvert.io.sizes import parse_size
from ktconvert.errors import InputError, UsageProblem
from ktconvert.io import resources
from ktconvert.io.datafile import load_yaml, validate
from ktconvert.io.userregex import FIX as USER_REGEX_FIX, backtracking_risk
from ktconvert.quant import WRITABLE

#: A recipe may name any of ``WRITABLE``, or ``keep``: the input tensor's own type.
KEEP = "keep"

#: The non-linear types llama.cpp's IQ presets choose (``llama_tensor_get_type_impl`` in src/llama-quant.cpp of the
#: llama.cpp that llama-cpp-python 0.3.36 vendors, ggml-org/llama.cpp@0c1e57098); ktconvert writes them all.
IQ_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")

#: llama.cpp's fallbacks when a tensor's rows cannot hold the type (llama-quant.cpp), restricted to the types
#: ktconvert writes (the IQ types to IQ4_NL, Q2_K/Q3_K to Q4_0: tensor_type_fallback).
FALLBACKS = {
    "Q2_K": ("Q4_0", "F16"), "Q3_K": ("Q4_0", "F16"), "Q4_K": ("Q5_0", "F16"), "Q5_K": ("Q5_1", "F16"),
    "Q6_K": ("Q8_0", "F16"), "Q8_0": ("F16",), "Q4_0": ("F16",), "Q4_1": ("F16",), "Q5_0": ("F16",),
    "Q5_1": ("F16",), "IQ4_XS": ("IQ4_NL", "F16"), "IQ4_NL": ("F16",),
    **{t: ("IQ4_NL", "F16") for t in IQ_TYPES if t not in ("IQ4_NL", "IQ4_XS")},
}

#: ``general.file_type`` of ``--type T``: what ``llama-quantize --pure IN OUT T`` writes (one type everywhere, with
#: the same fallbacks). llama-quantize takes the K-quant type names as aliases of the _M mixes (``Q4_K`` is
#: ``Q4_K_M``, ``Q3_K`` ``Q3_K_M``, ``Q5_K`` ``Q5_K_M``: QUANT_OPTIONS in tools/quantize/quantize.cpp) and writes
#: the ftype it was given, whatever ``--pure`` made of the mix. ``keep`` has none: it is derived from the types used.
PURE_FILE_TYPE = {"F32": "ALL_F32", "F16": "F16", "BF16": "BF16", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0",
                  "Q5_1": "Q5_1", "Q8_0": "Q8_0", "Q2_K": "Q2_K", "Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M",
                  "Q5_K": "Q5_K_M", "Q6_K": "Q6_K", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "IQ3_XXS": "IQ3_XXS",
                  "IQ3_S": "IQ3_S", "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS",
                  "IQ2_S": "IQ2_M", "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M"}

#: llama.cpp's default type of each ftype (``llama_ftype_get_default_type``), for the file types a recipe may state
FILE_TYPE_DEFAULT = {"ALL_F32": "F32", "F16": "F16", "BF16": "BF16", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0",
                     "Q5_1": "Q5_1", "Q8_0": "Q8_0", "Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K",
                     "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K",
                     "Q6_K": "Q6_K", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "Q2_K_S": "Q2_K", "IQ1_S": "IQ1_S",
                     "IQ1_M": "IQ1_M", "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_XS", "IQ2_M": "IQ2_S",
                     "IQ3_XXS": "IQ3_XXS", "IQ3_XS": "IQ3_S", "IQ3_S": "IQ3_S", "IQ3_M": "IQ3_S"}

#: llama-quantize's refusal without an importance matrix (``tensor_requires_imatrix``): a tensor other than
#: output.weight / token_embd.weight quantized to one of these types, or to Q2_K in a Q2_K_S file.
NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS")


def requires_imatrix(name: str, type_name: str, file_type: str | None) -> bool:
    """Whether llama-quantize refuses to quantize tensor ``name`` to ``type_name`` without an importance matrix
    (src/llama-quant.cpp ``tensor_requires_imatrix``; the file type matters for Q2_K only)."""
    if name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    return type_name in NEEDS_IMATRIX or (type_name == "Q2_K" and file_type == "Q2_K_S")


#: Tensors llama.cpp never quantizes (routers, norms, biases, the score-correction bias, rope frequencies, SSM conv kernels,
#: the 1-D hyper-connection base/scale vectors, llama.cpp names not ending in .weight such as ssm_a; a rule also sees
#: the HF name, so an HF name is exempt from that last clause: DeepSeek-V4's attn_hc.fn is blk.L.hc_attn_fn.weight,
#: which llama-quantize quantizes): every preset and ``--type`` keep them in F32, as convert_hf_to_gguf and
#: llama-quantize do.
F32_MATCH = r"_norm\.weight$|\.bias$|ffn_gate_inp(_shexp)?\.weight$|^rope_freqs\.weight$|attn_sinks\.weight$|ssm_conv1d|indexer\.[qk]_proj\.weight$|hc_(\w+_)?(base|scale)\.weight$|^(?!model\.|lm_head\.|.*\.weight$)"


@dataclass(frozen=True)
class Rule:
    """One recipe rule. ``where`` is ``file:line`` of the rule, for messages; ``index`` its position (0-based)."""

    index: int
    match: str
    type: str
    fallback: tuple[str, ...] = ()
    layers: str | tuple[int, ...] | None = None
    note: str = ""
    where: str = ""
    when: tuple[tuple[str, object], ...] = ()

    @property
    def regex(self) -> re.Pattern:
        return re.compile(self.match)

    def applies(self, names: tuple[str, ...], layer: int | None, n_layers: int | None,
                model: "ModelFacts | None" = None) -> bool:
        """Whether this rule places the tensor ``names[0]`` (its llama.cpp name; ``names[1]`` the HF one)."""
        facts = model or ModelFacts()
        for key, want in self.when:
            if key.endswith("_min"):  # n_gqa_min: 4 is llama-quant.cpp's n_gqa() >= 4
                have = facts.get(key.removesuffix("_min"))
                if have is None or have < want:
                    return False
                continue
            have = facts.get(key)
            if have is None or (have not in want if isinstance(want, tuple) else have != want):
                return False
        if self.layers is not None:
            if self.layers in COUNTED:
                pos = facts.counted(self.match, names[0])
                if pos is None or not COUNTED[self.layers](pos[0], pos[1], n_layers):
                    return False
            elif layer is None:
                return False
            elif self.layers == "more_bits":
                if not n_layers or not use_more_bits(layer, n_layers):
                    return False
            elif self.layers == "first_eighth":
                if not n_layers or layer >= n_layers // 8:
                    return False
            elif self.layers == "first_sixteenth":
                if not n_layers or layer >= n_layers // 16:
                    return False
            elif self.layers == "middle":
                if not n_layers or not n_layers // 8 <= layer < 7 * n_layers // 8:
                    return False
            elif layer not in self.layers:
                return False
        rx = self.regex
        return any(rx.search(n) for n in names)


@dataclass(frozen=True)
class ModelFacts:
    """What a rule's ``when`` and ``layers: more_bits_counted`` look at, for one output model.

    ``expert_count`` (routed experts per MoE layer), ``tied_embeddings`` (the output has no ``output.weight``:
    llama.cpp then gives ``token_embd.weight`` the output's type), ``arch`` (the llama.cpp architecture: llama-quant.cpp
    keeps some tensors of some architectures unquantized, glm5-next's), ``imatrix`` (quantizing with an importance
    matrix), ``n_gqa`` (attention heads per KV head, llama.cpp's ``hparams.n_gqa()`` of layer 0) and ``names``: every output tensor name, in
    llama.cpp's order (layer, then name), which ``more_bits_counted`` counts in.
    """

    expert_count: int | None = None
    tied_embeddings: bool | None = None
    arch: str | None = None
    names: tuple[str, ...] = ()
    imatrix: bool = False
    n_gqa: int | None = None
    overridden: tuple[str, ...] = ()  # the regexes of llama-quantize's overrides in front of the recipe's rules
    _hits: dict = field(default_factory=dict, compare=False, repr=False)

    def get(self, key: str):
        if key == "expert_count":  # llama-quant.cpp: n_expert (0 for a dense model)
            return self.expert_count or 0
        return getattr(self, key, None) if key in ("tied_embeddings", "arch", "imatrix", "n_gqa") else None

    def counted(self, match: str, name: str) -> tuple[int, int] | None:
        """``(i, n)``: ``name`` is the i-th of the n output tensors ``match`` finds, in llama.cpp's order. As
        llama-quant.cpp's counters (i_attention_wv, i_ffn_down) do, ``i`` skips the tensors an override
        (``--tensor-type``, ``overridden``) takes out of the mix; ``n`` counts them all (n_attention_wv)."""
        if match not in self._hits:
            rx = re.compile(match)
            hits = [n for n in self.names if rx.search(n)]
            skip = [re.compile(o) for o in self.overridden]
            mixed = [n for n in hits if not any(o.search(n) for o in skip)]
            self._hits[match] = ({n: i for i, n in enumerate(mixed)}, len(hits))
        where, n = self._hits[match]
        return (where[name], n) if name in where else None

    @staticmethod
    def order_key(name: str) -> tuple[int, str]:
        """llama.cpp's tensor order (llama-model-loader's weights_map): ``blk.N.`` by N (others first), then name."""
        m = re.match(r"blk\.(\d+)\.", name)
        return (int(m.group(1)) if m else -1, name)


@dataclass(frozen=True)
class Recipe:
    """A validated recipe. ``source`` is where it came from (a file path, ``preset NAME`` or ``--type T``)."""

    name: str
    rules: tuple[Rule, ...]
    source: str
    description: str = ""
    file_type: str | None = None
    format: str | None = None
    shard_size: int | None = None
    allow_fallback: bool = True
    data: dict = field(default_factory=dict, compare=False)
    imatrix: str | None = None  # quantize.imatrix: the importance matrix (a path, relative to the recipe file)
    include_weights: tuple[str, ...] = ()
    exclude_weights: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """The recipe as plain data (what the manifest records)."""
        return {"name": self.name, "source": self.source, **{k: v for k, v in self.data.items() if k != "kind"},
                "allow_fallback": self.allow_fallback}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers its _M mixes give more bits (llama-quant.cpp, integer arithmetic)."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


#: ``layers`` values that look at the tensor's position ``i`` among the ``n`` output tensors the rule's match finds
#: (llama-quant.cpp's counters i_attention_wv / i_ffn_down, counted in its tensor order), and ``block_count``:
#: use_more_bits(i, n) (the _M mixes' attn_v), i < 2 (Q3_K_M's attn_v), i < block_count / 8 (the IQ1/IQ2 mixes'
#: ffn_down, which compare the running ffn_down count, not the layer, with n_layer / 8).
COUNTED = {
    "more_bits_counted": lambda i, n, n_layers: use_more_bits(i, n),
    "counted_first_two": lambda i, n, n_layers: i < 2,
    "counted_first_eighth": lambda i, n, n_layers: bool(n_layers) and i < n_layers // 8,
}


def presets() -> dict[str, Path]:
    """Shipped recipes (``rules/convert/*.yaml``) by name."""
    out = {}
    for f in sorted((resources.rules_dir() / "convert").glob("*.yaml")):
        out[f.stem] = f
    return out


def load_recipe(spec: str | Path) -> Recipe:
    """A recipe from a file path or a preset name (``Q4_K_M``). Raises :class:`InputError` with ``file:line``."""
    p = Path(spec)
    if not p.exists():
        table = presets()
        key = next((k for k in table if k.lower() == str(spec).lower()), None)
        if key is None:
            raise UsageProblem(
                f"--recipe {spec!r} is neither a file nor a preset",
                fix=f"give a recipe file or one of the presets: {', '.join(table)}",
            )
        p = table[key]
        source, shown = f"preset {key}", f"rules/convert/{p.name}"
    else:
        source = shown = str(p)

    loaded = load_yaml(p, shown)
    return recipe_from_data(loaded.data, shown, source, loaded.where)


def recipe_from_data(data, path: str, source: str, where=None) -> Recipe:
    """Validate parsed recipe data. ``where(path_tuple) -> (line, col)`` locates values for messages."""

    def at(*keys) -> str:
        if where is None:
            return "/".join(map(str, keys)) or "(top)"
        line, col = where(tuple(str(k) for k in keys))
        return f"{line}:{col}"

    if not isinstance(data, dict):
        raise InputError("a recipe is a YAML mapping with kind: convert-recipe", path=path, where=at(),
                         fix="see rules/convert/ for examples")
    # Types first: they get a message that says which types exist, not a schema enum dump.
    allowed = WRITABLE
    for i, rule in enumerate(data.get("rules") or []):
        if not isinstance(rule, dict):
            continue
        for key, values in (("type", [rule.get("type")]), ("fallback", rule.get("fallback") or [])):
            for j, t in enumerate(values if isinstance(values, list) else []):
                if isinstance(t, str) and t not in allowed and t != KEEP:
                    loc = at("rules", i, key) if key == "type" else at("rules", i, key, j)
                    raise InputError(_type_message(t, i, allowed), path=path, where=loc,
                                     fix=f"use one of {', '.join(allowed)} or keep")

    validate(data, where or (lambda keys: (1, 1)), "convert-recipe", path, "recipe")
    rules = []
    for i, r in enumerate(data["rules"]):
        try:
            re.compile(r["match"])
        except re.error as exc:
            raise InputError(f"rule {i} match {r['match']!r} is not a valid regex: {exc}", path=path,
                             where=at("rules", i, "match"), fix="fix the regular expression") from None
        if (risk := backtracking_risk(r["match"])) is not None:
            raise InputError(f"rule {i} match {r['match']!r} has {risk}: matching it against the tensor names could "
                             "run for hours", path=path, where=at("rules", i, "match"), fix=USER_REGEX_FIX)
        layers = r.get("layers")
        when = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (r.get("when") or {}).items()))
        rules.append(Rule(
            index=i, match=r["match"], type=r["type"], fallback=tuple(r.get("fallback", ())),
            layers=tuple(layers) if isinstance(layers, list) else layers, note=r.get("note", ""),
            where=f"{path}:{at('rules', i)}", when=when,
        ))
    file_type = data.get("file_type")
    if "base" in data:  # this recipe's rules first, then the preset's: "as llama.cpp, except ..."
        table = presets()
        key = next((k for k in table if k.lower() == str(data["base"]).lower()), None)
        if key is None:
            raise InputError(f"base {data['base']!r} is not a preset", path=path, where=at("base"),
                             fix=f"use one of {', '.join(table)}")
        base = load_recipe(key)
        if "base" in base.data:
            raise InputError(f"preset {key} has a base of its own", path=path, where=at("base"),
                             fix="a base is a preset without one")
        rules += [replace(r, index=len(rules) + j) for j, r in enumerate(base.rules)]
        file_type = file_type or base.file_type
    out = data.get("output", {})
    shard = out.get("shard_size")
    recipe = Recipe(
        name=data["name"], rules=tuple(rules), source=source, description=data.get("description", ""),
        file_type=file_type, format=out.get("format"),
        shard_size=None if shard is None else parse_size(shard, what=f"{path}: output.shard_size"),
        allow_fallback=bool(data.get("allow_fallback", True)), data=data,
    )
    return _with_quantize_section(recipe, data.get("quantize") or {}, path, at)


#: A recipe's ``quantize:`` keys that are llama-quantize's per-tensor options (:func:`with_overrides`).
_OVERRIDE_KEYS = ("tensor_types", "output_tensor_type", "token_embedding_type", "leave_output_tensor", "pure")


def _with_quantize_section(recipe: Recipe, q: dict, path: str, at) -> Recipe:
    """``recipe`` with its ``quantize:`` section applied: llama-quantize's overrides become rules in front (as
    ``quantize --tensor-type ...`` would add them; options given on the command line go in front of these), the
    importance matrix and its include/exclude lists are kept for the conversion. A bad entry is an
    :class:`InputError` at its ``file:line``."""
    if not q:
        return recipe
    if q.get("include_weights") and q.get("exclude_weights"):
        raise InputError("quantize: include_weights and exclude_weights cannot be used together (as in "
                         "llama-quantize)", path=path, where=at("quantize", "exclude_weights"), fix="keep one of them")
    kw: dict = {}
    for key in _OVERRIDE_KEYS:
        if key not in q:
            continue
        values = [(q[key], at("quantize", key))] if key != "tensor_types" else [
            ((spec,), at("quantize", key, j)) for j, spec in enumerate(q[key])]
        for value, loc in values:
            try:
                with_overrides(recipe, **{key: value})
            except UsageProblem as exc:
                raise InputError(exc.message.replace("--", "quantize: ", 1), path=path, where=loc,
                                 fix=exc.fix) from None
        kw[key] = tuple(q[key]) if key == "tensor_types" else q[key]
    out = with_overrides(recipe, **kw) if kw else recipe
    imatrix = q.get("imatrix")
    if imatrix is not None and not Path(imatrix).is_absolute() and Path(path).exists():
        imatrix = str(Path(path).parent / imatrix)
    return replace(out, imatrix=imatrix, include_weights=tuple(q.get("include_weights", ())),
                   exclude_weights=tuple(q.get("exclude_weights", ())))


def _type_message(t: str, index: int, allowed: tuple[str, ...] = WRITABLE) -> str:
    if t.upper() in allowed:
        return f"rule {index}: type {t!r} is spelled {t.upper()!r}"
    if t.upper() in GGMLQuantizationType.__members__:
        return (f"rule {index}: ktconvert cannot write {t.upper()} (it quantizes bit-exactly only to "
                f"{', '.join(WRITABLE)})")
    return f"rule {index}: {t!r} is not a ggml type"


def recipe_for_type(type_name: str, allow_fallback: bool = False) -> Recipe:
    """``--type T``: routers, norms and biases in F32, every other tensor ``T``. llama.cpp's fallbacks are
    listed but taken only with ``allow_fallback`` (``--allow-fallback``): asked for one type, a tensor silently
    written as another is a wrong answer."""
    t = type_name if type_name == KEEP else type_name.upper()
    if t not in WRITABLE and t != KEEP:
        raise UsageProblem(_type_message(type_name, 0).replace("rule 0: ", "--type: "),
                           fix=f"use one of {', '.join(WRITABLE)} or keep")
    data = {
        "kind": "convert-recipe",
        "name": t,
        "description": f"--type {t}: routers, norms and biases F32, everything else {t}",
        "allow_fallback": allow_fallback,
        "rules": [
            {"match": F32_MATCH, "type": "F32", "note": "routers, norms, biases, score-correction bias"},
            {"match": ".", "type": t, **({"fallback": list(FALLBACKS[t])} if t in FALLBACKS else {})},
        ],
    }
    ft = PURE_FILE_TYPE.get(t)
    if ft:
        data["file_type"] = ft
    return recipe_from_data(data, f"--type {t}", f"--type {t}")



def with_overrides(recipe: Recipe, *, tensor_types: tuple[str, ...] = (), output_tensor_type: str | None = None,
                   token_embedding_type: str | None = None, leave_output_tensor: bool = False,
                   pure: bool = False) -> Recipe:
    """``recipe`` with llama-quantize's overrides, in its order of precedence (``llama_tensor_get_type``):
    ``--token-embedding-type`` (token_embd / per_layer_token_embd, no fallback), ``--output-tensor-type``
    (output.weight, no fallback), ``--leave-output-tensor`` (output.weight keeps its type), then
    ``--tensor-type REGEX=TYPE`` (the first regex found in the llama.cpp name wins, with llama.cpp's fallbacks; a
    type equal to the mix's still takes the tensor out of the mix), then ``--pure`` (one type: the recipe's
    ``file_type``'s default, as ``llama-quantize --pure``) or the recipe's own rules. Routers, norms and biases stay
    F32 whatever is asked. Raises :class:`UsageProblem` for an unknown type or a bad regex."""
    def typ(t: str, flag: str) -> str:
        u = t.upper()
        if u not in WRITABLE:
            raise UsageProblem(_type_message(t, 0).replace("rule 0: ", f"{flag}: "),
                               fix=f"use one of {', '.join(WRITABLE)}")
        return u

    front: list[tuple[str, str, tuple[str, ...], str]] = []
    if token_embedding_type:
        front.append((r"^(per_layer_)?token_embd\.weight$", typ(token_embedding_type, "--token-embedding-type"), (),
                      "--token-embedding-type"))
    if output_tensor_type:
        front.append((r"^output\.weight$", typ(output_tensor_type, "--output-tensor-type"), (),
                      "--output-tensor-type"))
    elif leave_output_tensor:
        front.append((r"^output\.weight$", KEEP, (), "--leave-output-tensor"))
    for spec in tensor_types:
        rx, sep, t = spec.rpartition("=")
        if not sep or not rx or not t:
            raise UsageProblem(f"--tensor-type {spec!r} is not REGEX=TYPE", fix="e.g. --tensor-type 'ffn_.*_exps=Q4_K'")
        try:
            re.compile(rx)
        except re.error as exc:
            raise UsageProblem(f"--tensor-type {spec!r}: {rx!r} is not a valid regex: {exc}",
                               fix="fix the regular expression") from None
        if (risk := backtracking_risk(rx)) is not None:
            raise UsageProblem(f"--tensor-type {spec!r}: {rx!r} has {risk}", fix=USER_REGEX_FIX)
        t = typ(t, "--tensor-type")
        front.append((rx, t, FALLBACKS.get(t, ()), f"--tensor-type {spec}"))
    base = recipe
    if pure and recipe.file_type in FILE_TYPE_DEFAULT:
        one = recipe_for_type(FILE_TYPE_DEFAULT[recipe.file_type], recipe.allow_fallback)
        base = replace(one, file_type=recipe.file_type, name=recipe.name, source=recipe.source,
                       imatrix=recipe.imatrix, include_weights=recipe.include_weights,
                       exclude_weights=recipe.exclude_weights)
    elif pure:
        raise UsageProblem(f"--pure needs a recipe with a file_type ({recipe.source} has none)",
                           fix="use --type T, or a preset (--list-recipes)")
    if not front:
        return base
    rules = [Rule(index=0, match=F32_MATCH, type="F32", note="routers, norms, biases: never overridden",
                  where="overrides")]
    rules += [Rule(index=len(rules) + i, match=rx, type=t, fallback=fb, note=note, where="overrides")
              for i, (rx, t, fb, note) in enumerate(front)]
    rules += [replace(r, index=len(rules) + j) for j, r in enumerate(base.rules)]
    return replace(base, rules=tuple(rules))

__all__ = ["F32_MATCH", "FALLBACKS", "FILE_TYPE_DEFAULT", "IQ_TYPES", "KEEP", "NEEDS_IMATRIX",
           "requires_imatrix", "PURE_FILE_TYPE", "WRITABLE", "ModelFacts", "Recipe", "Rule", "load_recipe", "presets", "with_overrides",
           "recipe_for_type", "recipe_from_data", "use_more_bits"]
