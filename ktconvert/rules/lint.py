"""Semantic lint of optimize-rule files: schema, catalog, regex, and (with a module tree) matching checks.

Every check is pure data work over the loaded YAML, the catalog and an optional module tree; nothing a rule
names is imported. Findings carry stable IDs whose severities and documented examples live in
``rules/lint-checks.yaml``.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema

from ktconvert.errors import InputError, UsageProblem
from ktconvert.io.resources import load_schema, schemas_dir
from ktconvert.io import yamlpos
from ktconvert.rules import engine, modeltree, regexlint
from ktconvert.rules.catalog import Catalog, Operator
from ktconvert.rules.findings import Finding, registry, selected

DEVICE_RE = re.compile(r"^(cpu|cuda|xpu|npu|mps)(:[0-9]+)?$")
_BACKEND_COMMENT = re.compile(r"#\s*ktconvert:\s*backend\s*=\s*([A-Za-z_]+)")
YAML_SUFFIXES = (".yaml", ".yml")


@dataclass
class Options:
    backend: str = "auto"
    model: str | None = None
    catalogs: tuple = ()
    select: tuple = ()
    ignore: tuple = ()
    explain: bool = False
    weights: str | None = None


@dataclass
class FileResult:
    path: str
    kind: str = "optimize-rules"
    backend: str | None = None
    backend_source: str | None = None
    rules: int = 0
    findings: list = field(default_factory=list)
    error: str | None = None
    tree: str | None = None
    plan: list | None = None


@dataclass
class Report:
    files: list

    @property
    def findings(self) -> list[Finding]:
        return [f for r in self.files for f in r.findings]

    def count(self, severity: str) -> int:
        return sum(1 for f in self.findings if f.severity == severity)

    def exit_code(self, strict: bool = False) -> int:
        if any(r.error for r in self.files):
            return 3
        if self.count("error") or (strict and self.count("warning")):
            return 1
        return 0


def collect_paths(paths) -> list[Path]:
    """Files as given, directories walked recursively for ``*.yaml``/``*.yml`` (sorted, so output is stable)."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.suffix.lower() in YAML_SUFFIXES and q.is_file())
            if not found:
                raise InputError("directory holds no .yaml or .yml file", path=str(p),
                                 fix="point check-rules at rule files or at a folder of them")
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            raise InputError("no such file or directory", path=str(p))
    return out


def check_paths(paths, options: Options, catalog: Catalog) -> Report:
    files = collect_paths(paths)
    tree, checkpoint = None, None
    if options.weights:
        from ktconvert.formats import open_checkpoint  # numpy and the readers: only on the --weights path

        checkpoint = open_checkpoint(options.weights)
    if options.model:
        cfg, where = modeltree.load_config(options.model)
        tree = modeltree.build_tree(cfg, "model", where)
    elif checkpoint is not None:
        if checkpoint.config is None:
            raise UsageProblem("--weights needs the model's module tree", where="--weights",
                               fix="add --model CONFIG_OR_DIR (no config.json lies next to the weights)")
        tree = modeltree.build_tree(checkpoint.config, "model", f"{options.weights} (config.json)")
    return Report([check_file(p, options, catalog, tree, checkpoint) for p in files])


def check_file(path: Path, options: Options, catalog: Catalog, tree=None, checkpoint=None) -> FileResult:
    result = FileResult(path=str(path))
    try:
        text = yamlpos.read_text(path)
    except InputError as exc:
        result.error = exc.one_line()
        return result
    return check_text(text, str(path), options, catalog, tree, result, checkpoint)


def check_text(text: str, file: str, options: Options, catalog: Catalog, tree=None, result: FileResult | None = None,
               checkpoint=None) -> FileResult:
    result = result or FileResult(path=file)
    ctx = _Ctx(file, text, options, catalog, result)
    ctx.checkpoint = checkpoint
    try:
        ctx.run(tree)
    finally:
        result.findings = sorted((f for f in ctx.findings if selected(f.id, options.select, options.ignore)),
                                 key=lambda f: (f.line, f.col, f.id))
    return result


def _jpath(path: tuple) -> str:
    out = "$"
    for p in path:
        out += f"[{p}]" if str(p).isdigit() else f".{p}"
    return out


def _suggest(word: str, candidates) -> str | None:
    hits = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return hits[0] if hits else None


