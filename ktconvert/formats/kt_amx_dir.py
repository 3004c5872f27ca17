"""What a kt-amx directory holds, from safetensors headers only: per layer the experts, the numa parts and the
byte size of every expert tensor, and whether it is INT8 or INT4 (which nothing on disk says; the bytes per
part do: INT8 = rows x cols, INT4 = half).

Used by preflight (is this the dir the method and threadpool count expect?) and by verify (which method, how
many threadpools). Names are parsed by :func:`ktconvert.formats.kt_amx.parse_name` alone.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.formats.safetensors_header import parse_safetensors_header
from ktconvert.formats.kt_amx import KtAmxName, tensor_name
from ktconvert.formats.kt_amx import parse_name as parse_ktamx_name

PROJS = ("gate", "up", "down")


@dataclass
class KtAmxLayer:
    layer: int
    tensors: dict[KtAmxName, tuple[str, int, str]] = field(default_factory=dict)  # -> (dtype, bytes, file)

    @property
    def experts(self) -> int:
        return 1 + max((n.expert for n in self.tensors), default=-1)

    @property
    def parts(self) -> int:
        return 1 + max((n.part for n in self.tensors), default=-1)


@dataclass
class KtAmxDir:
    path: str
    files: list[str]
    layers: dict[int, KtAmxLayer]
    other: int  # tensors that are not experts (upstream's converter adds the non-expert weights renamed)

    @property
    def parts(self) -> set[int]:
        return {la.parts for la in self.layers.values()}

    @property
    def experts(self) -> set[int]:
        return {la.experts for la in self.layers.values()}

    def missing(self, layer: int, experts: int, parts: int) -> list[str]:
        """Names of the expert tensors this layer should have and lacks."""
        la = self.layers.get(layer)
        have = la.tensors if la else {}
        if len(have) == len(PROJS) * experts * parts * 2 and la.experts <= experts and la.parts <= parts:
            return []  # unique names inside exactly that index space: all there (180k names: skip the listing)
        out = []
        for p in PROJS:
            for e in range(experts):
                for n in range(parts):
                    for kind in ("weight", "scale"):
                        key = KtAmxName(layer, p, e, n, kind)
                        if key not in have:
                            out.append(tensor_name(*key))
        return out

    def bits(self, hidden: int, inter: int) -> int | None:
        """8 or 4 from the byte size of the first up weight part ((I/P) x H values), None if neither fits."""
        for la in self.layers.values():
            parts = la.parts
            for name, (_dtype, nbytes, _f) in la.tensors.items():
                if name.proj == "up" and name.kind == "weight" and parts and inter % parts == 0:
                    values = inter // parts * hidden
                    return 8 if nbytes == values else 4 if nbytes * 2 == values else None
        return None


def looks_like_ktamx(path) -> bool:
    p = Path(path)
    return p.is_dir() and any(p.rglob("*.safetensors")) and not any(p.glob("*.gguf"))


def header_entries(f: Path) -> tuple:
    """The tensor entries of one safetensors file's header (validated against the file size; no data read)."""

    if f.stat().st_size == 0:
        raise InputError("empty file", path=str(f), fix="the conversion did not finish: write it again")
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return parse_safetensors_header(mm, str(f)).entries


def scan_ktamx_dir(path) -> KtAmxDir:
    """Read every ``*.safetensors`` header under ``path`` (recursively, as kt-kernel walks it)."""
    root = Path(path)
    if not root.is_dir():
        raise InputError("not a directory", path=str(root), fix="a kt-amx weight path is a directory of .safetensors")
    files = sorted(root.rglob("*.safetensors"))
    if not files:
        raise InputError("no .safetensors files (kt-kernel would look for a _layer_L/_numa_N/*.kt tree)",
                         path=str(root), fix="pass the directory the kt-amx converter wrote")
    layers: dict[int, KtAmxLayer] = {}
    other = 0
    for f in files:
        for entry in header_entries(f):
            name = parse_ktamx_name(entry.name)
            if name is None:
                other += 1
                continue
            la = layers.setdefault(name.layer, KtAmxLayer(name.layer))
            if name in la.tensors:
                raise InputError(f"tensor also in {la.tensors[name][2]}", path=str(f), where=entry.name,
                                 fix="remove the stale shard")
            la.tensors[name] = (entry.dtype, entry.end - entry.begin, str(f))
    return KtAmxDir(str(root), [str(f) for f in files], layers, other)
