"""Golden directories: ``manifest.yaml`` + ``golden.safetensors``, read back with every recorded check.

Reading needs numpy and safetensors only (no torch, no transformers), so ``verify`` and the gate can load
goldens wherever the package is installed.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ktconvert.errors import InputError
from ktconvert.golden.manifest import read_manifest

TENSORS_NAME = "golden.safetensors"

ENTRY_DESCRIPTIONS = {
    "input_ids": "prompt token ids [1, T]",
    "logits": "prefill logits over the whole prompt [1, T, V]; decode with a KV cache must reproduce them per position",
    "hidden_states": "embedding output, then each decoder layer's output before the final norm [num_layers + 1, 1, T, H]",
    "final_hidden": "last layer's output after the final norm [1, T, H]",
    "base_logits": "golden --lora only: prefill logits of the model without the adapter [1, T, V]",
}


@dataclass
class Golden:
    """A loaded golden: its manifest and tensors (numpy), already checked against each other."""

    path: Path
    manifest: dict
    tensors: dict[str, np.ndarray]

    @property
    def input_ids(self) -> np.ndarray:
        return self.tensors["input_ids"]

    @property
    def logits(self) -> np.ndarray:
        return self.tensors["logits"]

    @property
    def hidden_states(self) -> np.ndarray:
        return self.tensors["hidden_states"]

    @property
    def final_hidden(self) -> np.ndarray:
        return self.tensors["final_hidden"]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_golden(golden_dir: str | os.PathLike) -> Golden:
    """Load and cross-check a golden directory: schema, file hash, tensor names, dtypes, shapes, prompt ids."""
    from safetensors.numpy import load

    root = Path(golden_dir)
    manifest = read_manifest(root)
    spec = manifest["tensors"]
    path = root / spec["file"]
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError("golden tensors file not found", path=str(path), fix="regenerate with `ktconvert golden`")
    if sha256_bytes(data) != spec["sha256"]:
        raise InputError("sha256 differs from the manifest: the golden was modified or truncated", path=str(path))
    try:
        tensors = load(data)
    except Exception as exc:  # safetensors raises its own error type for malformed headers
        raise InputError(f"not a readable safetensors file: {exc}", path=str(path))
    names = set(spec["entries"])
    if set(tensors) != names:
        raise InputError(f"tensors {sorted(tensors)} differ from the manifest's {sorted(names)}", path=str(path))
    for name, entry in spec["entries"].items():
        arr = tensors[name]
        if str(arr.dtype) != entry["dtype"] or list(arr.shape) != list(entry["shape"]):
            raise InputError(
                f"{arr.dtype}{list(arr.shape)} differs from the manifest's {entry['dtype']}{entry['shape']}",
                path=str(path),
                where=name,
            )
    if tensors["input_ids"].reshape(-1).tolist() != list(manifest["prompt"]["ids"]):
        raise InputError("input_ids differ from the manifest's prompt ids", path=str(path), where="input_ids")
    return Golden(path=root, manifest=manifest, tensors=tensors)
