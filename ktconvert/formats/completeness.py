"""A checkpoint is complete or refused: every tensor the family's spec gives a model of this config (norms,
attention, router, shared experts, embeddings, the output head unless tied) must be present, not only the routed
experts (which the layout detection counts per layer).

The expected list is the one the tiny models and the module tree are built from (``families.tensors.tensor_specs``
over ``normalize_config``); each name is placed through the architecture's naming map, so an HF checkpoint in
either spelling, a GGUF (llama.cpp names, split or merged tensors) and a packed release are all compared by what
their tensors hold. A name the naming map does not know is not required (llama.cpp has no place for it either).
"""

from __future__ import annotations

from collections.abc import Mapping

from ktconvert.errors import InputError
from ktconvert.families.config import normalize_config
from ktconvert.families.tensors import tensor_specs
from ktconvert.formats.naming import NameMatch, naming_maps

_EXPERT_GROUPS = ("experts", "expert_scales", "expert_biases")


def missing_tensors(config: dict, arch: str | None, matches: Mapping[str, NameMatch]) -> list[str] | None:
    """The canonical HF names of the spec's non-expert tensors that no tensor of the checkpoint holds (``matches``:
    the checkpoint's names classified under architecture ``arch``'s naming map); ``None`` when the config is not one
    the spec can describe (another family or architecture, or a feature the reference models refuse): then nothing
    can be said."""
    try:
        cfg = normalize_config(config)
    except InputError:
        return None
    nm = naming_maps().get(arch or "")
    if nm is None or cfg.spec.gguf_arch != arch:
        return None
    present = set()
    for m in matches.values():
        present.add(m.hf_name)
        present.add(m.gguf_name)
    missing = []
    for spec in tensor_specs(cfg, experts=False):
        if spec.kind == "head" and cfg.tie_word_embeddings:
            continue
        m = nm.lookup(spec.name)
        if m is None or m.group in _EXPERT_GROUPS:
            continue
        if m.hf_name not in present and m.gguf_name not in present:
            missing.append(m.hf_name or spec.name)
    return missing
