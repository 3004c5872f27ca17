"""Injection plans on the torch reference models equal check-rules' plans on the config-built tree."""

import pytest

from ktconvert.errors import InputError
from ktconvert.model.tiny import tiny_config
from ktconvert.rules import lint, modeltree
from ktconvert.rules.apply import injection_plan, load_rules
from ktconvert.rules.catalog import load_catalog

from conftest import REPO

CASES = [(p.stem.split("-")[0], p) for p in sorted((REPO / "rules" / "optimize").glob("*.yaml"))]


@pytest.mark.parametrize("family,rules", CASES, ids=[p.name for _, p in CASES])
def test_plan_on_torch_model_equals_explain_on_tree(family, rules):
    from ktconvert.io import yamlpos
    from ktconvert.model import build_model, module_type_resolver, normalize_config

    cfg = tiny_config(family)
    model = build_model(normalize_config(cfg), device="meta")
    catalog = load_catalog()
    plan = injection_plan(model, load_rules(rules), catalog, module_type_resolver(catalog))
    torch_plan = {i.path: (i.rule_index, i.replace_class.rsplit(".", 1)[-1]) for i in plan if i.path}
    data = yamlpos.load_text(rules.read_text()).data
    tree_plan = {r["module"]: (r["rule"], r["operator"]) for r in lint.explain_plan(data, load_catalog(), modeltree.build_tree(cfg))}
    assert torch_plan == tree_plan
    from ktconvert.model import hfnames

    experts_injected = any(op.endswith("Experts") or op.startswith("KTransformersExperts") for _, op in torch_plan.values())
    # a family ktransformers has no modeling file for (gpt_oss) ships a port that keeps its experts default
    assert experts_injected == (hfnames.classes_module(family) is not None)


def test_rules_with_errors_are_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text('- match: {name: "^model\\\\.layers\\\\.[0-9]+\\\\.mlp\\\\.experts$"}\n'
                   '  replace: {class: ktransformers.operators.experts.KTransformersExperts, kwargs: {generate_op: KExpertCPU}}\n'
                   '  recursive: false\n')
    with pytest.raises(InputError, match="KT202"):
        load_rules(bad)
