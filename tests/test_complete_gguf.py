"""A GGUF alone (no config.json beside it, no --config) is complete or refused too (issue 31): its own metadata
settles the layer count (``{arch}.block_count``), and every layer of every family holds the norm before its mixer and
the norm before its FFN (``arch.tensors.LAYER_NORMS``); every model holds the embeddings and the output norm; a
layer holding routed experts holds a router. Taking any of those away from the tiny model of each family, as
ktconvert writes it, is refused by quantize (exit 3, one line naming the tensor and the file, nothing written) and
reported by inspect (exit 1)."""

from __future__ import annotations

import os
import shutil

import gguf
import pytest
from click.testing import CliRunner

from ktconvert.cli import cli
from ktconvert.families import FAMILIES
from ktconvert.arch.tensors import LAYER_NORMS, MODEL_WIDE
from ktconvert.formats.checkpoint import open_checkpoint
from ktconvert.formats.completeness import missing_everywhere
from ktconvert.formats.gguf_write import encode_kv, layout_gguf, raw_kv_pairs
from ktconvert.formats.layout import detect_layout
from ktconvert.formats.naming import naming_maps


def _rewrite(src, dst, drop: str | None = None, kv: dict | None = None):
    """``src`` rewritten without tensor ``drop`` and with the uint32 KV pairs ``kv`` replaced or appended: every
    other KV pair byte for byte, every other tensor's bytes."""
    pairs = dict(raw_kv_pairs(src))
    for key, value in (kv or {}).items():
        pairs[key] = encode_kv(key, gguf.GGUFValueType.UINT32, value)
    reader = gguf.GGUFReader(str(src))
    tensors = [t for t in reader.tensors if t.name != drop]
    assert drop is None or len(tensors) == len(reader.tensors) - 1, drop
    header, slots, size = layout_gguf(list(pairs.items()),
                                      [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.n_bytes))
                                       for t in tensors])
    with open(dst, "wb") as f:
        f.write(header)
        for t, slot in zip(tensors, slots):
            f.seek(slot.offset)
            f.write(bytes(t.data.view("uint8").reshape(-1)))
        f.truncate(size)
    return dst


def _without(src, dst, drop: str):
    return _rewrite(src, dst, drop)


@pytest.fixture(scope="module")
def ggufs(tiny_root, tmp_path_factory):
    """Each family's tiny model as ktconvert writes it (F32), copied alone into a directory of its own."""
    root = tmp_path_factory.mktemp("gguf-alone")

    def get(family: str):
        alone = root / family / "model.gguf"
        if not alone.exists():
            out = root / f"{family}-out"
            res = CliRunner().invoke(cli, ["quantize", str(tiny_root / family), str(out), "--type", "F32"])
            assert res.exit_code == 0, res.output
            alone.parent.mkdir()
            shutil.copyfile(out / "model.gguf", alone)
            shutil.rmtree(out)
        return alone

    return get


def _required(rep) -> set[str]:
    """The llama.cpp names the metadata-only check requires of this GGUF, listed independently of it."""
    nm = naming_maps()[rep.arch]
    names = [*MODEL_WIDE, *(f"model.layers.{L}.{n}" for L in range(rep.dims.n_layers) for n in LAYER_NORMS)]
    want = {m.gguf_name for m in map(nm.lookup, names) if m is not None}
    routers = {f"blk.{ly.layer}.ffn_gate_inp.weight" for ly in rep.layers if ly.layout}  # llama.cpp's router
    shared = set()
    if _shared(rep):  # llama.cpp's shared-expert tensors, and the Qwen shared expert's gate
        shared = {n for ly in rep.layers if ly.layout for n in rep.matches
                  if n.startswith(f"blk.{ly.layer}.ffn_") and "_shexp." in n}
        assert shared
    return want | routers | shared


def _shared(rep) -> bool:
    return bool(rep.dims.n_shared_experts or rep.dims.shared_expert_width)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_alone_complete_and_each_everywhere_tensor_required(ggufs, family):
    path = ggufs(family)
    assert os.listdir(path.parent) == ["model.gguf"]
    ck = open_checkpoint(path)
    assert ck.config is None
    rep = detect_layout(ck)
    assert not [p for p in rep.all_problems if p.id == "missing-tensor"], rep.all_problems
    n = rep.dims.n_layers
    assert n and n == rep.n_layers
    required = _required(rep)
    # embeddings, output norm, two norms per layer, at least one router
    assert len(required) > 2 + 2 * n and required <= set(ck), sorted(required - set(ck))
    experts = {ly.layer for ly in rep.layers if ly.layout}
    assert missing_everywhere(rep.arch, n, experts, rep.matches, _shared(rep)) == []
    for name in sorted(required):
        without = {k: v for k, v in rep.matches.items() if k != name}
        got = missing_everywhere(rep.arch, n, experts, without, _shared(rep))
        assert [t[1] for t in got] == [name], f"{family}: {name} is not required ({got})"


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_alone_missing_layer_norm_refused(ggufs, tmp_path, family):
    """Removing ``blk.0.attn_norm.weight`` (or the family's name for layer 0's first norm) from the GGUF alone."""
    src = ggufs(family)
    arch = open_checkpoint(src).architecture
    drop = naming_maps()[arch].lookup(f"model.layers.0.{LAYER_NORMS[0]}").gguf_name
    cut = _without(src, tmp_path / "cut.gguf", drop)
    res = CliRunner().invoke(cli, ["inspect", str(cut)])
    assert res.exit_code == 1 and "[missing-tensor]" in res.output and drop in res.output, res.output
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["quantize", str(cut), str(out), "--type", "Q8_0"])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 3 and len(lines) == 1, res.output
    assert drop in lines[0] and "cut.gguf" in lines[0] and "missing" in lines[0], lines
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


