"""kt-kernel's persistent INT8 expert tree for SFT: ``_layer_L/_numa_n/INT8_{gate|up|down}_{e}_{S}Byte_{quant|scale}_.kt``
(raw bytes, the kt-amx tensors one file each) under a root that holds nothing but ``kt-weight-manifest.json``
schema 2 (``docs/formats/kt-amx.md``, "--form kt-tree"). kt-kernel's INT8 SFT method reads only this form, and validates
all of it before loading: the root's entries, every file's name, size and sha256, per layer exactly
``P x E x 3 x 2`` files, sizes ``H x I/P`` (quant), ``4 x I/P`` (gate/up scale), ``4 x H`` (down scale).

:func:`check_kt_tree` checks the same contract (our own code; the tests prove it and the writer against kt-kernel's
validator) and returns what the tree holds, for ``inspect`` and preflight.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.io.atomic import sha256_file

MANIFEST = "kt-weight-manifest.json"
LEGACY_MANIFEST = "kt-ephemeral-manifest.json"
LAYOUT = "kt-int8-n32-k64-vnni-v1"  # kt_kernel.__int8_weight_layout__, the same for every CPU variant
FILE_RE = re.compile(r"^INT8_(gate|up|down)_(\d+)_(\d+)Byte_(quant|scale)_\.kt$")
PROJS = ("gate", "up", "down")


def file_name(proj: str, expert: int, nbytes: int, kind: str, tag: str = "INT8") -> str:
    """``INT8_{proj}_{expert}_{nbytes}Byte_{quant|scale}_.kt`` (kind ``weight`` is written ``quant``); ``tag`` INT4
    names the files kt-kernel's AMXInt4_MOE reads (the kernel child loads AMXINT8/AMXINT4 layers from such files)."""
    return f"{tag}_{proj}_{expert}_{nbytes}Byte_{'quant' if kind == 'weight' else kind}_.kt"


def expected_bytes(proj: str, kind: str, hidden: int, inter: int, parts: int) -> int:
    i_n = inter // parts
    if kind == "quant":
        return hidden * i_n
    return 4 * (hidden if proj == "down" else i_n)


@dataclass
class KtTree:
    path: str
    manifest: dict
    layers: list[int]
    experts: int
    hidden: int
    intermediate: int
    parts: int
    files: int
    bytes: int
    problems: list[str] = field(default_factory=list)


def is_kt_tree(path) -> bool:
    p = Path(path)
    return p.is_dir() and ((p / MANIFEST).is_file() or (p / LEGACY_MANIFEST).is_file()
                           or any(p.glob("_layer_*/_numa_*/*.kt")))