def _is_none(value) -> bool:
    return value is None or value == "None"


class _Ctx:
    def __init__(self, file, text, options, catalog: Catalog, result: FileResult):
        self.file, self.text, self.options, self.cat, self.result = file, text, options, catalog, result
        self.findings: list[Finding] = []
        self.loaded: yamlpos.Loaded | None = None
        self.checks = registry()
        self.checkpoint = None

    # --- reporting ----------------------------------------------------------------------------------
    def add(self, check_id: str, path: tuple, message: str, fix: str = "", key: bool = False, rule: int | None = None,
            at: tuple[int, int] | None = None) -> None:
        line, col = at or self.loaded.where(path, key=key)
        if rule is None and path and str(path[0]).isdigit():
            rule = int(path[0])
        self.findings.append(Finding(check_id, self.checks[check_id].severity, self.file, line, col, message, fix,
                                     rule, _jpath(path)))

    # --- pipeline -----------------------------------------------------------------------------------
    def run(self, tree) -> None:
        try:
            self.loaded = yamlpos.load_text(self.text, self.file)
        except yamlpos.YamlSyntaxError as exc:
            self.loaded = yamlpos.Loaded(None)
            self.add("KT101", (), f"YAML error: {exc.message}", "fix the YAML syntax at this position", at=(exc.line, exc.col))
            return
        for p in self.loaded.problems:
            self.add(p.code, (), p.message, p.fix, at=(p.line, p.col))
        data = self.loaded.data
        if data is None:
            self.add("KT103", (), "file is empty: a rule file is a YAML list of rules", "add rules, or remove the file", at=(1, 1))
            return
        if isinstance(data, dict) and isinstance(data.get("kind"), str):
            self._check_data_file(data)
            return
        self.result.kind = "optimize-rules"
        if not isinstance(data, list):
            self.add("KT103", (), f"a rule file is a YAML list of rules, found a {type(data).__name__}",
                     "start each rule with '- match:'")
            return
        self.result.rules = len(data)
        self._schema(data)
        self._backend()
        compiled = [self._rule(i, r) for i, r in enumerate(data)]
        usable = [c for c in compiled if c is not None]
        if tree is None:
            family = self._probe_family(data)
            if family:
                tree = modeltree.probe_tree(family)
        if tree is not None:
            self.result.tree = f"{tree.source}:{tree.family}"
            self._tree_checks(data, usable, tree)
            if self.options.explain and tree.source == "model":
                self.result.plan = plan_rows(usable, self.cat, tree)
            if self.checkpoint is not None:
                from ktconvert.rules.weights import check_weights

                check_weights(self, usable, tree, self.checkpoint, self.cat)
        else:
            self._pair_contracts_statically(data)

    # --- data files carrying `kind:` ----------------------------------------------------------------
    def _check_data_file(self, data: dict) -> None:
        kind = data["kind"]
        self.result.kind = kind
        if not (schemas_dir() / f"{kind}.schema.json").is_file():
            self.add("KT103", ("kind",), f"unknown kind {kind!r}: no schema for it",
                     "a rule file is a YAML list; ktconvert data files name a kind that has a schema in schemas/")
            return
        validator = jsonschema.Draft202012Validator(load_schema(kind))
        for err in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
            self.add("KT103", tuple(str(p) for p in err.absolute_path), f"{kind}: {err.message}",
                     f"see schemas/{kind}.schema.json")

    # --- schema -------------------------------------------------------------------------------------
    def _schema(self, data: list) -> None:
        validator = jsonschema.Draft202012Validator(load_schema("optimize-rules"))
        for err in validator.iter_errors(data):
            path = tuple(str(p) for p in err.absolute_path)
            if err.validator == "additionalProperties":
                extra = [k for k in err.instance if k not in err.schema.get("properties", {})]
                for k in extra:
                    where = path + (str(k),)
                    if path[1:] == ("replace",) and k == "device":
                        self.add("KT104", where, "replace.device is ignored upstream (the line that read it is commented out)",
                                 "set kwargs.generate_device and kwargs.prefill_device instead", key=True)
                        continue
                    known = list(err.schema.get("properties", {}))
                    hint = _suggest(str(k), known)
                    self.add("KT104", where, f"key {k!r} is ignored upstream" + (f"; did you mean {hint!r}?" if hint else ""),
                             f"use one of: {', '.join(known)}", key=True)
            elif path and path[-1] == "recursive" and err.validator == "type":
                v = err.instance
                truth = "true" if bool(v) else "false"
                self.add("KT105", path, f"recursive is {v!r}, not a boolean; upstream applies bool() so it means {truth}",
                         "write recursive: false (no quotes)")
            else:
                self.add("KT103", path, _schema_message(err), _schema_fix(err, path))

    # --- backend ------------------------------------------------------------------------------------
    def _backend(self) -> None:
        opt = self.options.backend
        if opt and opt != "auto":
            backend, source = opt, "option"
        else:
            m = _BACKEND_COMMENT.search(self.text)
            if m:
                backend, source = m.group(1), "comment"
                if backend not in self.cat.backends:
                    line = self.text[: m.start()].count("\n") + 1
                    self.add("KT103", (), f"backend comment names {backend!r}, not a known backend",
                             f"use one of: {', '.join(self.cat.backends)}", at=(line, 1))
                    backend = None
            else:
                backend = "balance_serve" if "serve" in Path(self.file).name else "ktransformers"
                source = "file-name"
        self.result.backend, self.result.backend_source = backend, source

    # --- one rule -----------------------------------------------------------------------------------
    def _rule(self, i: int, rule) -> engine.CompiledRule | None:
        if not isinstance(rule, dict):
            return None
        match = rule.get("match") if isinstance(rule.get("match"), dict) else {}
        replace = rule.get("replace") if isinstance(rule.get("replace"), dict) else {}
        rp = (str(i),)
        name_re = None
        name = match.get("name")
        if isinstance(name, str):
            try:
                name_re = re.compile(name)
            except re.error as exc:
                self.add("KT301", rp + ("match", "name"), f"regex does not compile: {exc.msg} at offset {exc.pos}",
                         "fix the pattern (remember YAML double quotes need \\\\. for a literal dot)")
                return None
            self._regex_style(rp + ("match", "name"), name)
        class_type, class_known = None, True
        cls = match.get("class")
        if isinstance(cls, str):
            class_type = self.cat.type_of_class(cls)
            if class_type is None:
                class_known = False
                if cls in self.cat.operators or cls in self.cat.op_classes:
                    self.add("KT213", rp + ("match", "class"),
                             f"match.class names the operator {cls.rsplit('.', 1)[-1]}; matching runs on the original model "
                             "before injection, so this rule never matches",
                             "match the original model class (e.g. ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE) or a name")
                else:
                    hint = _suggest(cls, self.cat.alias_to_type)
                    self.add("KT211", rp + ("match", "class"),
                             f"match.class {cls!r} is not a module class the catalog knows; its matches are not checked"
                             + (f"; did you mean {hint!r}?" if hint else ""),
                             "use a known class path, or add the module type to a --catalog file")
        rclass = replace.get("class", "default")
        kwargs = replace.get("kwargs")
        kwargs = kwargs if isinstance(kwargs, dict) else {}
        recursive = bool(rule["recursive"]) if "recursive" in rule else True
        op = self._operator(rp, rclass, kwargs, "kwargs" in replace)
        compiled = engine.CompiledRule(i, name_re, class_type, class_known, rclass if isinstance(rclass, str) else "default",
                                       kwargs, recursive)
        compiled.operator = op  # type: ignore[attr-defined]
        return compiled

    def _regex_style(self, path: tuple, pattern: str) -> None:
        dots = regexlint.unescaped_dots(pattern)
        if dots:
            at = dots[0]
            fixed = pattern[:at] + "\\\\." + pattern[at + 1:]
            self.add("KT302", path, f"unescaped '.' at offset {at} of {pattern!r} matches any character",
                     f'escape it; inside YAML double quotes write "{fixed}"')
        loose = regexlint.unanchored_alternatives(pattern)
        if loose:
            self.add("KT303", path, f"pattern part {loose[0]!r} is unanchored; re.search matches it anywhere in the module path",
                     "anchor it with ^...$ (or at least one end)")

    def _operator(self, rp: tuple, rclass, kwargs: dict, has_kwargs: bool) -> Operator | None:
        if not isinstance(rclass, str):
            return None
        op = self.cat.operators.get(rclass)
        cp = rp + ("replace", "class")
        if op is None:
            short = rclass.rsplit(".", 1)[-1]
            same_short = [p for p in self.cat.operators if p.rsplit(".", 1)[-1] == short]
            hint = same_short[0] if same_short else _suggest(rclass, self.cat.operators)
            extra = ""
            if rclass in self.cat.op_classes:
                extra = f"; {short} is an op, selected through generate_op/prefill_op of a wrapper"
            self.add("KT201", cp, f"unknown operator class {rclass!r}" + (f"; did you mean {hint!r}?" if hint else "") + extra,
                     "use an operator from the catalog (ktconvert check-rules --list-checks explains; --catalog adds your own)")
            return None
        backend = self.result.backend
        contract_issue = False
        if backend and op.role in ("norm", "mlp"):
            caller = self.cat.backends.get(backend, {}).get("contract")
            if caller and op.contract not in ("any", caller):
                contract_issue = True
                self.add("KT204", cp, _contract_msg(op, caller, f"the {backend} decoder layer"),
                         _contract_fix(op, caller))
        if backend and not contract_issue and backend not in op.backends:
            self.add("KT203", cp, f"{op.short} works under {', '.join(op.backends)}, not under the {backend} backend"
                     f" (backend from {self.result.backend_source})",
                     _backend_fix(self.cat, op, backend))
        self._kwargs(rp, op, kwargs, has_kwargs)
        return op

    # --- kwargs -------------------------------------------------------------------------------------
    def _kwargs(self, rp: tuple, op: Operator, kwargs: dict, has_kwargs: bool) -> None:
        kp = rp + ("replace", "kwargs")
        selected_ops = {}
        for slot_name, slot in op.ops.items():
            value = kwargs.get(slot_name, slot.default)
            selected_ops[slot_name] = value
        allowed = dict(op.kwargs)
        for slot_name in op.ops:
            allowed[slot_name] = {"type": "op"}
        for value in selected_ops.values():
            if isinstance(value, str):
                allowed.update(self.cat.op_kwargs(value))
        for key, value in kwargs.items():
            path = kp + (str(key),)
            spec = allowed.get(key)
            if spec is None:
                hint = _suggest(str(key), allowed) or _suggest(str(key), self.cat.all_kwarg_names)
                known_elsewhere = key in self.cat.all_kwarg_names
                why = (f"{op.short} (with its selected ops) does not take {key!r}" if known_elsewhere
                       else f"unknown kwarg {key!r} for {op.short}")
                self.add("KT206", path, why + (f"; did you mean {hint!r}?" if hint and hint != key else "") +
                         "; upstream passes it on verbatim, where it is ignored or raises TypeError at load",
                         f"remove it, or use one of: {', '.join(sorted(allowed))}", key=True)
                continue
            if spec.get("type") == "op":
                self._op_value(path, op, op.ops[key], value, kwargs)
            else:
                self._value(path, key, spec, value)
        if has_kwargs:
            for req in op.required_when_kwargs:
                if req not in kwargs:
                    self.add("KT209", kp, f"{op.short} with kwargs but without {req!r}: upstream raises KeyError: '{req}' when it loads the weights",
                             f"add {req}: <device> (and prefill_device)")
        for slot_name, slot in op.ops.items():
            if slot.unused:
                continue
            value = kwargs.get(slot_name, slot.default)
            if not isinstance(value, str) or value == "None" or value not in self.cat.ops:
                continue
            device = kwargs.get(slot.device_kwarg, slot.default_device)
            if not isinstance(device, str):
                continue
            need = self.cat.ops[value]["device"]
            on_cpu = device.split(":")[0] == "cpu"
            if (need == "cpu" and not on_cpu) or (need == "gpu" and on_cpu):
                where = kp + (slot.device_kwarg,) if slot.device_kwarg in kwargs else kp + (slot_name,)
                where = where if where[-1] in kwargs else kp
                what = "only on cpu" if need == "cpu" else "only on a GPU"
                self.add("KT205", where, f"{value} runs {what}, but {slot.device_kwarg} is {device!r}"
                         + (" (the default)" if slot.device_kwarg not in kwargs else "") + "; upstream asserts at load",
                         f"set {slot.device_kwarg}: {'cpu' if need == 'cpu' else 'cuda'}, or choose another {slot_name}")

    def _op_value(self, path, op: Operator, slot, value, kwargs) -> None:
        if _is_none(value):
            if slot.unused or value in op.none_ok:
                return
            spelled = "the string 'None'" if value == "None" else "null"
            self.add("KT208", path, f"{slot.name}: {spelled} disables the op, which {op.short} cannot take"
                     + (f": {op.none_note}" if op.none_note else ""),
                     f"name an op ({', '.join(self.cat.ops_of_kind(slot.kind))})"
                     + ("" if not op.none_ok else f", or write {'null' if None in op.none_ok else repr('None')}"))
            return
        if not isinstance(value, str):
            self.add("KT207", path, f"{slot.name} must be an op name, got {value!r}",
                     f"use one of: {', '.join(self.cat.ops_of_kind(slot.kind))}")
            return
        if value not in self.cat.ops or self.cat.ops[value]["kind"] != slot.kind:
            choices = self.cat.ops_of_kind(slot.kind)
            other = f"; {value} is a {self.cat.ops[value]['kind']} op" if value in self.cat.ops else ""
            hint = _suggest(value, choices)
            self.add("KT202", path, f"unknown {slot.kind} op {value!r} for {slot.name}{other}"
                     + (f"; did you mean {hint!r}?" if hint else "") + " (upstream raises KeyError at load)",
                     f"use one of: {', '.join(choices)}")

    def _value(self, path, key, spec: dict, value) -> None:
        kind = spec["type"]
        bad = None
        if kind == "device":
            if not (isinstance(value, str) and DEVICE_RE.match(value)):
                bad = "a device like cpu, cuda, cuda:1, xpu or npu:0"
        elif kind == "bool":
            if not isinstance(value, bool):
                bad = "true or false"
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int) or value < spec.get("min", value):
                bad = "an integer" + (f" >= {spec['min']}" if "min" in spec else "")
        elif kind == "string":
            if not isinstance(value, str):
                bad = "a string"
        elif kind == "enum":
            if value not in spec["values"]:
                hint = _suggest(str(value), [str(v) for v in spec["values"]])
                self.add("KT207", path, f"{key}: {value!r} is not one of {', '.join(map(str, spec['values']))}"
                         + (f"; did you mean {hint!r}?" if hint else ""), f"use one of: {', '.join(map(str, spec['values']))}")
                return
        elif kind == "int-list":
            if not (isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
                bad = "a list of integers"
        elif kind == "transfer-map":
            self._transfer_map(path, value)
            return
        if bad:
            self.add("KT207", path, f"{key} must be {bad}, got {value!r}", f"write {key} as {bad}")

    def _transfer_map(self, path, value) -> None:
        if not isinstance(value, dict):
            self.add("KT207", path, f"transfer_map must be a mapping of layer index to device, got {value!r}",
                     "write transfer_map: {30: cuda:1}")
            return
        for k, dev in value.items():
            kp = path + (str(k),)
            if isinstance(k, bool) or not isinstance(k, int):
                self.add("KT212", kp, f"transfer_map key {k!r} is a {type(k).__name__}; upstream tests `i in transfer_map` "
                         "with an int layer index, so this entry never fires", f"write the key unquoted: {k}: {dev}"
                         if isinstance(k, str) and k.strip().isdigit() else "use integer layer indices", key=True)
            if not (isinstance(dev, str) and DEVICE_RE.match(dev)):
                self.add("KT207", kp, f"transfer_map[{k}] must be a device, got {dev!r}", "use cpu, cuda:N, xpu or npu")

    # --- module tree --------------------------------------------------------------------------------
    def _probe_family(self, data: list) -> str | None:
        families = set()
        for rule in data:
            match = rule.get("match") if isinstance(rule, dict) else None
            cls = match.get("class") if isinstance(match, dict) else None
            t = self.cat.type_of_class(cls) if isinstance(cls, str) else None
            # rotary classes are shared across families upstream (Qwen3 files match Qwen2MoeRotaryEmbedding)
            fam = modeltree.family_of_type(t) if t and self.cat.role_of(t) != "rope" else None
            if fam:
                families.add(fam)
        return families.pop() if len(families) == 1 else None

    def _tree_checks(self, data: list, rules: list, tree: modeltree.ModelTree) -> None:
        is_inst = self.cat.is_instance
        assigned = engine.resolve(tree.root, rules, is_inst, tree.search_cache)
        by_rule: dict[int, list] = {}
        for a in assigned:
            if a.rule is not None:
                by_rule.setdefault(a.rule.index, []).append(a)
        parent_of = tree.parent
        assignment_of = {a.path: a for a in assigned}
        for rule in rules:
            op = getattr(rule, "operator", None)
            hits = by_rule.get(rule.index, [])
            rp = (str(rule.index),)
            if not hits:
                self._unused_rule(rule, tree, assignment_of)
                continue
            if op is None:
                continue
            # operator vs module type
            wrong = [a for a in hits if not self.cat.may_replace(op, a.module_type)]
            if wrong:
                dense = [a for a in wrong if a.node.dense and op.role in ("moe-block", "experts")]
                first = (dense or wrong)[0]
                if dense:
                    self.add("KT402", rp + ("match",), f"{op.short} is applied to {first.path} ({first.module_type}), the "
                             f"dense MLP of layer {first.node.layer}; dense layers ({_ranges(tree.dense_layers)}) have no experts",
                             "restrict the pattern to MoE layers (or add the class of the MoE block to match)")
                else:
                    self.add("KT210", rp + ("match",), f"{op.short} cannot replace {first.path} ({first.module_type}, role "
                             f"{self.cat.role_of(first.module_type)}); it replaces {', '.join(op.replaces)}"
                             + (f" ({len(wrong)} modules in all)" if len(wrong) > 1 else ""),
                             "narrow match.name or add match.class so only the intended modules match")
            # MoE block -> experts contract
            if op.role == "experts":
                for a in hits:
                    parent = parent_of.get(a.path)
                    pa = assignment_of.get(parent.path) if parent else None
                    pop = getattr(pa.rule, "operator", None) if pa and pa.rule else None
                    if pop is None or "experts" not in pop.calls:
                        continue
                    want = pop.calls["experts"]
                    if op.contract not in ("any", want):
                        self.add("KT204", rp + ("replace", "class"), _contract_msg(op, want, f"{pop.short} (rule {pa.rule.index}) at {parent.path}"),
                                 _contract_fix(op, want))
                        break
        if tree.source == "model":
            self._transfer_map_range(data, tree)

    def _unused_rule(self, rule, tree, assignment_of) -> None:
        rp = (str(rule.index),)
        shadowing: dict[int, int] = {}
        hidden: set[int] = set()
        for node in tree.nodes:
            if not engine.rule_matches(rule, node.path, node.type, self.cat.is_instance):
                continue
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
            self.add("KT304", rp + ("match",), f"rule {rule.index} never applies: every module it matches is taken first by "
                     f"rule {by}" + (f" (and {len(shadowing) - 1} more)" if len(shadowing) > 1 else ""),
                     "move it before the earlier rule, narrow the earlier rule, or delete it")
        elif hidden:
            owners = ", ".join(str(i) for i in sorted(hidden))
            self.add("KT304", rp + ("match",), f"rule {rule.index} never applies: the modules it matches sit under modules "
                     f"taken by rule {owners} with recursive: false, which are never descended",
                     "delete it, or drop recursive: false from that rule")
        elif tree.source == "model" and rule.class_known:
            self.add("KT401", rp + ("match",), f"rule {rule.index} matches no module of the {tree.family} model "
                     f"({tree.num_layers} layers)", "check the pattern against `ktconvert check-rules --explain --model ...`")

    def _transfer_map_range(self, data, tree) -> None:
        for i, rule in enumerate(data):
            kwargs = (rule.get("replace") or {}).get("kwargs") if isinstance(rule, dict) and isinstance(rule.get("replace"), dict) else None
            tm = kwargs.get("transfer_map") if isinstance(kwargs, dict) else None
            if not isinstance(tm, dict):
                continue
            for k in tm:
                if isinstance(k, int) and not isinstance(k, bool) and not 0 <= k < tree.num_layers:
                    self.add("KT403", (str(i), "replace", "kwargs", "transfer_map", str(k)),
                             f"transfer_map layer {k} is out of range: the model has layers 0..{tree.num_layers - 1}",
                             "use a layer index the model has", key=True)

    def _pair_contracts_statically(self, data: list) -> None:
        """Without a tree, pair every MoE-block operator in the file with every experts wrapper in it."""
        blocks, wrappers = [], []
        for i, rule in enumerate(data):
            replace = rule.get("replace") if isinstance(rule, dict) else None
            cls = replace.get("class") if isinstance(replace, dict) else None
            op = self.cat.operators.get(cls) if isinstance(cls, str) else None
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
                    self.add("KT204", (str(wi), "replace", "class"), _contract_msg(wop, want, f"{bop.short} (rule {bi})"),
                             _contract_fix(wop, want))
                    break

    # --- explain ------------------------------------------------------------------------------------
def compile_rules(rules_data: list, catalog: Catalog, file: str = "<rules>") -> list[engine.CompiledRule]:
    """The rules of an already checked file, compiled for ``engine.resolve`` (rules too broken to compile are left out)."""
    ctx = _Ctx(file, "", Options(), catalog, FileResult(file))
    ctx.loaded = yamlpos.Loaded(rules_data)
    return [c for c in (ctx._rule(i, r) for i, r in enumerate(rules_data)) if c is not None]


def explain_plan(rules_data: list, catalog: Catalog, tree: modeltree.ModelTree) -> list[dict]:
    """The resolved injection plan of a rule file's data (see ``plan_rows``)."""
    return plan_rows(compile_rules(rules_data, catalog, "<explain>"), catalog, tree)


def plan_rows(compiled: list[engine.CompiledRule], catalog: Catalog, tree: modeltree.ModelTree) -> list[dict]:
    """One row per visited module (what upstream's gen_optimize_config produces): rule, operator, devices, ops."""
    rows = []
    for a in engine.resolve(tree.root, compiled, catalog.is_instance):
        if a.path == "":
            continue
        rule = a.rule
        kwargs = rule.kwargs if rule else {"generate_device": "cuda:0", "prefill_device": "cuda:0"}
        op = catalog.operators.get(rule.replace_class) if rule else None
        ops = {}
        if op:
            for slot_name, slot in op.ops.items():
                if not slot.unused:
                    ops[slot_name] = kwargs.get(slot_name, slot.default)
        rows.append({
            "module": a.path, "type": a.module_type, "rule": rule.index if rule else None,
            "operator": (rule.replace_class.rsplit(".", 1)[-1] if rule else "default"),
            "generate_device": kwargs.get("generate_device", "cuda" if op and op.role != "keep" else None),
            "prefill_device": kwargs.get("prefill_device", "cuda" if op and op.role != "keep" else None),
            "ops": ops, "recursive": rule.recursive if rule else True,
        })
    return rows


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


def _contract_msg(op: Operator, caller_contract: str, caller: str) -> str:
    style = {"hf": "without bsz_tensor (HF-style call)", "serve": "with (bsz_tensor, cuda_graph_idx)"}[caller_contract]
    needs = {"hf": "takes only the HF-style arguments", "serve": "needs bsz_tensor and cuda_graph_idx"}[op.contract]
    return f"forward contract mismatch: {caller} calls it {style}, but {op.short} {needs}"


def _contract_fix(op: Operator, want: str) -> str:
    if op.role == "experts":
        return ("use KTransformersExperts (V1) under a V1 MoE block" if want == "hf"
                else "use KTransformersExpertsV2 under a V2 MoE block")
    return "use the operator made for this backend, or switch --backend"


def _backend_fix(cat: Catalog, op: Operator, backend: str) -> str:
    for path, other in cat.operators.items():
        if other.role == op.role and backend in other.backends and path != op.path and set(op.replaces) & set(other.replaces):
            return f"under {backend} use e.g. {other.short}, or name the backend (--backend or '# ktconvert: backend=...')"
    return "use an operator made for this backend, or name the backend (--backend or '# ktconvert: backend=...')"


def _schema_message(err) -> str:
    if err.validator == "required":
        missing = [r for r in err.validator_value if r not in (err.instance or {})]
        return f"missing {', '.join(repr(m) for m in missing)}"
    if err.validator == "anyOf" and list(err.absolute_path)[-1:] == ["match"]:
        return "match needs at least one of 'name' and 'class' (upstream raises an Exception)"
    if err.validator == "type":
        return f"{err.instance!r} is not of type {err.validator_value}"
    return err.message


def _schema_fix(err, path) -> str:
    if err.validator == "required" and "replace" in err.validator_value:
        return "add replace: {class: default} or an operator class"
    if err.validator == "required" and "match" in err.validator_value:
        return "add match: {name: '^model\\\\.layers\\\\..*$'} (a regex) and/or class"
    if path and path[-1] == "kwargs":
        return "kwargs is a mapping of keyword arguments (remove the key if there are none)"
    return "see schemas/optimize-rules.schema.json"
