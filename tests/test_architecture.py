"""The package structure of docs/developing/layout.md holds: imports point one way, and each piece of infrastructure exists once.

Read from the source (every import, module-level or not), so a new arrow that runs back up fails here before it
becomes a tangle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ktconvert"

#: A package may import only packages on a lower floor (same floor: never). ``__init__``/``__main__``/``demo``
#: are the top-level modules.
#: ``arch`` sits below ``families``: each mechanism's module parses its part of config.json, and
#: ``families/config.py`` asks the mechanisms a spec picks for their parts (docs/developing/layout.md).
FLOORS = {
    "errors": 0, "diagnostics": 0, "optional": 1, "io": 1,
    "arch": 2, "quant": 2, "cluster": 2,
    "families": 3,
    "formats": 4,
    "rules": 5,
    "convert": 6, "model": 6,
    "golden": 7, "kernel": 7, "imatrix": 7,
    "verify": 8, "preflight": 8,
    "gate": 9,
    "demo": 10,
    "cli": 11, "__main__": 12,
}
#: Packages that must stay light: check-rules, inspect and planning run without torch.
NO_TORCH = ("io", "families", "arch", "formats", "rules")


def _modules():
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG)
        owner = rel.parts[0][:-3] if len(rel.parts) == 1 else rel.parts[0]
        yield f, owner, ast.parse(f.read_text(encoding="utf-8"))


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of the import nodes inside ``if TYPE_CHECKING:``: they name a type for annotations and never run."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _imports(tree: ast.AST):
    skip = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


def _arrows() -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for f, owner, tree in _modules():
        if owner == "__init__":
            continue
        for name in _imports(tree):
            parts = name.split(".")
            if parts[0] == "ktconvert" and len(parts) > 1 and parts[1] != owner:
                out.setdefault((owner, parts[1]), []).append(str(f.relative_to(PKG.parent)))
    return out


def test_every_package_has_a_floor():
    owners = {owner for _, owner, _ in _modules()} - {"__init__"}
    assert owners <= set(FLOORS), owners - set(FLOORS)


def test_imports_point_down_only():
    wrong = {f"{a} -> {b} ({files[0]})" for (a, b), files in _arrows().items() if FLOORS[b] >= FLOORS[a]}
    assert not wrong, sorted(wrong)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the ktconvert modules it imports (every import, module-level or not; ``from pkg import mod`` counts
    as importing ``pkg.mod`` when that is a module). A package's ``__init__`` re-exporting its modules is its face,
    not a module of its own, so it is left out."""
    mods = {}
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG.parent).with_suffix("")
        if rel.name == "__init__":
            continue
        mods[".".join(rel.parts)] = f
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(f.read_text(encoding="utf-8"))
        skip = _type_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[m] |= {x for x in targets if x in mods and x != m}
    return graph


def test_no_module_imports_itself_through_others():
    """No circles between modules: two modules that need each other are one module, or share a lower one."""
    graph = _module_graph()
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"modules importing each other in a circle: {circles}"


@pytest.mark.parametrize("package", NO_TORCH)
def test_light_packages_import_neither_torch_nor_the_models(package):
    bad = []
    for f, owner, tree in _modules():
        if owner == package:
            bad += [f"{f.relative_to(PKG.parent)}: {n}" for n in _imports(tree)
                    if n.split(".")[0] in ("torch", "transformers") or n.startswith("ktconvert.model")]
    assert not bad, bad


# --- one definition each -------------------------------------------------------------------------------------------
def _definitions(pattern: str) -> list[str]:
    rx = re.compile(pattern, re.M)
    return sorted(str(f.relative_to(PKG.parent)) for f, _, _ in _modules() if rx.search(f.read_text(encoding="utf-8")))


@pytest.mark.parametrize("what,pattern,home", [
    ("atomic rename of a file or directory", r"\bos\.replace\(", ["ktconvert/io/atomic.py"]),
    ("the OUT-exists guard", r'"output already exists"', ["ktconvert/io/atomic.py"]),
    ("the lock on an output", r"\bfcntl\.flock\(", ["ktconvert/io/atomic.py"]),
    ("a YAML parser call", r"\byaml\.(safe_load|load|compose)\(", ["ktconvert/io/yamlpos.py"]),
    ("a JSON Schema validator", r"Draft202012Validator\(", ["ktconvert/io/datafile.py"]),
    ("the ggml writable types", r'^WRITABLE\b.*=', ["ktconvert/quant/_types.py"]),
    ("a safetensors dtype table", r'"BF16"\s*:\s*(\d|np\.|torch\.)|\("BF16",\s*16,|torch\.bfloat16\s*:', ["ktconvert/io/dtypes.py"]),
    ("a file sha256", r"def \w*sha256\w*\(path", ["ktconvert/io/atomic.py"]),
    ("an optional-dependency import guard", r"except ImportError.*:\n\s*(top|raise)", ["ktconvert/optional.py"]),
    # a scan's tally (kind, tensor, expert, count) is a measurement inspect turns into Diagnostics: see layout.md
    ("a finding or problem record", r"^@dataclass.*\nclass \w*(Finding|Problem|Diagnostic|Issue)\b",
     ["ktconvert/diagnostics.py", "ktconvert/formats/scan.py"]),
])
def test_infrastructure_is_defined_once(what, pattern, home):
    assert _definitions(pattern) == home, f"{what} is defined outside {home}"


