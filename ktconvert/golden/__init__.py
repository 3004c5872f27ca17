"""Golden outputs: produced by Hugging Face transformers (``generate``, optional extra ``golden``), stored as
``manifest.yaml`` + ``golden.safetensors`` and read back (``read_golden``) with numpy alone.

Reading never imports torch or transformers; producing imports them lazily.
"""

from __future__ import annotations

from ktconvert.golden.manifest import MANIFEST_NAME, read_manifest, validate_manifest
from ktconvert.golden.paths import golden_root, load_tiny_hashes
from ktconvert.golden.store import TENSORS_NAME, Golden, read_golden

__all__ = [
    "MANIFEST_NAME",
    "TENSORS_NAME",
    "Golden",
    "golden_root",
    "load_tiny_hashes",
    "read_golden",
    "read_manifest",
    "validate_manifest",
]
