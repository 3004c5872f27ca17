"""What a model family is, below every package that needs it (rules' probe trees, the converter's names, the
reference models): the config spellings of each family normalised into one ``MoeConfig``. Torch-free."""

from ktconvert.families.config import (
    FAMILIES,
    MoeConfig,
    RopeSpec,
    load_config,
    normalize_config,
)

__all__ = ["FAMILIES", "MoeConfig", "RopeSpec", "load_config", "normalize_config"]
