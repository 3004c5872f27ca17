"""Checks that need the module tree (``--model`` or a probe tree): what each rule really matches (KT210, KT402,
KT204 between a MoE block and its experts), rules that never apply (KT304, KT401), transfer_map layers (KT403);
and, without a tree, the MoE-block / experts contract paired statically (KT204)."""

from __future__ import annotations

from ktconvert.rules import engine
from ktconvert.rules.checks import check
from ktconvert.rules.checks.rule import add_other_backend, backend_contract_mismatch
from ktconvert.rules.contracts import contract_fix, contract_msg


def _hits(rules, assigned) -> dict[int, list]:
    by_rule: dict[int, list] = {}
    for a in assigned:
        if a.rule is not None:
            by_rule.setdefault(a.rule.index, []).append(a)
    return by_rule


@check("KT210", "KT402", stage="tree")
def operator_cannot_replace_module(ctx, data, rules, tree, assigned) -> None:
    """An operator applied to a module it cannot replace; KT402 when that module is a dense layer's MLP."""
    cat = ctx.catalog
    by_rule = _hits(rules, assigned)
    for rule in rules:
        op = getattr(rule, "operator", None)
        hits = by_rule.get(rule.index, [])
        if op is None or not hits:
            continue
        wrong = [a for a in hits if not cat.may_replace(op, a.module_type)]
        if not wrong:
            continue
        dense = [a for a in wrong if a.node.dense and op.role in ("moe-block", "experts")]
        first = (dense or wrong)[0]
        rp = (str(rule.index), "match")
        if dense:
            ctx.add("KT402", rp, f"{op.short} is applied to {first.path} ({first.module_type}), the dense MLP of layer "
                    f"{first.node.layer}; dense layers ({_ranges(tree.dense_layers)}) have no experts",
                    "restrict the pattern to MoE layers (or add the class of the MoE block to match)")
        else:
            ctx.add("KT210", rp, f"{op.short} cannot replace {first.path} ({first.module_type}, role "
                    f"{cat.role_of(first.module_type)}); it replaces {', '.join(op.replaces)}"
                    + (f" ({len(wrong)} modules in all)" if len(wrong) > 1 else ""),
                    "narrow match.name or add match.class so only the intended modules match")


@check("KT204", stage="tree")
def experts_contract_of_moe_block(ctx, data, rules, tree, assigned) -> None:
    """The experts wrapper a rule applies must take the call its parent MoE block's operator makes."""
    by_rule = _hits(rules, assigned)
    assignment_of = {a.path: a for a in assigned}
    for rule in rules:
        op = getattr(rule, "operator", None)
        if op is None or op.role != "experts":
            continue
        for a in by_rule.get(rule.index, []):
            parent = tree.parent.get(a.path)
            pa = assignment_of.get(parent.path) if parent else None
            pop = getattr(pa.rule, "operator", None) if pa and pa.rule else None
            if pop is None or "experts" not in pop.calls:
                continue
            want = pop.calls["experts"]
            if op.contract not in ("any", want):
                ctx.add("KT204", (str(rule.index), "replace", "class"),
                        contract_msg(op, want, f"{pop.short} (rule {pa.rule.index}) at {parent.path}"), contract_fix(op, want))
                break


def _mlp_caller(ctx, tree, assignment_of, path: str, op) -> tuple[str, str] | None:
    """``(contract, caller)`` the MLP at ``path`` is called with: a dense layer's MLP by the backend's decoder layer,
    a shared expert by its MoE block (the block's operator's ``calls.mlp``; the model's own block calls it HF-style).
    None where the caller is not known (e.g. an expert inside an experts list)."""
    parent = tree.parent.get(path)
    role = ctx.catalog.role_of(parent.type) if parent is not None else None
    if role == "decoder-layer":
        backend = ctx.result.backend
        want = ctx.catalog.decoder_contract(backend, op)
        return (want, f"the {backend} decoder layer") if want else None
    if role != "moe-block":
        return None
    pa = assignment_of.get(parent.path)
    pop = getattr(pa.rule, "operator", None) if pa is not None and pa.rule is not None else None
    if pop is not None and pop.role == "moe-block":
        want = pop.calls.get("mlp")
        return (want, f"{pop.short} (rule {pa.rule.index}) at {parent.path}") if want else None
    return "hf", f"the model's own {parent.type} at {parent.path}"


@check("KT204", "KT203", stage="tree")
def mlp_caller_contract(ctx, data, rules, tree, assigned) -> None:
    """An MLP operator must take the call its real caller makes: the decoder layer for a dense layer's MLP, the
    MoE block's operator for a shared expert (KT204). An MLP operator of another backend whose every call fits is
    still reported as such (KT203, which the rule stage leaves to this check)."""
    by_rule = _hits(rules, assigned)
    assignment_of = {a.path: a for a in assigned}
    for rule in rules:
        op = getattr(rule, "operator", None)
        if op is None or op.role != "mlp":
            continue
        for a in by_rule.get(rule.index, []):
            caller = _mlp_caller(ctx, tree, assignment_of, a.path, op)
            if caller and op.contract not in ("any", caller[0]):
                ctx.add("KT204", (str(rule.index), "replace", "class"), contract_msg(op, caller[0], caller[1]),
                        contract_fix(op, caller[0]))
                break
        else:
            backend = ctx.result.backend
            if backend and backend not in op.backends and backend_contract_mismatch(ctx, op):
                add_other_backend(ctx, (str(rule.index),), op)


