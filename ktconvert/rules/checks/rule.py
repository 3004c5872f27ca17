"""Checks of one rule against the catalog alone: regexes (KT301-KT303, KT305), match classes (KT211/KT213), the
operator, its backend and forward contract (KT201/KT203/KT204), its kwargs and their values (KT202/KT205-KT209/KT212/
KT214)."""

from __future__ import annotations

import re

from ktconvert.io.userregex import FIX as USER_REGEX_FIX
from ktconvert.rules import regexlint
from ktconvert.rules.catalog import Operator
from ktconvert.rules.checks import check
from ktconvert.rules.compile import RuleView
from ktconvert.rules.contracts import contract_fix, contract_msg
from ktconvert.rules.suggest import suggest

DEVICE_RE = re.compile(r"^(cpu|cuda|xpu|npu|mps)(:[0-9]+)?$")


# --- match ---------------------------------------------------------------------------------------------------------
@check("KT301", stage="rule")
def regex_does_not_compile(ctx, view: RuleView, op) -> None:
    exc = view.regex_error
    if exc is not None:
        ctx.add("KT301", view.path + ("match", "name"), f"regex does not compile: {exc.msg} at offset {exc.pos}",
                "fix the pattern (remember YAML double quotes need \\\\. for a literal dot)")


@check("KT305", stage="rule")
def regex_can_backtrack_without_end(ctx, view: RuleView, op) -> None:
    if view.regex_risk is not None:
        ctx.add("KT305", view.path + ("match", "name"), f"regex {view.name!r} has {view.regex_risk}: matching it "
                "against a module path can run for hours, so it is not matched", USER_REGEX_FIX)


@check("KT302", stage="rule")
def unescaped_dot(ctx, view: RuleView, op) -> None:
    if view.name_re is None:
        return
    dots = regexlint.unescaped_dots(view.name)
    if dots:
        at = dots[0]
        fixed = view.name[:at] + "\\\\." + view.name[at + 1:]
        ctx.add("KT302", view.path + ("match", "name"), f"unescaped '.' at offset {at} of {view.name!r} matches any "
                "character", f'escape it; inside YAML double quotes write "{fixed}"')


@check("KT303", stage="rule")
def unanchored_pattern(ctx, view: RuleView, op) -> None:
    if view.name_re is None:
        return
    loose = regexlint.unanchored_alternatives(view.name)
    if loose:
        ctx.add("KT303", view.path + ("match", "name"), f"pattern part {loose[0]!r} is unanchored; re.search matches it "
                "anywhere in the module path", "anchor it with ^...$ (or at least one end)")


def _unknown_class(ctx, view: RuleView) -> str | None:
    cls = view.cls
    return cls if isinstance(cls, str) and ctx.catalog.type_of_class(cls) is None else None


@check("KT213", stage="rule")
def match_class_is_an_operator(ctx, view: RuleView, op) -> None:
    cls = _unknown_class(ctx, view)
    if cls and (cls in ctx.catalog.operators or cls in ctx.catalog.op_classes):
        ctx.add("KT213", view.path + ("match", "class"),
                f"match.class names the operator {cls.rsplit('.', 1)[-1]}; matching runs on the original model "
                "before injection, so this rule never matches",
                "match the original model class (e.g. ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE) or a name")


@check("KT211", stage="rule")
def match_class_unknown(ctx, view: RuleView, op) -> None:
    cls = _unknown_class(ctx, view)
    if cls and not (cls in ctx.catalog.operators or cls in ctx.catalog.op_classes):
        hint = suggest(cls, ctx.catalog.alias_to_type)
        ctx.add("KT211", view.path + ("match", "class"),
                f"match.class {cls!r} is not a module class the catalog knows; its matches are not checked"
                + (f"; did you mean {hint!r}?" if hint else ""),
                "use a known class path, or add the module type to a --catalog file")


