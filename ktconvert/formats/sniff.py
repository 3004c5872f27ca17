"""Recognise a file by its first bytes, so that a misnamed file gets a message about what it really is."""

from __future__ import annotations

RESAVE_FIX = (
    "re-save it as safetensors where you trust the file: python -c \"import torch, safetensors.torch as s; "
    "s.save_file(torch.load('IN', weights_only=True), 'OUT.safetensors')\"; ktconvert itself never unpickles"
)


def sniff(head: bytes) -> str | None:
    """``"gguf"``, ``"zip"``, ``"pickle"`` or ``None`` (unknown: maybe safetensors) from a file's first bytes."""
    if head[:4] == b"GGUF":
        return "gguf"
    if head[:4] == b"PK\x03\x04":
        return "zip"
    # a safetensors file whose 8-byte header length starts 0x80 0x02..0x05 (e.g. 1152) is not a pickle: its
    # JSON header starts at byte 8 (edit by the quantize issue: adapters with ~1 KB headers were refused)
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5 and head[8:9] != b"{":
        return "pickle"
    return None


def describe(kind: str) -> str:
    return {
        "zip": "a zip archive (what torch.save writes since PyTorch 1.6)",
        "pickle": "a Python pickle (what legacy torch.save writes)",
        "gguf": "a GGUF file",
    }[kind]
