"""The one validator of the counts and sizes a model's files declare (``config.json`` fields, a GGUF's KV counts).

Every command reads these numbers before it looks at a tensor: the module tree loops over the layers and experts,
layout detection builds sets of layer and expert ids, a GGUF writer packs them into u32 fields. A value no model can
have (``hidden_size`` 0, ``num_hidden_layers`` -1, top-k above the expert count) or one past any released model by a
wide margin (``block_count`` 2^31, ``num_local_experts`` 10^12) is refused here, in one line naming the file and the
field, before anything is allocated or looped over, so that work and memory stay proportional to what the file
holds. ``normalize_config`` (check-rules, quantize, golden, verify, the reference models) and the layout readers'
``dims_from_hf_config`` / ``dims_from_gguf`` (inspect, preflight, convert-lora) all call it: one rule, one message,
exit 3 everywhere.
"""

from __future__ import annotations

import math
from typing import Any

from ktconvert import arch
from ktconvert.errors import InputError

# field -> (smallest legal value, largest accepted value). The largest released MoE models today have 94 layers,
# 512 routed experts per layer, hidden size 7168 (dense models: 16384), vocabularies of 262k and 10M positions;
# every maximum below is at least 8x past that, so no real model is refused and no hostile one costs more than a
# real one would. These are the core's; each mechanism bounds its own counts (``count_limits`` of its
# ``ktconvert/arch/`` module: MLA's latents, the indexers', Gated DeltaNet's, ...), gathered after them.
CORE_LIMITS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 1024),
    "num_experts": (1, 8192),
    "num_local_experts": (1, 8192),
    "n_routed_experts": (1, 8192),
    "num_experts_per_tok": (1, 8192),
    "n_shared_experts": (0, 8192),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 18),
    "moe_intermediate_size": (1, 1 << 18),
    "shared_expert_intermediate_size": (0, 1 << 18),
    "vocab_size": (1, 1 << 23),
    "max_position_embeddings": (1, 1 << 28),
    "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "head_dim": (0, 1 << 14),  # 0: MLA configs transformers saves (GLM-5-Next), where head_dim is unused
    "first_k_dense_replace": (0, 1024),
    "decoder_sparse_step": (1, 1024),
}


#: every count this module checks: the core's, then each registered mechanism's (a key bounded twice is refused)
FIELD_LIMITS: dict[str, tuple[int, int]] = arch.count_limits(CORE_LIMITS)

#: How many routed expert modules (layers x experts) a model may declare: the largest released models have about 24k
#: (48 x 512 Qwen3-Next, 61 x 384 Kimi K2, 94 x 128 Qwen3-235B). check-rules --model builds the module tree from a
#: config alone (there are no tensors to compare with), one node per module: at this bound (5x the largest) the
#: tree has 660k nodes, about 200 MiB and 8 s on a loaded 2-core machine, whatever the file claims.
MAX_EXPERT_MODULES = 1 << 17

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

#: A GGUF architecture's KV counts (``<arch>.<key>``) and the config field whose limits they share.
GGUF_KEYS = {
    "block_count": "num_hidden_layers",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_shared_count": "n_shared_experts",
    "embedding_length": "hidden_size",
    "expert_feed_forward_length": "moe_intermediate_size",
    "leading_dense_block_count": "first_k_dense_replace",
}


def check_counts(values: dict, path: str | None, names: dict[str, str] | None = None) -> None:
    """Refuse, in one :class:`InputError` naming the field and its legal range, a count in ``values`` (a text view
    of ``config.json``, or GGUF KVs renamed to config fields with ``names`` mapping each back to its own key) that no
    model can have. Absent and null fields pass: whether a field is required is the reader's business."""
    names = names or {}

    def bad(field: str, message: str, fix: str) -> InputError:
        key = names.get(field, field)
        return InputError(message.replace("{key}", key), path=path, where=key, fix=fix.replace("{key}", key))

    got: dict[str, int] = {}
    for field, (lo, hi) in FIELD_LIMITS.items():
        v: Any = values.get(field)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or int(v) != v:
            raise bad(field, f"{{key}} must be an integer, got {v!r}", "write the model's {key} as an integer")
        v = int(v)
        if not lo <= v <= hi:
            what = "at least" if v < lo else "at most"
            limit = lo if v < lo else hi
            why = "" if v < lo else " (far beyond any released model; ktconvert refuses larger counts so that a " \
                                    "damaged file cannot exhaust memory)"
            raise bad(field, f"{{key}}={v} must be {what} {limit}{why}",
                      "correct {key} to the model's real value")
        got[field] = v
    experts = next((got[k] for k in _EXPERT_KEYS if k in got), None)
    top_k = got.get("num_experts_per_tok")
    if experts is not None and top_k is not None and top_k > experts:
        expert_key = next(k for k in _EXPERT_KEYS if k in got)
        raise bad("num_experts_per_tok", f"{{key}}={top_k} must be in 1..{experts} (the expert count, "
                  f"{names.get(expert_key, expert_key)})", "a token cannot route to more experts than the layer has")
    layers = got.get("num_hidden_layers")
    if experts is not None and layers is not None and experts * layers > MAX_EXPERT_MODULES:
        expert_key = next(k for k in _EXPERT_KEYS if k in got)
        raise bad(expert_key, f"{{key}}={experts} experts in each of {layers} layers "
                  f"({names.get('num_hidden_layers', 'num_hidden_layers')}) make {experts * layers} expert modules, "
                  f"more than {MAX_EXPERT_MODULES} (far beyond any released model)",
                  "correct {key} and the layer count to the model's real values")


def check_gguf_counts(kv: dict, arch: str, path: str | None) -> None:
    """:func:`check_counts` on a GGUF's ``<arch>.*`` KV counts, each named by its own key."""
    values, names = {}, {}
    for key, field in GGUF_KEYS.items():
        full = f"{arch}.{key}"
        if full in kv and not isinstance(kv[full], (list, tuple)) and not hasattr(kv[full], "length"):
            values[field], names[field] = kv[full], full
    check_counts(values, path, names)