@check("KT304", "KT401", stage="tree")
def rule_never_applies(ctx, data, rules, tree, assigned) -> None:
    """A rule that matches nothing: shadowed by an earlier rule or hidden under ``recursive: false`` (KT304), or
    matching no module of the model at all (KT401, only against a real ``--model``)."""
    by_rule = _hits(rules, assigned)
    assignment_of = {a.path: a for a in assigned}
    types = {node.type for node in tree.nodes}  # the class test depends on the module type only: once per type
    for rule in rules:
        if by_rule.get(rule.index):
            continue
        rp = (str(rule.index), "match")
        shadowing: dict[int, int] = {}
        hidden: set[int] = set()
        ok = {t for t in types if engine.class_ok(rule, t, ctx.catalog.is_instance)}
        matched = (node for node in tree.nodes  # in tree order, as upstream visits them
                   if node.type in ok and (rule.name is None or rule.name.search(node.path) is not None))
        for node in matched:
            a = assignment_of.get(node.path)
            if a is None:
                up = tree.parent.get(node.path)
                while up is not None and up.path not in assignment_of:
                    up = tree.parent.get(up.path)
                owner = assignment_of.get(up.path) if up is not None else None
                if owner is not None and owner.rule is not None:
                    hidden.add(owner.rule.index)
            elif a.rule is not None:
                shadowing[a.rule.index] = shadowing.get(a.rule.index, 0) + 1
        if shadowing:
            by = max(shadowing, key=shadowing.get)
            ctx.add("KT304", rp, f"rule {rule.index} never applies: every module it matches is taken first by "
                    f"rule {by}" + (f" (and {len(shadowing) - 1} more)" if len(shadowing) > 1 else ""),
                    "move it before the earlier rule, narrow the earlier rule, or delete it")
        elif hidden:
            owners = ", ".join(str(i) for i in sorted(hidden))
            ctx.add("KT304", rp, f"rule {rule.index} never applies: the modules it matches sit under modules "
                    f"taken by rule {owners} with recursive: false, which are never descended",
                    "delete it, or drop recursive: false from that rule")
        elif tree.source == "model" and rule.class_known:
            ctx.add("KT401", rp, f"rule {rule.index} matches no module of the {tree.family} model "
                    f"({tree.num_layers} layers)", "check the pattern against `ktconvert check-rules --explain --model ...`")


@check("KT403", stage="tree")
def transfer_map_layer_out_of_range(ctx, data, rules, tree, assigned) -> None:
    if tree.source != "model":
        return
    for i, rule in enumerate(data):
        replace = rule.get("replace") if isinstance(rule, dict) else None
        kwargs = replace.get("kwargs") if isinstance(replace, dict) else None
        tm = kwargs.get("transfer_map") if isinstance(kwargs, dict) else None
        if not isinstance(tm, dict):
            continue
        for k in tm:
            if isinstance(k, int) and not isinstance(k, bool) and not 0 <= k < tree.num_layers:
                ctx.add("KT403", (str(i), "replace", "kwargs", "transfer_map", str(k)),
                        f"transfer_map layer {k} is out of range: the model has layers 0..{tree.num_layers - 1}",
                        "use a layer index the model has", key=True)


@check("KT204", stage="static")
def experts_contract_paired_statically(ctx, data) -> None:
    """Without a tree, pair every MoE-block operator in the file with every experts wrapper in it."""
    blocks, wrappers = [], []
    for i, rule in enumerate(data):
        replace = rule.get("replace") if isinstance(rule, dict) else None
        cls = replace.get("class") if isinstance(replace, dict) else None
        op = ctx.catalog.operators.get(cls) if isinstance(cls, str) else None
        if op is None:
            continue
        if "experts" in op.calls:
            blocks.append((i, op))
        if op.role == "experts":
            wrappers.append((i, op))
    for wi, wop in wrappers:
        for bi, bop in blocks:
            want = bop.calls["experts"]
            if wop.contract not in ("any", want):
                ctx.add("KT204", (str(wi), "replace", "class"), contract_msg(wop, want, f"{bop.short} (rule {bi})"),
                        contract_fix(wop, want))
                break


@check("KT204", stage="static")
def mlp_contract_statically(ctx, data) -> None:
    """Without a tree an MLP operator's caller is not known; the backend's decoder layer is assumed (it calls every
    dense MLP), as for a norm."""
    for i, rule in enumerate(data):
        replace = rule.get("replace") if isinstance(rule, dict) else None
        cls = replace.get("class") if isinstance(replace, dict) else None
        op = ctx.catalog.operators.get(cls) if isinstance(cls, str) else None
        caller = backend_contract_mismatch(ctx, op) if op is not None and op.role == "mlp" else None
        if caller:
            ctx.add("KT204", (str(i), "replace", "class"),
                    contract_msg(op, caller, f"the {ctx.result.backend} decoder layer"), contract_fix(op, caller))


def _ranges(values: list[int]) -> str:
    if not values:
        return "none"
    out, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(out)
