"""What a model family is, below every package that needs it (rules' probe trees, the converter's names, the
reference models): the registry of family specs (``rules/families/*.yaml``) and the config spellings of each
family normalised into one ``MoeConfig``. The only package that names families; torch-free."""

from ktconvert.families.config import (
    FAMILIES,
    MoeConfig,
    RopeSpec,
    load_config,
    normalize_config,
    require_family,
    text_view,
)
from ktconvert.families.registry import (
    FamilySpec,
    families,
    family_of,
    family_of_class,
    ffn_is_expert_width,
    find,
    gguf_arch,
    permutes_qk,
    spec,
    spec_for_arch,
)

#: The family the demo and the examples use when none is named.
DEFAULT_FAMILY = "qwen3_moe"

__all__ = [
    "DEFAULT_FAMILY", "FAMILIES", "FamilySpec", "MoeConfig", "RopeSpec", "families", "family_of", "family_of_class",
    "ffn_is_expert_width", "find", "gguf_arch", "load_config", "normalize_config", "permutes_qk", "require_family", "spec",
    "spec_for_arch", "text_view",
]