# --- operator ------------------------------------------------------------------------------------------------------
@check("KT201", stage="rule")
def unknown_operator(ctx, view: RuleView, op) -> None:
    rclass, cat = view.replace_class, ctx.catalog
    if op is not None or not isinstance(rclass, str):
        return
    short = rclass.rsplit(".", 1)[-1]
    same_short = [p for p in cat.operators if p.rsplit(".", 1)[-1] == short]
    hint = same_short[0] if same_short else suggest(rclass, cat.operators)
    extra = f"; {short} is an op, selected through generate_op/prefill_op of a wrapper" if rclass in cat.op_classes else ""
    ctx.add("KT201", view.path + ("replace", "class"),
            f"unknown operator class {rclass!r}" + (f"; did you mean {hint!r}?" if hint else "") + extra,
            "use an operator from the catalog (ktconvert check-rules --list-checks explains; --catalog adds your own)")


def backend_contract_mismatch(ctx, op: Operator) -> str | None:
    """The contract the backend's decoder layer calls a norm / MLP operator with, when ``op`` does not meet it.

    A norm is always called by the decoder layer, so this decides KT204 for it here. An MLP may instead be a MoE
    block's shared expert, called with that block's contract; the tree (or, without one, the static) stage decides
    KT204 and KT203 for MLPs, and this only tells KT203 here to leave them to it."""
    backend = ctx.result.backend
    if not backend or op.role not in ("norm", "mlp"):
        return None
    caller = ctx.catalog.decoder_contract(backend, op)
    return caller if caller and op.contract not in ("any", caller) else None


@check("KT204", stage="rule")
def decoder_layer_contract(ctx, view: RuleView, op) -> None:
    caller = backend_contract_mismatch(ctx, op) if op is not None and op.role == "norm" else None
    if caller:
        ctx.add("KT204", view.path + ("replace", "class"),
                contract_msg(op, caller, f"the {ctx.result.backend} decoder layer"), contract_fix(op, caller))


@check("KT203", stage="rule")
def operator_of_another_backend(ctx, view: RuleView, op) -> None:
    backend = ctx.result.backend
    if op is None or not backend or backend_contract_mismatch(ctx, op) or backend in op.backends:
        return
    add_other_backend(ctx, view.path, op)


def add_other_backend(ctx, rule_path: tuple, op: Operator) -> None:
    backend = ctx.result.backend
    ctx.add("KT203", rule_path + ("replace", "class"),
            f"{op.short} works under {', '.join(op.backends)}, not under the {backend} backend"
            f" (backend from {ctx.result.backend_source})", _backend_fix(ctx.catalog, op, backend))


def _backend_fix(cat, op: Operator, backend: str) -> str:
    for path, other in cat.operators.items():
        if other.role == op.role and backend in other.backends and path != op.path and set(op.replaces) & set(other.replaces):
            return f"under {backend} use e.g. {other.short}, or name the backend (--backend or '# ktconvert: backend=...')"
    return "use an operator made for this backend, or name the backend (--backend or '# ktconvert: backend=...')"


# --- kwargs --------------------------------------------------------------------------------------------------------
def allowed_kwargs(cat, op: Operator, kwargs: dict) -> dict:
    """What ``op`` takes given the ops its kwargs select: its own kwargs, its op slots, the selected ops' kwargs."""
    allowed = dict(op.kwargs)
    for slot_name in op.ops:
        allowed[slot_name] = {"type": "op"}
    for slot_name, slot in op.ops.items():
        value = kwargs.get(slot_name, slot.default)
        if isinstance(value, str):
            allowed.update(cat.op_kwargs(value))
    return allowed


def _given(ctx, view: RuleView, op):
    """``(path, key, value, spec)`` of each kwarg the rule gives its operator (spec None: not taken)."""
    if op is None:
        return []
    allowed = allowed_kwargs(ctx.catalog, op, view.kwargs)
    kp = view.path + ("replace", "kwargs")
    return [(kp + (str(k),), k, v, allowed.get(k)) for k, v in view.kwargs.items()]


