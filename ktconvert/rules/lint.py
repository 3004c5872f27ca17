"""Semantic lint of optimize-rule files: load with positions, then run the registered checks stage by stage.

The checks themselves live in :mod:`ktconvert.rules.checks`, one function per check; this module only loads a
file, builds the data they read (:class:`LintContext`, the compiled rules, the module tree and the matching) and
collects findings. Every check is pure data work; nothing a rule names is imported. Findings carry stable IDs
whose severities and documented examples live in ``rules/lint-checks.yaml``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path

from ktconvert.diagnostics import Diagnostic
from ktconvert.errors import InputError, UsageProblem
from ktconvert.io import yamlpos
from ktconvert.io.datafile import schema_errors
from ktconvert.rules import checks, engine, modeltree
from ktconvert.rules.catalog import Catalog
from ktconvert.rules.compile import compile_rules, compile_views, operator_of, view_rules
from ktconvert.rules.findings import registry, selected

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
    data: list | None = field(default=None, repr=False)  # the rule list as loaded (what compile_rules takes)


@dataclass
class Report:
    files: list

    @property
    def findings(self) -> list[Diagnostic]:
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
            raise InputError("no such file or directory", path=str(p), fix="check the path")
    return out


def check_paths(paths, options: Options, catalog: Catalog) -> Report:
    files = collect_paths(paths)
    tree, checkpoint = None, None
    if options.weights:
        formats = import_module("ktconvert.formats")  # numpy and the readers: only on the --weights path
        checkpoint = formats.open_checkpoint(options.weights)
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
    ctx = LintContext(file, text, options, catalog, result)
    ctx.checkpoint = checkpoint
    try:
        _lint(ctx, tree)
    finally:
        result.findings = sorted((f for f in ctx.findings if selected(f.id, options.select, options.ignore)),
                                 key=lambda f: (f.line, f.col, f.id))
    return result


def _jpath(path: tuple) -> str:
    out = "$"
    for p in path:
        out += f"[{p}]" if str(p).isdigit() else f".{p}"
    return out


class LintContext:
    """What the checks of one file read, and the findings they add: data only, no checking logic."""

    def __init__(self, file: str, text: str, options: Options, catalog: Catalog, result: FileResult):
        self.file, self.text, self.options, self.catalog, self.result = file, text, options, catalog, result
        self.findings: list[Diagnostic] = []
        self.loaded: yamlpos.Loaded = yamlpos.Loaded(None)
        self.schema_errors: list = []
        self.syntax_error: yamlpos.YamlSyntaxError | None = None
        self.backend_comment: tuple[int, str] | None = None  # (line, name) of a '# ktconvert: backend=' comment
        self.checkpoint = None
        self._registry = registry()

    def add(self, check_id: str, path: tuple, message: str, fix: str = "", key: bool = False, rule: int | None = None,
            at: tuple[int, int] | None = None) -> None:
        line, col = at or self.loaded.where(path, key=key)
        if rule is None and path and str(path[0]).isdigit():
            rule = int(path[0])
        self.findings.append(Diagnostic(check_id, self._registry[check_id].severity, message, fix, self.file, line, col,
                                        {"rule_index": rule, "path": _jpath(path)}))


def _run(stage: str, ctx: LintContext, *args) -> None:
    for c in checks.checks(stage):
        c.fn(ctx, *args)


def _resolve_backend(ctx: LintContext) -> None:
    """The backend a file is written for: ``--backend``, else its ``# ktconvert: backend=`` comment, else its name."""
    opt = ctx.options.backend
    if opt and opt != "auto":
        backend, source = opt, "option"
    elif m := _BACKEND_COMMENT.search(ctx.text):
        backend, source = m.group(1), "comment"
        ctx.backend_comment = (ctx.text[: m.start()].count("\n") + 1, backend)
        if backend not in ctx.catalog.backends:
            backend = None
    else:
        backend = "balance_serve" if "serve" in Path(ctx.file).name else "ktransformers"
        source = "file-name"
    ctx.result.backend, ctx.result.backend_source = backend, source


def _lint(ctx: LintContext, tree) -> None:
    try:
        ctx.loaded = yamlpos.load_text(ctx.text, ctx.file)
    except yamlpos.YamlSyntaxError as exc:
        ctx.syntax_error = exc
    _run("load", ctx)
    if ctx.syntax_error is not None:
        return
    data = ctx.loaded.data
    if data is None:
        ctx.add("KT103", (), "file is empty: a rule file is a YAML list of rules", "add rules, or remove the file", at=(1, 1))
        return
    if isinstance(data, dict) and isinstance(data.get("kind"), str):
        ctx.result.kind = data["kind"]
        _run("data-file", ctx, data)
        return
    if not isinstance(data, list):
        ctx.add("KT103", (), f"a rule file is a YAML list of rules, found a {type(data).__name__}",
                "start each rule with '- match:'")
        return
    ctx.result.rules = len(data)
    ctx.schema_errors = schema_errors(data, "optimize-rules")
    _resolve_backend(ctx)
    _run("document", ctx, data)
    views = view_rules(data)  # once: the rule checks and the compiled rules share them
    for view in views:
        op = operator_of(view, ctx.catalog)
        for c in checks.checks("rule"):
            if view.regex_error is None or "KT301" in c.ids:  # a rule whose regex fails: upstream stops there
                c.fn(ctx, view, op)
    rules = compile_views(views, ctx.catalog)
    ctx.result.data = data
    if tree is None:
        family = probe_family(data, ctx.catalog)
        if family:
            tree = modeltree.probe_tree(family)
    if tree is None:
        _run("static", ctx, data)
        return
    ctx.result.tree = f"{tree.source}:{tree.family}"
    assigned = engine.resolve(tree.root, rules, ctx.catalog.is_instance, tree.search_cache)
    _run("tree", ctx, data, rules, tree, assigned)
    if ctx.options.explain and tree.source == "model":
        ctx.result.plan = plan_rows(rules, ctx.catalog, tree)
    if ctx.checkpoint is not None:
        _run("weights", ctx, rules, tree, ctx.checkpoint)


def rule_families(data: list, catalog: Catalog) -> dict[str, int]:
    """``{family: index of the first rule naming one of its module classes}`` over a file's ``match.class`` entries."""
    families: dict[str, int] = {}
    for i, rule in enumerate(data or []):
        match = rule.get("match") if isinstance(rule, dict) else None
        cls = match.get("class") if isinstance(match, dict) else None
        t = catalog.type_of_class(cls) if isinstance(cls, str) else None
        # rotary classes are shared across families upstream (Qwen3 files match Qwen2MoeRotaryEmbedding)
        fam = modeltree.family_of_type(t) if t and catalog.role_of(t) != "rope" else None
        if fam:
            families.setdefault(fam, i)
    return families


def probe_family(data: list, catalog: Catalog) -> str | None:
    """The one family whose module classes a file's rules match, when they name exactly one (for a probe tree)."""
    families = rule_families(data, catalog)
    return next(iter(families)) if len(families) == 1 else None


def explain_plan(rules_data: list, catalog: Catalog, tree: modeltree.ModelTree) -> list[dict]:
    """The resolved injection plan of a rule file's data (see ``plan_rows``)."""
    return plan_rows(compile_rules(rules_data, catalog), catalog, tree)


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
