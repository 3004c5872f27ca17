"""``quantize --to kt-amx --type AMXINT8 --form kt-tree``: kt-kernel's persistent INT8 tree for SFT.

kt-kernel's INT8 SFT method reads only the ``.kt`` tree (never the merged safetensors), validated completely
before any load, and its validator refuses every root entry but ``kt-weight-manifest.json`` and the layer folders.
So the tree is made from the merged kt-amx conversion (same bytes, one tensor per file, so it is the merged form
by construction), written atomically, and ktconvert's own manifest (source, recipe, plan, the kt manifest's
sha256) is written *beside* the tree as ``OUT.manifest.json``; the kt manifest's ``producer`` field names it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from ktconvert import __version__
from ktconvert.errors import InputError, UsageProblem
from ktconvert.formats import open_checkpoint
from ktconvert.formats.kt_amx import parse_name
from ktconvert.formats.kt_tree import LAYOUT, MANIFEST, file_name
from ktconvert.io.atomic import atomic_dir, write_durable


def side_manifest(out: Path) -> Path:
    """Where ktconvert's manifest of a tree goes: beside it, ``OUT.manifest.json``."""
    return out.parent / f"{out.name}.manifest.json"


def scratch_dir(out: Path) -> Path:
    """The hidden merged kt-amx conversion the tree is cut from (kept only while an interrupted run can resume)."""
    return out.parent / f".{out.name}.kt-amx-merged"


def check_tree_paths(out: Path, force: bool) -> None:
    side = side_manifest(out)
    if side.exists() and not force:
        raise UsageProblem("ktconvert's manifest of an earlier tree is here", path=str(side),
                           fix="pass --force to replace it, or choose a new OUT")


def write_tree(merged: Path, out: Path, *, force: bool) -> dict:
    """Cut the merged kt-amx directory ``merged`` into the tree ``out``; return the kt manifest written."""
    ck = open_checkpoint(merged)
    by_layer: dict[int, list] = {}
    for name in ck:
        n = parse_name(name)
        if n is not None:
            by_layer.setdefault(n.layer, []).append(n)
    if not by_layer:
        raise InputError("no kt-amx expert tensors", path=str(merged), fix="convert a MoE checkpoint")
    parts = 1 + max(n.part for ns in by_layer.values() for n in ns)
    experts = 1 + max(n.expert for ns in by_layer.values() for n in ns)
    L0 = min(by_layer)
    hidden = ck[f"blk.{L0}.ffn_down_exps.0.numa.0.scale"].nbytes // 4
    inter = ck[f"blk.{L0}.ffn_up_exps.0.numa.0.scale"].nbytes // 4 * parts
    layers, total = [], 0
    with atomic_dir(out, force=force) as tmp:
        for L in sorted(by_layer):
            files, lbytes = [], 0
            for n in sorted(by_layer[L], key=lambda n: (n.part, n.proj, n.expert, n.kind)):
                name = f"blk.{n.layer}.ffn_{n.proj}_exps.{n.expert}.numa.{n.part}.{n.kind}"
                data = ck.read(name).tobytes()
                rel = f"_layer_{L}/_numa_{n.part}/{file_name(n.proj, n.expert, len(data), n.kind)}"
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(data)
                files.append({"path": rel, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
                lbytes += len(data)
            layers.append({"index": L, "state": "ready", "numa_count": parts, "files": files, "bytes": lbytes})
            total += lbytes
        manifest = {"schema_version": 2, "state": "ready", "expert_weight_format": "int8", "threadpool_count": parts,
                    "expert_num": experts, "hidden_size": hidden, "intermediate_size": inter, "layout": LAYOUT,
                    "backend": "INT8", "layers": layers, "bytes": total,
                    "producer": {"name": "ktconvert", "version": __version__,
                                 "manifest": f"../{side_manifest(out).name}"}}
        write_durable(tmp / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return manifest


def finish_tree(run_manifest: dict, merged: Path, out: Path, kt_manifest: dict) -> dict:
    """ktconvert's manifest of the tree, written beside it; the merged scratch directory removed."""
    data = (out / MANIFEST).read_bytes()
    side = {**{k: v for k, v in run_manifest.items() if k not in ("files", "tensors")},
            "form": "kt-tree",
            "files": {MANIFEST: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}},
            "kt_tree": {"layers": [la["index"] for la in kt_manifest["layers"]], "files":
                        sum(len(la["files"]) for la in kt_manifest["layers"]), "bytes": kt_manifest["bytes"],
                        "note": f"every .kt file's size and sha256 are in {MANIFEST}; kt-kernel's validator refuses "
                                "any other entry in the tree, so this manifest lives beside it"}}
    write_durable(side_manifest(out), (json.dumps(side, indent=2) + "\n").encode())
    shutil.rmtree(merged, ignore_errors=True)
    return side