@check("KT206", stage="rule")
def unknown_kwarg(ctx, view: RuleView, op) -> None:
    cat = ctx.catalog
    for path, key, _, spec in _given(ctx, view, op):
        if spec is not None:
            continue
        allowed = allowed_kwargs(cat, op, view.kwargs)
        hint = suggest(str(key), allowed) or suggest(str(key), cat.all_kwarg_names)
        why = (f"{op.short} (with its selected ops) does not take {key!r}" if key in cat.all_kwarg_names
               else f"unknown kwarg {key!r} for {op.short}")
        ctx.add("KT206", path, why + (f"; did you mean {hint!r}?" if hint and hint != key else "") +
                "; upstream passes it on verbatim, where it is ignored or raises TypeError at load",
                f"remove it, or use one of: {', '.join(sorted(allowed))}", key=True)


@check("KT214", stage="rule")
def ignored_kwarg(ctx, view: RuleView, op) -> None:
    for path, key, _, spec in _given(ctx, view, op):
        if spec is not None and spec.get("ignored"):
            ctx.add("KT214", path, f"{op.short} has no parameter {key!r}: upstream's constructor takes it into **kwargs "
                    "and nothing reads it, so it changes nothing" + (f" ({spec['note']})" if spec.get("note") else ""),
                    "remove it (or use the operator that has this parameter)", key=True)


def _is_none(value) -> bool:
    return value is None or value == "None"


@check("KT208", stage="rule")
def op_disabled_where_required(ctx, view: RuleView, op) -> None:
    for path, key, value, spec in _given(ctx, view, op):
        slot = op.ops.get(key) if spec is not None and spec.get("type") == "op" else None
        if slot is None or not _is_none(value) or slot.unused or value in op.none_ok:
            continue
        spelled = "the string 'None'" if value == "None" else "null"
        ctx.add("KT208", path, f"{slot.name}: {spelled} disables the op, which {op.short} cannot take"
                + (f": {op.none_note}" if op.none_note else ""),
                f"name an op ({', '.join(ctx.catalog.ops_of_kind(slot.kind))})"
                + ("" if not op.none_ok else f", or write {'null' if None in op.none_ok else repr('None')}"))


@check("KT202", stage="rule")
def unknown_op(ctx, view: RuleView, op) -> None:
    cat = ctx.catalog
    for path, key, value, spec in _given(ctx, view, op):
        slot = op.ops.get(key) if spec is not None and spec.get("type") == "op" else None
        if slot is None or _is_none(value) or not isinstance(value, str):
            continue
        if value not in cat.ops or cat.ops[value]["kind"] != slot.kind:
            choices = cat.ops_of_kind(slot.kind)
            other = f"; {value} is a {cat.ops[value]['kind']} op" if value in cat.ops else ""
            hint = suggest(value, choices)
            ctx.add("KT202", path, f"unknown {slot.kind} op {value!r} for {slot.name}{other}"
                    + (f"; did you mean {hint!r}?" if hint else "") + " (upstream raises KeyError at load)",
                    f"use one of: {', '.join(choices)}")


def _bad_value(kind: str, spec: dict, value) -> str | None:
    """What ``value`` should have been for a kwarg of type ``kind`` (None when it is fine)."""
    if kind == "device":
        ok = isinstance(value, str) and DEVICE_RE.match(value)
        return None if ok else "a device like cpu, cuda, cuda:1, xpu or npu:0"
    if kind == "bool":
        return None if isinstance(value, bool) else "true or false"
    if kind == "int":
        bad = isinstance(value, bool) or not isinstance(value, int) or value < spec.get("min", value)
        return ("an integer" + (f" >= {spec['min']}" if "min" in spec else "")) if bad else None
    if kind == "string":
        return None if isinstance(value, str) else "a string"
    if kind == "int-list":
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return None if ok else "a list of integers"
    return None