@pytest.mark.parametrize("family,drop", [("qwen3_moe", "token_embd.weight"), ("qwen3_moe", "output_norm.weight"),
                                         ("qwen3_moe", "blk.1.ffn_norm.weight"), ("qwen3_moe", "blk.1.ffn_gate_inp.weight"),
                                         ("deepseek_v3", "blk.1.ffn_up_shexp.weight"),
                                         ("qwen2_moe", "blk.0.ffn_gate_inp_shexp.weight")])
def test_gguf_alone_missing_tensor_refused(ggufs, tmp_path, family, drop):
    cut = _without(ggufs(family), tmp_path / "cut.gguf", drop)
    res = CliRunner().invoke(cli, ["inspect", str(cut)])
    assert res.exit_code == 1 and "[missing-tensor]" in res.output and drop in res.output, res.output
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["quantize", str(cut), str(out), "--type", "F32"])
    assert res.exit_code == 3 and drop in res.stderr and "cut.gguf" in res.stderr, res.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


def test_gguf_alone_output_head_not_required(ggufs, tmp_path):
    """A GGUF without output.weight is a tied model to llama.cpp (it reads token_embd): not refused."""
    cut = _without(ggufs("qwen3_moe"), tmp_path / "cut.gguf", "output.weight")
    rep = detect_layout(open_checkpoint(cut))
    assert not [p for p in rep.all_problems if p.id == "missing-tensor"], rep.all_problems


# the families whose tiny model the pinned convert_hf_to_gguf.py converts (the others: its tokenizer or config
# handling refuses the tiny models, e.g. GLM's [gMASK], Mixtral's sentencepiece), and DeepSeek-V4 as released
# (``tiny-model --quant mxfp4``, the form its converter reads)
LLAMACPP_CONVERTS = ("qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "qwen3_vl_moe", "minimax_m2",
                     "kimi_k25", "gpt_oss", "deepseek_v4:mxfp4")


@pytest.mark.interop
@pytest.mark.parametrize("family", LLAMACPP_CONVERTS)  # about 8 s each
def test_llamacpp_converter_gguf_alone(tiny_root, tmp_path, family):
    """llama.cpp's own converter output for each tiny model it converts: accepted alone, each tensor the check
    covers required, and refused by quantize without layer 1's first norm (skipped where the converter cannot be
    had, required under CI)."""
    import ggml_ref
    import llamacpp_convert

    from ktconvert.model.tiny import write_tiny_model

    family, _, quant = family.partition(":")
    src = tiny_root / family
    if quant:
        src = tmp_path / "release"
        write_tiny_model(family, src, quant=quant)
    try:
        theirs = llamacpp_convert.convert(src, tmp_path / "llama.gguf")
    except ggml_ref.RefUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"llama.cpp's converter required under CI: {exc}")
        pytest.skip(str(exc))
    ck = open_checkpoint(theirs)
    assert ck.config is None
    rep = detect_layout(ck)
    assert not [p for p in rep.all_problems if p.id == "missing-tensor"], rep.all_problems
    experts = {ly.layer for ly in rep.layers if ly.layout}
    for name in sorted(_required(rep)):
        without = {k: v for k, v in rep.matches.items() if k != name}
        got = missing_everywhere(rep.arch, rep.dims.n_layers, experts, without, _shared(rep))
        assert [t[1] for t in got] == [name], f"{family}: {name} is not required ({got})"
    drop = naming_maps()[rep.arch].lookup(f"model.layers.1.{LAYER_NORMS[0]}").gguf_name
    cut = _without(theirs, tmp_path / "cut.gguf", drop)
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["quantize", str(cut), str(out), "--type", "Q8_0"])
    assert res.exit_code == 3 and drop in res.stderr and "cut.gguf" in res.stderr, res.output
    assert not out.exists()


def test_gguf_alone_mtp_layers_not_required(ggufs, tmp_path):
    """llama.cpp counts the MTP layers in block_count and says how many with nextn_predict_layers; a converter may
    leave their tensors out, so they are not required. block_count one past the layers held, unexplained, is."""
    src = ggufs("qwen3_moe")
    n = open_checkpoint(src).dims().n_layers
    mtp = _rewrite(src, tmp_path / "mtp.gguf", kv={"qwen3moe.block_count": n + 1, "qwen3moe.nextn_predict_layers": 1})
    rep = detect_layout(open_checkpoint(mtp))
    assert rep.dims.n_mtp_layers == 1
    assert not [p for p in rep.all_problems if p.id == "missing-tensor"], rep.all_problems
    more = _rewrite(src, tmp_path / "more.gguf", kv={"qwen3moe.block_count": n + 1})
    rep = detect_layout(open_checkpoint(more))
    assert [p.extra["tensors"] for p in rep.all_problems if p.id == "missing-tensor"] == \
        [(f"blk.{n}.attn_norm.weight", f"blk.{n}.ffn_norm.weight")], rep.all_problems
