"""Writes small GGUF files holding exactly the tensors a model tree expects (for the KT5xx tests)."""

from __future__ import annotations

import gguf
import numpy as np

from ktconvert.formats import naming_map
from ktconvert.rules.catalog import load_catalog
from ktconvert.rules.modeltree import ModelTree
from ktconvert.rules.checks.weights import expected_tensors

_TYPES = {"F32": np.float32, "F16": np.float16}


def write_gguf(path, tree: ModelTree, drop=(), experts_type: str = "F32") -> list[str]:
    """A GGUF with llama.cpp names for every tensor of ``tree`` (minus ``drop``); returns the names written.
    ``experts_type``: F32, F16, BF16, or any ggml block type (zero blocks, one per row)."""
    cat = load_catalog()
    naming = naming_map(tree.family)
    names = [e.stored[0] for e in expected_tensors(tree, "gguf", naming, cat.role_of)]
    for node in tree.nodes:
        if cat.role_of(node.type) == "experts" and node.layer is not None:
            names += [naming.expert_name("gguf-merged", p, node.layer) for p in ("gate", "up", "down")]
    writer = gguf.GGUFWriter(str(path), naming.arch)
    written = []
    for name in names:
        if name in drop:
            continue
        if "_exps." in name:
            if experts_type == "BF16":
                data = np.zeros((2, 4, 8), dtype=np.uint16)
                writer.add_tensor(name, data, raw_shape=(2, 4, 8), raw_dtype=gguf.GGMLQuantizationType.BF16)
            elif experts_type in _TYPES:
                writer.add_tensor(name, np.zeros((2, 4, 8), dtype=_TYPES[experts_type]))
            else:  # a block type: zero blocks (rows of one block), as gguf-py writes raw bytes
                qt = gguf.GGMLQuantizationType[experts_type]
                data = np.zeros((2, 4, gguf.GGML_QUANT_SIZES[qt][1]), dtype=np.uint8)
                writer.add_tensor(name, data, raw_dtype=qt)
        else:
            writer.add_tensor(name, np.zeros((4, 8), dtype=np.float32))
        written.append(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written