@check("KT207", stage="rule")
def bad_kwarg_value(ctx, view: RuleView, op) -> None:
    cat = ctx.catalog
    for path, key, value, spec in _given(ctx, view, op):
        if spec is None:
            continue
        kind = spec["type"]
        if kind == "op":
            slot = op.ops[key]
            if not _is_none(value) and not isinstance(value, str):
                ctx.add("KT207", path, f"{slot.name} must be an op name, got {value!r}",
                        f"use one of: {', '.join(cat.ops_of_kind(slot.kind))}")
        elif kind == "enum":
            if value not in spec["values"]:
                hint = suggest(str(value), [str(v) for v in spec["values"]])
                ctx.add("KT207", path, f"{key}: {value!r} is not one of {', '.join(map(str, spec['values']))}"
                        + (f"; did you mean {hint!r}?" if hint else ""), f"use one of: {', '.join(map(str, spec['values']))}")
        elif kind == "transfer-map":
            if not isinstance(value, dict):
                ctx.add("KT207", path, f"transfer_map must be a mapping of layer index to device, got {value!r}",
                        "write transfer_map: {30: cuda:1}")
                continue
            for k, dev in value.items():
                if not (isinstance(dev, str) and DEVICE_RE.match(dev)):
                    ctx.add("KT207", path + (str(k),), f"transfer_map[{k}] must be a device, got {dev!r}",
                            "use cpu, cuda:N, xpu or npu")
        else:
            bad = _bad_value(kind, spec, value)
            if bad:
                ctx.add("KT207", path, f"{key} must be {bad}, got {value!r}", f"write {key} as {bad}")


@check("KT212", stage="rule")
def transfer_map_string_keys(ctx, view: RuleView, op) -> None:
    for path, _, value, spec in _given(ctx, view, op):
        if spec is None or spec["type"] != "transfer-map" or not isinstance(value, dict):
            continue
        for k, dev in value.items():
            if isinstance(k, bool) or not isinstance(k, int):
                ctx.add("KT212", path + (str(k),), f"transfer_map key {k!r} is a {type(k).__name__}; upstream tests "
                        "`i in transfer_map` with an int layer index, so this entry never fires",
                        f"write the key unquoted: {k}: {dev}" if isinstance(k, str) and k.strip().isdigit()
                        else "use integer layer indices", key=True)


@check("KT209", stage="rule")
def required_kwarg_missing(ctx, view: RuleView, op) -> None:
    if op is None or not view.has_kwargs:
        return
    for req in op.required_when_kwargs:
        if req not in view.kwargs:
            ctx.add("KT209", view.path + ("replace", "kwargs"),
                    f"{op.short} with kwargs but without {req!r}: upstream raises KeyError: '{req}' when it loads "
                    "the weights", f"add {req}: <device> (and prefill_device)")


@check("KT205", stage="rule")
def op_on_impossible_device(ctx, view: RuleView, op) -> None:
    if op is None:
        return
    kwargs, kp = view.kwargs, view.path + ("replace", "kwargs")
    for slot_name, slot in op.ops.items():
        if slot.unused:
            continue
        value = kwargs.get(slot_name, slot.default)
        if not isinstance(value, str) or value == "None" or value not in ctx.catalog.ops:
            continue
        device = kwargs.get(slot.device_kwarg, slot.default_device)
        if not isinstance(device, str):
            continue
        need = ctx.catalog.ops[value]["device"]
        on_cpu = device.split(":")[0] == "cpu"
        if (need == "cpu" and not on_cpu) or (need == "gpu" and on_cpu):
            where = kp + (slot.device_kwarg,) if slot.device_kwarg in kwargs else kp + (slot_name,)
            where = where if where[-1] in kwargs else kp
            what = "only on cpu" if need == "cpu" else "only on a GPU"
            ctx.add("KT205", where, f"{value} runs {what}, but {slot.device_kwarg} is {device!r}"
                    + (" (the default)" if slot.device_kwarg not in kwargs else "") + "; upstream asserts at load",
                    f"set {slot.device_kwarg}: {'cpu' if need == 'cpu' else 'cuda'}, or choose another {slot_name}")
