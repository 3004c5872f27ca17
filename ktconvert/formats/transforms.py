"""llama.cpp's changes to a tensor's values and layout on its way from Hugging Face to GGUF, as segments.

A naming map's ``transform`` (schema: ``naming-map.schema.json``) says what ``convert_hf_to_gguf`` does to one
tensor beyond renaming it: an elementwise ``value`` map (zero-centred norms gain 1, ``A_log`` becomes
``-exp(A_log)``), ``squeeze`` (size-1 axes dropped), ``unsqueeze`` (size-1 axes inserted: KDA conv kernels
``[C, 1, K]`` -> ``[1, C, 1, K]``) and ``v_heads``: linear attention's value heads reordered
from grouped by key head (``[g0v0, g0v1, g1v0, g1v1]``) to tiled (``[g0v0, g1v0, g0v1, g1v1]``), which llama.cpp
broadcasts against the key heads. Row reorders become ``rows`` segments (one per head), so bytes are still read
row by row; a column reorder and a value map ride on the segments (``col_tile``, ``value``) and the worker applies
them after decoding. :func:`undo` is the inverse on a whole stored array, for reading such a GGUF back into the
reference model (verify). :func:`apply` reads no tensor data.

:func:`apply` (convert) reads the sizes it needs from the checkpoint's config.json dict; :func:`undo`, :func:`redo`
and :func:`join_qkvz` take the parsed Gated DeltaNet sizes (``MoeConfig.attention.linear``).

Two transforms make several GGUF tensors of one HF tensor (:data:`SPLITS`; the naming map has one entry per part):
``kv_b_split`` (MLA's ``kv_b_proj`` as ``attn_k_b`` / ``attn_v_b``) and ``qkvz_split`` (Qwen3-Next's ``in_proj_qkvz``,
per key head ``[q, k, its value heads, their z]``, as ``attn_qkv`` = every q, every k, every value head, and
``attn_gate`` = every z: row gathers). :func:`join_qkvz` puts the latter back together.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ktconvert.errors import InputError
from ktconvert.arch.gated_deltanet import LinearAttentionDims


#: transforms that make one of several GGUF tensors from one HF tensor
SPLITS = ("kv_b_split", "qkvz_split")


def splits(transform) -> bool:
    """Whether ``transform`` (a dict or a naming map's sorted pairs) is one part of a split HF tensor."""
    return any(k in dict(transform) for k in SPLITS)


def tiled_order(k_heads: int, per_k: int) -> list[int]:
    """Source head of each output head: output ``r * k_heads + g`` is source ``g * per_k + r``."""
    return [g * per_k + r for r in range(per_k) for g in range(k_heads)]


def tile_columns(rows: np.ndarray, col_tile: tuple[int, ...]) -> np.ndarray:
    """``rows [N, C]`` with their columns reordered as a segment's ``col_tile`` says (value heads grouped by key
    head -> tiled); a new array."""
    nk, per_k, width = col_tile
    return rows.reshape(rows.shape[0], nk, per_k, width).transpose(0, 2, 1, 3).reshape(rows.shape)


def apply(name: str, shape: tuple[int, ...], transform: dict, config: dict | None, seg, where: str):
    """``(shape, segments)`` of the GGUF tensor made from HF tensor ``name`` (``seg``: its plain one-segment copy)."""
    if not transform:
        return shape, (seg,)
    if transform.get("kv_b_split"):
        return _kv_b_split(transform["kv_b_split"], shape, config, seg, where)
    if transform.get("qkvz_split"):
        return _qkvz_split(transform["qkvz_split"], shape, config, seg, where)
    shape = _reshaped(shape, transform)
    segs = (replace(seg, value=transform.get("value", "")),)
    kind = transform.get("v_heads")
    if kind:
        nk, nv, kd, vd = _dims(_linear_dims(config, where), where)
        if nv != nk:  # equal counts: grouped and tiled are the same order
            segs = _v_heads(kind, segs[0], shape, nk, nv // nk, kd, vd, name, where)
    return shape, segs


def _reshaped(shape: tuple[int, ...], transform: dict) -> tuple[int, ...]:
    """``squeeze`` (size-1 axes dropped), then ``unsqueeze`` (size-1 axes inserted at those positions, in increasing
    order): layout only, the bytes keep their order."""
    shape = tuple(shape)
    if transform.get("squeeze"):
        shape = tuple(d for d in shape if d != 1) or (1,)
    for axis in sorted(transform.get("unsqueeze") or ()):
        shape = shape[:axis] + (1,) + shape[axis:]
    return shape


def _mla_dims(config: dict | None, shape, where: str) -> tuple[int, int, int, int]:
    from ktconvert.families import text_view

    c = text_view(config or {})
    vals = [c.get(k) for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank")]
    if any(type(v) is not int or v <= 0 for v in vals) or tuple(shape) != (vals[0] * (vals[1] + vals[2]), vals[3]):
        raise InputError(f"kv_b_proj {list(shape)} is not [num_attention_heads x (qk_nope_head_dim + v_head_dim), "
                         "kv_lora_rank] for config.json", where=where, fix="pass --config with the model's config.json")
    return tuple(vals)


def _kv_b_split(part: str, shape, config, seg, where: str):
    heads, nope, v, rank = _mla_dims(config, shape, where)
    if part == "v_b":  # [heads, v, rank]: each head's last v rows
        return (heads, v, rank), tuple(replace(seg, start=h * v, rows=v, src_row=h * (nope + v) + nope)
                                       for h in range(heads))
    # k_b [heads, rank, nope]: each head's first nope rows, transposed
    return (heads, rank, nope), tuple(replace(seg, start=h * rank, rows=rank, op="block_t", src_row=h * (nope + v),
                                              t_rows=nope) for h in range(heads))


def _qkvz_rows(part: str, nk: int, kd: int, pv: int) -> list[tuple[int, int, int]]:
    """``(output row, rows, source row)`` runs of ``attn_qkv`` (``part`` qkv) or ``attn_gate`` (z) in ``in_proj_qkvz``,
    whose key head ``g`` holds rows ``[q kd, k kd, v pv, z pv]`` from ``g * (2 kd + 2 pv)``."""
    group = 2 * kd + 2 * pv
    if part == "z":
        return [(g * pv, pv, g * group + 2 * kd + pv) for g in range(nk)]
    return ([(g * kd, kd, g * group) for g in range(nk)]
            + [(nk * kd + g * kd, kd, g * group + kd) for g in range(nk)]
            + [(2 * nk * kd + g * pv, pv, g * group + 2 * kd) for g in range(nk)])


def _qkvz_dims(shape, linear: LinearAttentionDims | None, where: str) -> tuple[int, int, int]:
    nk, nv, kd, vd = _dims(linear, where)
    pv = nv // nk * vd
    if len(shape) != 2 or shape[0] != nk * (2 * kd + 2 * pv):
        raise InputError(f"in_proj_qkvz {list(shape)} is not [linear_num_key_heads x (2 x linear_key_head_dim + 2 x "
                         f"value heads per key head x linear_value_head_dim), hidden] = [{nk * (2 * kd + 2 * pv)}, H] "
                         "for config.json", where=where, fix="pass --config with the model's config.json")
    return nk, kd, pv


def _qkvz_split(part: str, shape, config, seg, where: str):
    nk, kd, pv = _qkvz_dims(shape, _linear_dims(config, where), where)
    runs = _qkvz_rows(part, nk, kd, pv)
    return (sum(n for _, n, _ in runs), shape[1]), tuple(replace(seg, start=a, rows=n, src_row=src) for a, n, src in runs)


def join_qkvz(qkv: np.ndarray, z: np.ndarray, linear: LinearAttentionDims | None, where: str) -> np.ndarray:
    """``in_proj_qkvz`` rebuilt from llama.cpp's ``attn_qkv`` and ``attn_gate`` (the inverse of ``qkvz_split``)."""
    shape = (qkv.shape[0] + z.shape[0], qkv.shape[1])
    nk, kd, pv = _qkvz_dims(shape, linear, where)
    out = np.empty(shape, dtype=np.float32)
    for part, arr in (("qkv", qkv), ("z", z)):
        for a, n, src in _qkvz_rows(part, nk, kd, pv):
            out[src:src + n] = arr[a:a + n]
    return out


_LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


def _linear_dims(config: dict | None, where: str) -> LinearAttentionDims | None:
    """The Gated DeltaNet sizes of a checkpoint's config.json dict (convert reads no parsed config), None when they
    are missing or wrong (:func:`_dims` refuses them)."""
    from ktconvert.families import text_view

    c = text_view(config or {})
    vals = [c.get(k) for k in _LINEAR_KEYS]
    if any(type(v) is not int or v <= 0 for v in vals):
        return None
    return LinearAttentionDims(*vals, conv_kernel=0)


def _dims(linear: LinearAttentionDims | None, where: str) -> tuple[int, int, int, int]:
    vals = (None,) * 4 if linear is None else (linear.num_key_heads, linear.num_value_heads, linear.key_head_dim,
                                               linear.value_head_dim)
    if None in vals or vals[1] % vals[0]:
        raise InputError(f"config.json needs {', '.join(_LINEAR_KEYS)} (value heads a multiple of key heads) to "
                         "reorder linear attention's value heads as llama.cpp does", where=where,
                         fix="pass --config with the model's config.json")
    return vals


def _v_heads(kind, seg, shape, nk, per_k, kd, vd, name, where):
    order = tiled_order(nk, per_k)
    rows = seg.rows
    if kind in ("scalar_cols", "value_cols"):
        width = 1 if kind == "scalar_cols" else vd
        if shape[-1] != nk * per_k * width:
            raise InputError(f"{shape[-1]} columns are not {nk * per_k} value heads of {width}", where=where)
        return (replace(seg, col_tile=(nk, per_k, width)),)
    head = 1 if kind == "scalar_rows" else vd
    lead = 2 * nk * kd if kind == "qkv_value_rows" else 0
    if rows != lead + nk * per_k * head:
        raise InputError(f"{rows} rows of {name} are not {lead} q/k rows and {nk * per_k} value heads of {head}",
                         where=where, fix="check the linear_* keys of config.json")
    out = [replace(seg, start=0, rows=lead, src_row=0)] if lead else []
    for i, src in enumerate(order):
        out.append(replace(seg, start=lead + i * head, rows=head, src_row=lead + src * head))
    return tuple(out)


def redo(arr: np.ndarray, transform: dict, linear: LinearAttentionDims | None, where: str) -> np.ndarray:
    """``transform`` applied to a whole Hugging Face array (the inverse of :func:`undo`; writers of test GGUFs)."""
    out = np.array(arr, dtype=np.float32)
    if transform.get("qkvz_split"):
        nk, kd, pv = _qkvz_dims(out.shape, linear, where)
        return np.concatenate([out[src:src + n] for _, n, src in _qkvz_rows(transform["qkvz_split"], nk, kd, pv)])
    out = out.reshape(_reshaped(out.shape, transform))
    kind = transform.get("v_heads")
    if kind:
        nk, nv, kd, vd = _dims(linear, where)
        if nv // nk > 1:
            out = _untile(out, kind, nv // nk, nk, kd, vd, forward=True)
    if transform.get("value") == "add_one":
        out = out + np.float32(1.0)
    elif transform.get("value") == "neg_exp":
        out = -np.exp(out)
    return out


def undo(arr: np.ndarray, transform: dict, linear: LinearAttentionDims | None, where: str) -> np.ndarray:
    """The Hugging Face values of a GGUF tensor that ``transform`` made (size-1 axes are left to the caller)."""
    out = np.array(arr, dtype=np.float32)
    kind = transform.get("v_heads")
    if kind:
        nk, nv, kd, vd = _dims(linear, where)
        per_k = nv // nk
        if per_k > 1:
            out = _untile(out, kind, nk, per_k, kd, vd)
    if transform.get("value") == "add_one":
        out = out - np.float32(1.0)
    elif transform.get("value") == "neg_exp":
        out = np.log(-out)
    return out


def _untile(a: np.ndarray, kind: str, nk: int, per_k: int, kd: int, vd: int, forward: bool = False) -> np.ndarray:
    """Value heads tiled -> grouped: ``[per_k, nk]`` head blocks swapped to ``[nk, per_k]``. ``forward`` (called
    with the two counts exchanged) is grouped -> tiled: the same swap of the other block shape."""
    key_heads = per_k if forward else nk  # the q/k rows ahead of the value rows belong to the key heads
    if kind in ("scalar_cols", "value_cols"):
        width = 1 if kind == "scalar_cols" else vd
        lead = a.shape[:-1]
        return a.reshape(*lead, per_k, nk, width).swapaxes(-3, -2).reshape(a.shape)
    head = 1 if kind == "scalar_rows" else vd
    lead = 2 * key_heads * kd if kind == "qkv_value_rows" else 0
    flat = a.reshape(a.shape[0], -1)
    v = flat[lead:].reshape(per_k, nk, head, -1).swapaxes(0, 1).reshape(-1, flat.shape[1])
    return np.concatenate([flat[:lead], v]).reshape(a.shape)
