"""Turn what a user points at (a file, a directory, an index, one shard of a split GGUF) into a list of files.

Unlike upstream loaders, nothing is mixed in silently: a directory holding unrelated GGUF files, both safetensors and
GGUF, or an incomplete shard set is refused with a message that says which file to name instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ktconvert.errors import InputError
from ktconvert.formats.sniff import RESAVE_FIX, describe, sniff
from ktconvert.io.datafile import read_json
from ktconvert.io.files import regular_file_size

SPLIT_GGUF = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Source:
    """The files of one checkpoint. ``weight_map`` is the index's tensor -> shard map when there is an index."""

    path: Path
    container: str  # "safetensors" | "gguf"
    files: tuple[Path, ...]
    index: Path | None = None
    weight_map: dict[str, str] | None = None
    config: Path | None = None


def resolve(path: str | Path) -> Source:
    p = Path(path)
    if not p.exists():
        raise InputError("no such file or directory", path=str(p), fix="check the path")
    if p.is_dir():
        return _from_dir(p)
    regular_file_size(p, "checkpoint file", fix="pass the checkpoint file or its directory")
    config = p.parent / "config.json"
    config = config if config.is_file() else None
    name = p.name
    if name.endswith(INDEX_SUFFIX):
        return _from_index(p, config)
    if name.endswith(".gguf"):
        return Source(p, "gguf", _gguf_set(p), config=config)
    if name.endswith(".safetensors"):
        return Source(p, "safetensors", (p,), config=config)
    kind = _sniff_file(p)
    if kind == "gguf":
        return Source(p, "gguf", (p,), config=config)
    if kind in ("zip", "pickle"):
        raise InputError(f"this is {describe(kind)}, not a checkpoint ktconvert reads", path=str(p), where="byte 0", fix=RESAVE_FIX)
    return Source(p, "safetensors", (p,), config=config)


def _sniff_file(p: Path) -> str | None:
    try:
        with open(p, "rb") as fh:
            return sniff(fh.read(16))
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", path=str(p), fix="check permissions") from None


def _from_dir(d: Path) -> Source:
    config = d / "config.json"
    config = config if config.is_file() else None
    indexes = sorted(d.glob("*" + INDEX_SUFFIX))
    if len(indexes) > 1:
        preferred = d / ("model" + INDEX_SUFFIX)
        if preferred not in indexes:
            raise InputError(
                f"several index files: {', '.join(i.name for i in indexes)}",
                path=str(d),
                fix="pass the index you mean",
            )
        indexes = [preferred]
    if indexes:
        return _from_index(indexes[0], config)
    st = sorted(f for f in d.glob("*.safetensors") if f.is_file())
    gg = sorted(f for f in d.glob("*.gguf") if f.is_file())
    if st and gg:
        raise InputError(
            f"directory holds both safetensors ({st[0].name}, ...) and GGUF ({gg[0].name}, ...) files",
            path=str(d),
            fix="pass the file you mean",
        )
    if st:
        return Source(d, "safetensors", tuple(st), config=config)
    if gg:
        sets = {_set_key(f) for f in gg}
        if len(sets) > 1:
            raise InputError(
                f"directory holds {len(sets)} unrelated GGUF files or sets ({', '.join(sorted(f.name for f in gg)[:4])}"
                f"{', ...' if len(gg) > 4 else ''})",
                path=str(d),
                fix="pass the file (or first shard) you mean",
            )
        return Source(d, "gguf", _gguf_set(gg[0]), config=config)
    pickles = [f.name for f in d.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    raise InputError(
        "no .safetensors, .gguf or *.safetensors.index.json files here"
        + (f" (only PyTorch pickles such as {pickles[0]})" if pickles else ""),
        path=str(d),
        fix=RESAVE_FIX if pickles else "point at a checkpoint file or directory",
    )


def _set_key(f: Path) -> str:
    m = SPLIT_GGUF.match(f.name)
    return f"{m['stem']}-of-{m['count']}" if m else f.name


def _gguf_set(p: Path) -> tuple[Path, ...]:
    """All shards of the split set ``p`` belongs to (``p`` alone when it is not a shard), checking none is missing."""
    m = SPLIT_GGUF.match(p.name)
    if not m:
        return (p,)
    count = int(m["count"])
    if count < 1 or int(m["no"]) < 1 or int(m["no"]) > count:
        raise InputError(f"shard number {m['no']} of {m['count']} is impossible", path=str(p), fix="rename the file")
    files = [p.parent / f"{m['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise InputError(
            f"split GGUF set is incomplete: {len(missing)} of {count} shards missing ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''})",
            path=str(p),
            fix="download the missing shards into the same directory",
        )
    return tuple(files)


def _from_index(index: Path, config: Path | None) -> Source:
    size = index.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise InputError(f"index is {size} bytes, too large to be an index", path=str(index), fix="check the file")
    obj = read_json(index, "index", fix="re-download it", obj=False)
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise InputError(
            "index has no weight_map of tensor name -> shard file name",
            path=str(index),
            where="weight_map",
            fix="re-download the index",
        )
    shards: list[str] = []
    for tensor, shard in wm.items():
        pure = PurePosixPath(shard)
        if pure.is_absolute() or ".." in pure.parts or "\\" in shard or not shard:
            raise InputError(
                f"shard name {shard!r} points outside the checkpoint directory",
                path=str(index),
                where=f"tensor {tensor}",
                fix="shard names must be plain file names next to the index",
            )
        if shard not in shards:
            shards.append(shard)
    files = [index.parent / s for s in shards]
    missing = [s for s, f in zip(shards, files) if not f.exists()]
    if missing:
        first = next(t for t, s in wm.items() if s == missing[0])
        raise InputError(
            f"index names {len(missing)} shard file(s) that do not exist: {', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}",
            path=str(index),
            where=f"tensor {first}",
            fix="download the missing shards next to the index",
        )
    for f in files:
        regular_file_size(f, "shard", fix="the index must name shard files")
    return Source(index, "safetensors", tuple(files), index=index, weight_map=dict(wm), config=config)