# --- ray stays optional ---------------------------------------------------------------------------------------------
def test_only_cluster_imports_ray_and_only_on_demand():
    """No module imports ray (at any level); ktconvert.cluster loads it through ``require`` when asked."""
    importers = sorted(str(f.relative_to(PKG.parent)) for f, _, tree in _modules()
                       if any(n.split(".")[0] == "ray" for n in _imports(tree)))
    assert importers == []
    assert _definitions(r'require\(\s*"ray"') == ["ktconvert/cluster.py"]


def test_the_commands_and_libraries_do_not_import_ray():
    import subprocess
    import sys

    code = ("import sys; from click.testing import CliRunner; from ktconvert.cli import cli; "
            "import ktconvert.convert, ktconvert.gate, ktconvert.cluster; "
            "[CliRunner().invoke(cli, [c, '--help'], catch_exceptions=False) for c in ('quantize', 'gate')]; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_a_conversion_worker_imports_no_planning():
    """A ``quantize -j N`` worker process imports the worker module and what it reads with: not the planner, the
    family registry (17 spec files parsed and validated), jsonschema or the package faces' other modules. Each of
    these cost every worker of every run a share of its start-up (0.47 CPU-s of imports before, 0.21 after)."""
    import subprocess
    import sys

    heavy = ["ktconvert.convert.plan", "ktconvert.convert.api", "ktconvert.convert.execute", "ktconvert.families",
             "ktconvert.formats.naming", "ktconvert.formats.layout", "jsonschema", "torch"]
    code = ("import sys, ktconvert.convert.worker; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout
    # the package faces still hand out every public name (loaded on first use)
    import ktconvert.convert as conv
    import ktconvert.formats as fmt

    for face in (conv, fmt):
        assert all(getattr(face, n) is not None for n in face.__all__)
        with pytest.raises(AttributeError):
            face.no_such_name  # noqa: B018


def _attribute_calls(name: str) -> list[str]:
    """``file:line`` of every ``<anything>.name(...)`` call outside the families package."""
    hits = []
    for f, owner, tree in _modules():
        if owner == "families":
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
                    and isinstance(node.func.value, (ast.Name, ast.Attribute, ast.Call))):
                hits.append(f"{f.relative_to(PKG.parent)}:{node.lineno}")
    return hits


def test_only_the_families_package_reads_raw_spec_sections():
    """The spec's sections are read through their typed parts (``spec.attention``, ``spec.experts``,
    ``spec.gguf``, ``spec.classes``, ``spec.activation``): a key's default and meaning live once,
    in ``ktconvert/families/parts.py``."""
    offenders = _attribute_calls("section")
    assert offenders == [], f"FamilySpec.section(...) read outside ktconvert/families/: {offenders}"


#: the names the parsed config goes by (``cfg``, ``c``, ``config``, ``self.cfg``): ``<one of them>.raw`` reads the raw
#: config.json dict a parser in families/ or arch/ should have read once
_CONFIG_NAMES = {"cfg", "c", "config", "mcfg", "moe_cfg"}


def test_only_families_and_arch_read_the_raw_config():
    """What a command needs of config.json is a parsed field of ``MoeConfig`` (or one of its parts), parsed once in
    ``ktconvert/families/`` or ``ktconvert/arch/``: the parsed config keeps no raw dict to read, and no module
    elsewhere reads ``<config>.raw``."""
    import dataclasses

    from ktconvert.families.config import MoeConfig

    assert "raw" not in {f.name for f in dataclasses.fields(MoeConfig)} and not hasattr(MoeConfig, "raw"), (
        "MoeConfig keeps the raw config.json dict: parse what its readers need into fields")
    offenders = []
    for f, owner, tree in _modules():
        if owner in ("families", "arch"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "raw":
                v = node.value
                name = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
                if name in _CONFIG_NAMES:
                    offenders.append(f"{f.relative_to(PKG.parent)}:{node.lineno}")
    assert offenders == [], f"the raw config read outside ktconvert/families/ and ktconvert/arch/: {offenders}"


#: ``MoeConfig``'s fields: the core (sizes, layers, experts, rope, norms, the model's own GGUF facts) and one field
#: per typed part. A new field is a size every layer shares (the core) or, more likely, belongs to a mechanism's
#: part: add it to that part (``MlpPart`` in ktconvert/arch/moe.py for the dense layers' and experts' widths and the
#: shared experts, ``AttentionPart`` in ktconvert/arch/attention_part.py, ``Routing``, ``Activation``, ...) and its
#: parser, not here.
_MOE_CONFIG_CORE = {"family", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "rope",
                    "tie_word_embeddings", "attention_bias_on", "num_experts", "num_experts_per_tok", "bos_token_id",
                    "eos_token_id", "architecture", "gguf"}
_MOE_CONFIG_PARTS = {"mlp": "MlpPart", "routing": "Routing", "activation": "Activation",
                     "attention": "AttentionPart", "residual": "HyperConnectionDims"}


def test_moe_config_is_a_core_plus_typed_parts():
    """A mechanism's field cannot drift back into ``MoeConfig``'s core (an MLP width, a shared-expert count, an
    attention rank): its fields are exactly the core and the parts, each part typed by its mechanism's class from
    ``ktconvert/arch/``."""
    import dataclasses
    import typing

    from ktconvert.families.config import MoeConfig

    fields, wanted = {f.name for f in dataclasses.fields(MoeConfig)}, _MOE_CONFIG_CORE | set(_MOE_CONFIG_PARTS)
    assert fields == wanted, (f"MoeConfig's fields changed: new {sorted(fields - wanted)}, gone "
                              f"{sorted(wanted - fields)}; a mechanism's field goes on its part")
    hints = typing.get_type_hints(MoeConfig)
    for name, cls in _MOE_CONFIG_PARTS.items():
        part = next(t for t in (typing.get_args(hints[name]) or (hints[name],)) if t is not type(None))  # X | None
        assert part.__name__ == cls and part.__module__.startswith("ktconvert.arch."), (name, part)
        assert dataclasses.is_dataclass(part) and part.__dataclass_params__.frozen, name
    from ktconvert.arch.moe import MlpPart

    mlp = {f.name for f in dataclasses.fields(MlpPart)}
    assert not fields & mlp, f"an MLP field is back in MoeConfig's core: {sorted(fields & mlp)}"


# --- one place per mechanism ----------------------------------------------------------------------------------------
#: the values of a spec's attention kinds and config.json's layer kinds: comparing one of them chooses a mechanism
_KIND_VALUES = {"linear_attention", "gqa", "mla", "compressed_mqa", "gated_deltanet_hybrid", "gated_deltanet", "kda"}
#: the parsed config's per-kind parts and flags: testing one chooses a mechanism
_KIND_FLAGS = {"kda", "compressed", "linear", "mla", "is_mla"}


def _kind_choices(tree: ast.AST) -> list[int]:
    """Lines choosing a mechanism by hand: a comparison with a kind value (``layer_types[i] == "linear_attention"``,
    ``attention.kind == "mla"``), an ``is None`` / ``is not None`` test of a kind's part (``cfg.attention.kda is not None``),
    or any use of ``is_mla``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Constant) and s.value in _KIND_VALUES for s in sides):
                lines.append(node.lineno)
            elif any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) and any(
                    isinstance(s, ast.Attribute) and s.attr in _KIND_FLAGS for s in sides):
                lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "is_mla":
            lines.append(node.lineno)
    return lines


def test_only_arch_chooses_a_layers_mechanism(pkg=PKG):
    """The kda -> linear -> compressed -> mla -> gqa ladder exists once, in ``ktconvert/arch/registry.py``
    (``attention_for``; the families package parses the parts it reads). Any other module asks ``arch`` which
    mechanism a layer runs, and the mechanism's own module says what it holds."""
    offenders = []
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(pkg)
        if rel.parts[0] in ("arch", "families"):
            continue
        offenders += [f"ktconvert/{rel}:{n}" for n in _kind_choices(ast.parse(f.read_text(encoding="utf-8")))]
    assert offenders == [], f"a mechanism chosen outside ktconvert/arch/: {offenders}"


def test_arch_is_torch_free_and_sits_just_below_families():
    """``ktconvert/arch/`` imports nothing above errors and io at run time (the parsed config it reads is named for
    annotations only, under ``TYPE_CHECKING``): ``families/config.py`` imports its mechanisms' parsers. No torch,
    and gguf (numpy) only inside the GGUF key writers that need an enum of it: check-rules imports this package and
    runs without numpy."""
    above = []
    for f, owner, tree in _modules():
        if owner != "arch":
            continue
        top = set(_imports(ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                                      type_ignores=[])))
        above += [f"{f.relative_to(PKG.parent)}: {n}" for n in _imports(tree)
                  if n.split(".")[0] in ("torch", "transformers") or (n.split(".")[0] in ("gguf", "numpy") and n in top)
                  or (n.startswith("ktconvert.") and n.split(".")[1] not in ("arch", "errors", "io"))]
    assert not above, sorted(above)


def test_every_mechanism_has_its_torch_module_under_the_same_name():
    from ktconvert import arch
    from ktconvert.model import mechanisms

    torch_names = [*mechanisms.ATTENTION, *mechanisms.FEED_FORWARD, *mechanisms.RESIDUAL]
    assert sorted(torch_names) == sorted(arch.MECHANISMS)
    assert all(hasattr(arch.mechanism(n), "attr") for n in mechanisms.ATTENTION)
