"""Reference MoE models in plain torch, their configs, weights loading, and the deterministic tiny models.

Importing this package does not import torch (rule checking reads :mod:`ktconvert.families.config` and
:mod:`ktconvert.model.hfnames` on a torch-free path); the torch-backed names below load on first use.

Typical use::

    from ktconvert.model import from_pretrained
    model = from_pretrained("path/to/checkpoint")          # float32, strict weight loading
    cache = model.new_cache()
    out = model(prompt_ids[:, :8], cache)                   # prefill
    step = model(prompt_ids[:, 8:9], cache)                 # one decode step
    out.logits, out.hidden_states, out.final_hidden
"""

from __future__ import annotations

from ktconvert.io.lazy import lazy_exports

from ktconvert.families.config import (
    FAMILIES,
    MoeConfig,
    RopeSpec,
    load_config,
    normalize_config,
)

_LAZY = {
    "build_model": "ktconvert.model.reference",
    "ReferenceCausalLM": "ktconvert.model.reference",
    "ForwardOutput": "ktconvert.model.reference",
    "module_class_paths": "ktconvert.model.reference",
    "module_type_resolver": "ktconvert.model.reference",
    "KVCache": "ktconvert.model.modules",
    "load_weights": "ktconvert.model.weights",
    "LoadReport": "ktconvert.model.weights",
}

__all__ = ["FAMILIES", "MoeConfig", "RopeSpec", "load_config", "normalize_config", "from_pretrained", *_LAZY]


__getattr__ = lazy_exports(__name__, _LAZY)


def from_pretrained(model_dir, *, dtype=None):
    """Build the reference model for ``model_dir/config.json`` and load its safetensors strictly."""
    import torch

    from ktconvert.model.reference import build_model
    from ktconvert.model.weights import load_weights

    model = build_model(model_dir, dtype=dtype or torch.float32)
    load_weights(model, model_dir)
    return model