def check_kt_tree(path, *, verify_hashes: bool = True) -> KtTree:
    """The tree at ``path`` checked against its manifest and the size contract; a contract break raises
    :class:`InputError` naming the file or field."""
    root = Path(path)
    mp = root / MANIFEST
    if not mp.is_file():
        raise InputError(f"no {MANIFEST}" + (f" (only the schema-1 {LEGACY_MANIFEST}, which has no hashes)"
                                             if (root / LEGACY_MANIFEST).is_file() else ""), path=str(root),
                         fix="write the tree with ktconvert quantize --to kt-amx --type AMXINT8 --form kt-tree")
    try:
        man = json.loads(mp.read_text(encoding="utf-8"))
    except (OSError, UnicodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read: {exc}", path=str(mp), fix="write the tree again") from None
    if not isinstance(man, dict):
        raise InputError("not a JSON object", path=str(mp), fix="write the tree again")

    def bad(msg, where, fix="write the tree again"):
        raise InputError(msg, path=str(mp), where=where, fix=fix)

    for k, want in (("schema_version", 2), ("state", "ready"), ("expert_weight_format", "int8"), ("layout", LAYOUT)):
        if man.get(k) != want:
            bad(f"{man.get(k)!r}, kt-kernel wants {want!r}", k)
    if str(man.get("backend", "INT8")).strip().lower() not in ("int8", "auto"):
        bad(f"{man.get('backend')!r} is not hardware-neutral ('INT8' or 'auto')", "backend")
    ints = {}
    for k in ("threadpool_count", "expert_num", "hidden_size", "intermediate_size", "bytes"):
        v = man.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            bad(f"{v!r} is not a positive integer", k)
        ints[k] = v
    P, E, H, I = ints["threadpool_count"], ints["expert_num"], ints["hidden_size"], ints["intermediate_size"]
    if I % P:
        bad(f"intermediate_size {I} is not a multiple of threadpool_count {P}", "intermediate_size")
    layers = man.get("layers")
    if not isinstance(layers, list) or not layers:
        bad("must be a non-empty list", "layers")
    indices, total, nfiles = [], 0, 0
    for n, layer in enumerate(layers):
        if not isinstance(layer, dict) or not isinstance(layer.get("index"), int) or layer["index"] < 0:
            bad("needs a non-negative integer index", f"layers[{n}]")
        L = layer["index"]
        if L in indices:
            bad(f"layer {L} listed twice", f"layers[{n}]")
        indices.append(L)
        if layer.get("state") != "ready" or layer.get("numa_count") != P:
            bad(f"state {layer.get('state')!r}, numa_count {layer.get('numa_count')!r}; want 'ready', {P}",
                f"layers[{n}]")
        ldir = root / f"_layer_{L}"
        if ldir.is_symlink() or not ldir.is_dir():
            raise InputError("missing", path=str(ldir), fix="the tree is incomplete: write it again")
        numa = {p.name for p in ldir.iterdir()}
        if numa != {f"_numa_{i}" for i in range(P)}:
            raise InputError(f"holds {sorted(numa)}, want _numa_0.._numa_{P - 1}", path=str(ldir),
                             fix="the tree is incomplete or mixed: write it again")
        on_disk = {f.relative_to(root).as_posix(): f for f in ldir.glob("_numa_*/*")}
        listed, seen, lbytes = set(), set(), 0
        for rec in layer.get("files") or []:
            rel = rec.get("path") if isinstance(rec, dict) else None
            parts = Path(str(rel)).parts
            m = FILE_RE.match(parts[-1]) if len(parts) == 3 else None
            numa_m = re.fullmatch(r"_numa_(\d+)", parts[1]) if len(parts) == 3 else None
            if m is None or numa_m is None or parts[0] != f"_layer_{L}" or rel in listed:
                bad(f"unexpected, duplicate or misplaced path {rel!r}", f"layers[{n}].files")
            listed.add(rel)
            proj, e, size, kind = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
            want = expected_bytes(proj, kind, H, I, P)
            ident = (int(numa_m.group(1)), proj, e, kind)
            if e >= E or ident[0] >= P or ident in seen:
                bad(f"{rel}: expert or part out of range, or listed twice", f"layers[{n}].files")
            seen.add(ident)
            if size != want or rec.get("size_bytes") != want:
                bad(f"{rel}: name says {size} bytes, manifest {rec.get('size_bytes')}, H={H} I={I} P={P} make it "
                    f"{want}", f"layers[{n}].files")
            f = on_disk.get(rel)
            if f is None or not f.is_file() or f.is_symlink():
                raise InputError("listed in the manifest but missing", path=str(root / rel), fix="write the tree again")
            if f.stat().st_size != want:
                raise InputError(f"{f.stat().st_size} bytes, the manifest says {want}", path=str(f),
                                 fix="the file is truncated: write the tree again")
            if verify_hashes and rec.get("sha256") != sha256_file(f):
                raise InputError("sha256 differs from the manifest", path=str(f), fix="the file changed: write again")
            lbytes += want
        if len(seen) != P * E * 6:
            bad(f"layer {L} lists {len(seen)} files, kt-kernel wants {P * E * 6} (P x E x 3 x 2)", f"layers[{n}]")
        extra = sorted(set(on_disk) - listed)
        if extra:
            raise InputError("not listed in the manifest (kt-kernel refuses the tree)", path=str(root / extra[0]),
                             fix="remove it")
        if layer.get("bytes") != lbytes:
            bad(f"{layer.get('bytes')!r}, the files hold {lbytes}", f"layers[{n}].bytes")
        total += lbytes
        nfiles += len(seen)
    if total != ints["bytes"]:
        bad(f"{ints['bytes']}, the files hold {total}", "bytes")
    entries = {p.name for p in root.iterdir()}
    extra = sorted(entries - {MANIFEST} - {f"_layer_{L}" for L in indices})
    if extra:
        raise InputError("kt-kernel's validator refuses any root entry but the manifest and the layer folders",
                         path=str(root / extra[0]), fix="move it out of the tree")
    return KtTree(str(root), man, sorted(indices), E, H, I, P, nfiles, total)
