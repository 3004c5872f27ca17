"""A checkpoint is complete or refused: every tensor the family's spec gives a model of this config (norms,
attention, router, shared experts, embeddings, the output head unless tied) must be present, not only the routed
experts (which the layout detection counts per layer).

The expected list is the one the tiny models and the module tree are built from (``arch.tensors.tensor_specs``
over ``normalize_config``); each name is placed through the architecture's naming map, so an HF checkpoint in
either spelling, a GGUF (llama.cpp names, split or merged tensors) and a packed release are all compared by what
their tensors hold. A name the naming map does not know is not required (llama.cpp has no place for it either).

A GGUF read without its config.json (the common case) is checked for what its own metadata settles whatever the
family: ``{arch}.block_count`` layers (less ``nextn_predict_layers`` MTP layers, whose tensors a converter may leave
out), each holding the two norms every layer of every kind holds (``arch.tensors.LAYER_NORMS``), the embeddings
and the output norm, and in every layer that holds routed experts a router and, where the metadata gives shared
experts (``expert_shared_count`` or ``expert_shared_feed_forward_length``), the naming map's shared-expert tensors. The rest of a layer (attention,
linear attention, compressed or shared-indexer layers, a dense FFN) varies with config keys the metadata does not
carry for every family, and the head is absent from a tied model: those need the config.json.
"""

from __future__ import annotations

from collections.abc import Mapping

from ktconvert.errors import InputError
from ktconvert.families.config import normalize_config
from ktconvert.arch.tensors import everywhere_names, tensor_specs
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
    present = _present(matches)
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


def missing_everywhere(arch: str | None, n_layers: int | None, expert_layers, matches: Mapping[str, NameMatch],
                       shared: bool = False) -> list[tuple[int | None, str]] | None:
    """``(layer, llama.cpp name)`` of what every model of ``n_layers`` layers holds (and, for each layer of
    ``expert_layers``, the router, and the shared expert when ``shared``) that no tensor of the checkpoint holds;
    ``None`` when the architecture or the layer count is unknown."""
    nm = naming_maps().get(arch or "")
    if nm is None or n_layers is None:
        return None
    present = _present(matches)
    missing = []
    for name in everywhere_names(n_layers):
        m = nm.lookup(name)
        if m is not None and m.hf_name not in present and m.gguf_name not in present:
            missing.append((m.layer, m.gguf_name or m.hf_name))
    # the map's first router entry is the router's weight (a bias or a hash table, where a family has one, follows)
    router = next((e.gguf for e in nm.tensor_entries() if e.group == "router" and "{L}" in e.gguf), None)
    per_moe_layer = [router] if router else []
    if shared:
        per_moe_layer += [e.gguf for e in nm.tensor_entries() if e.group == "shared_experts" and "{L}" in e.gguf]
    for L in sorted(expert_layers):
        missing.extend((L, t.replace("{L}", str(L))) for t in per_moe_layer if t.replace("{L}", str(L)) not in present)
    return sorted(missing, key=lambda t: -1 if t[0] is None else t[0])


def _present(matches: Mapping[str, NameMatch]) -> set:
    """Every name, Hugging Face and llama.cpp, that the checkpoint's tensors go by."""
    return {n for m in matches.values() for n in (m.hf_name, m.gguf_name)}
