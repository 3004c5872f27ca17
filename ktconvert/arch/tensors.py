"""The tensors a model of a family holds, from its normalised config: one list, read by the tiny models (which fill
it), the LoRA and release writers, and the completeness check of every checkpoint read
(``ktconvert/formats/completeness.py``: a checkpoint lacking one of these is refused). A walker over the layers: each
layer's mechanisms (``registry.py``) list their own tensors. Pure Python, no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

from ktconvert.arch.base import norm_role
from ktconvert.arch.registry import attention, feed_forward_for, mechanism, residual_for

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


#: the tensors every layer of every family holds, whatever its kind (full, linear, compressed or sparse attention;
#: MoE or dense): the norms before the mixer and before the FFN; and the model-wide tensors every model holds (the
#: head is not one: a tied model has none). ``tensor_specs`` adds them from here, and a GGUF read without its
#: config.json is checked for them (``ktconvert.formats.completeness.missing_everywhere``).
LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
MODEL_WIDE = ("model.embed_tokens.weight", "model.norm.weight")


def everywhere_names(n_layers: int) -> list[str]:
    """The canonical names of what every model of ``n_layers`` layers holds, whatever its family and config."""
    return [MODEL_WIDE[0], *(f"model.layers.{L}.{n}" for L in range(n_layers) for n in LAYER_NORMS), MODEL_WIDE[1]]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # embed, norm, norm0 (zero-centred), linear, out_linear, bias, out_bias, sink, router, score_bias, head, conv, dt_bias, a_log, tid2eid


def tensor_specs(cfg: MoeConfig, *, experts: bool = True) -> list[TensorSpec]:
    """Every tensor of the checkpoint in the per-expert Hugging Face layout, with how to fill it.

    ``out_linear`` marks matrices whose output is added to the residual stream (their routing-channel rows
    are zeroed); the names are those transformers 5 writes and the reference model's state dict uses.
    ``experts=False`` leaves out the routed experts (the list a completeness check needs: the experts are counted
    by the layout detection, and their names are most of a large model's).
    """
    h, specs = cfg.hidden_size, []

    def add(name: str, shape: tuple[int, ...], kind: str) -> None:
        specs.append(TensorSpec(name, tuple(shape), kind))

    norm = norm_role(cfg)
    residual = residual_for(cfg)
    hc = mechanism(residual) if residual else None
    add(MODEL_WIDE[0], (cfg.vocab_size, h), "embed")
    for layer in range(cfg.num_hidden_layers):
        for n in LAYER_NORMS:
            add(f"model.layers.{layer}.{n}", (h,), norm)
        if hc is not None and hc.before_attention(cfg):
            hc.layer_tensors(cfg, layer, add)
        attention(cfg, layer).layer_tensors(cfg, layer, add)
        if hc is not None and not hc.before_attention(cfg):
            hc.layer_tensors(cfg, layer, add)
        mechanism(feed_forward_for(cfg, layer)).layer_tensors(cfg, layer, add, experts=experts)
    add(MODEL_WIDE[1], (h,), norm)
    if hc is not None:
        hc.model_tensors(cfg, add)
    add("lm_head.weight", (cfg.vocab_size, h), "head")
    return specs
