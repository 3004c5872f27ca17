"""check-rules' torch-free module tree and the torch reference models agree module for module.

The injection in verify runs the rule engine over the reference model; check-rules runs it over the tree
built from config.json. If the two disagreed, a rule file could pass check-rules and inject differently.
"""

import pytest

from ktconvert.model.tiny import tiny_config
from ktconvert.rules import modeltree
from ktconvert.rules.catalog import load_catalog


@pytest.mark.parametrize("family", modeltree.FAMILIES)
def test_same_paths_and_matching_classes(family):
    from ktconvert.model import build_model, module_class_paths, normalize_config

    cfg = tiny_config(family)
    tree = modeltree.build_tree(cfg)
    model = build_model(normalize_config(cfg), device="meta")
    cat = load_catalog()
    ref = {name: module for name, module in model.named_modules()}
    tree_paths = {n.path for n in tree.nodes}
    assert tree_paths == set(ref), (sorted(tree_paths - set(ref))[:5], sorted(set(ref) - tree_paths)[:5])
    for node in tree.nodes:
        known = [cat.type_of_class(p) for p in module_class_paths(ref[node.path])]
        known = [k for k in known if k]
        assert known, f"{node.path}: no class path of the reference module is in the catalog"
        # every class an upstream rule could name for the real module matches the tree node the same way
        for type_id in known:
            assert cat.is_instance(node.type, type_id), (node.path, node.type, type_id)
