"""The naming maps: valid against their schema, and in agreement with gguf-py's own tables and with real saves."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from formats_helpers import FAMILIES, LAYERS, hf_checkpoint
from ktconvert.io import resources
from ktconvert.errors import InputError
from ktconvert.formats import guess_arch, load_naming_map, naming_map, naming_maps, open_checkpoint, to_gguf_name, to_hf_name

ARCHES = ("qwen2moe", "qwen3moe", "deepseek2", "llama", "glm4moe", "minimax-m2", "gpt-oss", "qwen35moe", "qwen3vlmoe",
          "glm-dsa", "deepseek32", "qwen3next")
# gguf 0.19.0 (the pinned gguf-py) predates llama.cpp's minimax-m3, deepseek4 and glm5-next: their maps' names are
# checked against the gguf-py llama.cpp 0.3.36 ships (test_maps_gguf_py_lacks_are_names_llama_cpps_own_gguf_py_knows) and
# against llama.cpp 0.3.36's converter tables (glm5-next, below), and are proven by llama.cpp loading our GGUFs
NOT_IN_GGUF_PY = ("minimax-m3", "deepseek4", "glm5-next")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("naming")


def test_shipped_maps_load_through_the_package_data_locator():
    files = sorted(p.name for p in (resources.rules_dir() / "naming").glob("*.yaml"))
    assert files == sorted(f"{a}.yaml" for a in ARCHES + NOT_IN_GGUF_PY)
    assert set(naming_maps()) == set(ARCHES + NOT_IN_GGUF_PY)
    assert resources.load_schema("naming-map")["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    for model_type, (_, _, arch, _) in FAMILIES.items():
        assert naming_map(model_type).arch == arch


def test_schema_is_a_valid_2020_12_schema_and_maps_name_their_kind():
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(resources.load_schema("naming-map"))
    for f in (resources.rules_dir() / "naming").glob("*.yaml"):
        assert yaml.safe_load(f.read_text())["kind"] == "naming-map"  # how check-rules finds the schema


def _gguf_arch(arch):
    import gguf

    found = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), None)
    if found is None:  # deepseek32: its names are proven by llama.cpp loading our GGUFs (test_interop_llamacpp)
        pytest.skip(f"the installed gguf-py has no {arch} tables")
    return found


@pytest.mark.parametrize("arch", ARCHES)
def test_every_gguf_template_is_a_tensor_gguf_py_knows_for_the_arch(arch):
    """llama.cpp names are checked against gguf-py's MODEL_TENSORS (the legacy split and fused gate_up forms are
    not listed there for these archs, by design)."""
    from gguf.constants import MODEL_TENSORS, TENSOR_NAMES

    known = {TENSOR_NAMES[t].replace("{bid}", "{L}") for t in MODEL_TENSORS[_gguf_arch(arch)]}
    m = naming_map(arch)
    templates = [e.gguf for e in m.tensors] + [
        forms["gguf-merged"][0] for proj, forms in m.experts.items() if proj != "gate_up"
    ]
    for t in templates:
        assert t in known or t.rsplit(".", 1)[0] in known, t  # llama.cpp's ssm_a has no .weight


_LLAMA_CPP_TABLE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import gguf
arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == sys.argv[2])
print(json.dumps(sorted(gguf.TENSOR_NAMES[t].replace("{bid}", "{L}") for t in gguf.MODEL_TENSORS[arch])))
"""


@pytest.mark.parametrize("arch", NOT_IN_GGUF_PY)
def test_maps_gguf_py_lacks_are_names_llama_cpps_own_gguf_py_knows(arch):
    """The same check against the gguf-py vendored with llama.cpp 0.3.36 (beside its converter, run in a child so the
    pinned gguf stays the one imported here)."""
    import json
    import os
    import subprocess
    import sys

    import ggml_ref
    import llamacpp_convert

    try:
        root = llamacpp_convert.sources()
    except ggml_ref.RefUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"llama.cpp's gguf-py required under CI: {exc}")
        pytest.skip(str(exc))
    proc = subprocess.run([sys.executable, "-c", _LLAMA_CPP_TABLE, str(root / "gguf-py"), arch], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    known = set(json.loads(proc.stdout))
    m = naming_map(arch)
    templates = [e.gguf for e in m.tensors] + [
        forms["gguf-merged"][0] for proj, forms in m.experts.items() if proj != "gate_up" and "gguf-merged" in forms
    ]
    assert templates
    for t in templates:
        assert t in known or t.rsplit(".", 1)[0] in known, t


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("fmt", ["split", "fused"])
def test_every_tensor_transformers_saves_is_recognised_and_maps_like_gguf_py(root, model_type, fmt):
    import gguf

    ck = open_checkpoint(hf_checkpoint(root, model_type, fmt))
    m = naming_map(model_type)
    theirs = gguf.get_tensor_name_map(_gguf_arch(m.arch), LAYERS)
    for name in ck:
        match = m.lookup(name)
        assert match is not None, name
        assert match.side == "hf" and not match.via_alias
        if match.group == "experts":
            continue  # gguf-py maps only stacked names; checked below
        key = name.replace("e_score_correction_bias", "e_score_correction.bias")
        assert to_gguf_name(name, model_type) == theirs.get_name(key, try_suffixes=(".weight", ".bias")), name
        assert to_hf_name(match.gguf_name, m.arch) == match.hf_name


@pytest.mark.parametrize("arch", ARCHES)
def test_stacked_expert_names_map_like_gguf_py(arch):
    import gguf

    m = naming_map(arch)
    theirs = gguf.get_tensor_name_map(_gguf_arch(arch), 4)
    hf_stacked = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    if arch == "llama":
        hf_stacked = {"gate": "w1", "up": "w3", "down": "w2"}
    block = "block_sparse_moe" if arch == "llama" else "mlp"
    for proj, hf in hf_stacked.items():
        ours = m.expert_name("gguf-merged", proj, 3)
        assert theirs.get_name(f"model.layers.3.{block}.experts.{hf}") + ".weight" == ours
        per_expert = m.expert_name("hf-split", proj, 3, expert=5)
        hit = m.lookup(per_expert)
        assert (hit.gguf_name, hit.expert, hit.layout, hit.projection) == (ours, 5, "hf-split", proj)


def test_lookups_both_ways_and_their_counterparts():
    ds = naming_map("deepseek_v3")
    assert ds.to_gguf("model.layers.4.mlp.gate.e_score_correction_bias") == "blk.4.exp_probs_b.bias"
    assert ds.to_hf("blk.4.exp_probs_b.bias") == "model.layers.4.mlp.gate.e_score_correction_bias"
    assert ds.to_gguf("model.layers.4.self_attn.kv_b_proj.weight") == "blk.4.attn_kv_b.weight"
    k_b = ds.lookup("blk.4.attn_k_b.weight")
    assert k_b.hf_name == "model.layers.4.self_attn.kv_b_proj.weight" and "transposed" in k_b.derived
    assert ds.to_hf("blk.4.ffn_down_exps.weight") == "model.layers.4.mlp.experts.down_proj"
    assert ds.to_hf("blk.4.ffn_gate_exps.weight") is None  # one HF tensor per expert: no single counterpart
    assert ds.to_gguf("model.layers.4.mlp.experts.gate_up_proj") == "blk.4.ffn_gate_up_exps.weight"
    legacy = ds.lookup("blk.4.ffn_up.7.weight")
    assert (legacy.layout, legacy.expert, legacy.hf_name) == ("gguf-split", 7, "model.layers.4.mlp.experts.7.up_proj.weight")
    amx = ds.lookup("blk.4.ffn_down_exps.7.numa.1.weight")
    assert (amx.layout, amx.side, amx.expert, amx.numa, amx.gguf_name) == ("kt-amx", "kt", 7, 1, "blk.4.ffn_down_exps.weight")
    renamed = ds.lookup("blk.2.self_attn.q_a_proj.weight")  # kt-kernel's renamed non-expert tensor
    assert renamed.via_alias and renamed.gguf_name == "blk.2.attn_q_a.weight"
    assert ds.lookup("model.layers.2.mlp.experts.9.gate_proj.weight_scale_inv").group == "expert_scales"
    assert ds.lookup("model.layers.2.mlp.not_a_tensor.weight") is None
    mx = naming_map("mixtral")
    assert mx.to_hf("blk.0.ffn_gate_inp.weight") == "model.layers.0.block_sparse_moe.gate.weight"
    assert mx.to_gguf("model.layers.0.mlp.gate.weight") == "blk.0.ffn_gate_inp.weight"  # transformers-5 spelling
    assert mx.expert_name("hf-split", "down", 1, expert=2) == "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    assert mx.expert_name("kt-amx", "up", 1, expert=2, numa=0, scale=True) == "blk.1.ffn_up_exps.2.numa.0.scale"
    with pytest.raises(ValueError, match="needs E"):
        mx.expert_name("hf-split", "down", 1)


def test_model_type_restricted_entries():
    ds = naming_map("deepseek2")
    v2 = {e.gguf for e in ds.tensor_entries("deepseek_v2")}
    v3 = {e.gguf for e in ds.tensor_entries("deepseek_v3")}
    assert v3 - v2 == {"blk.{L}.exp_probs_b.bias"}


def test_guess_arch_from_names(root):
    for model_type in ("qwen2_moe", "qwen3_moe", "deepseek_v3"):
        ck = open_checkpoint(hf_checkpoint(root, model_type, "split"))
        assert guess_arch(ck) == FAMILIES[model_type][2]
    assert guess_arch(open_checkpoint(hf_checkpoint(root, "mixtral", "split"))) == "llama"
    # transformers-5 fused Mixtral names are also valid Qwen3-MoE (and GLM-4.5) names; they leave Qwen3's q/k norms
    # and GLM's biases unused, so the map they use fully (llama) is the guess
    assert guess_arch(open_checkpoint(hf_checkpoint(root, "mixtral", "fused"))) == "llama"
    # a fused Qwen3-MoE save names exactly what a Qwen3-VL-MoE text model names (only the experts' orientation
    # differs, and shapes never decide): no guess, the config.json has to say
    assert guess_arch(open_checkpoint(hf_checkpoint(root, "qwen3_moe", "fused"))) is None
    assert guess_arch(["nothing.we.know"]) is None


# llama.cpp's own gguf-py (from the pinned llama-cpp-python sdist, as tests/llamacpp_convert.py extracts it), in a
# child so that it does not shadow the pinned gguf package: the arch's tensor names and, for each HF name, the GGUF
# name its converter maps it to (TextModel.filter_tensors strips language_model. and spells e_score_correction_bias
# e_score_correction.bias first; Glm5NextModel renames dt_bias to dt_proj.bias and adds .weight to the suffix-less
# hc_* / index_kpool_compress_* parameters, as modify_tensors does)
_UPSTREAM_TABLES = r"""
import json, sys
sys.path.insert(0, sys.argv[1] + "/gguf-py")
import gguf
arch, names, layers = sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
key = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
tmap = gguf.get_tensor_name_map(key, layers)
mapped = {}
for name in names:
    up = name.replace("language_model.", "").replace("e_score_correction_bias", "e_score_correction.bias")
    up = up.replace(".dt_bias", ".dt_proj.bias")
    bare = not up.endswith((".weight", ".bias")) and not up.endswith(".A_log")
    got = tmap.get_name(up, try_suffixes=(".weight", ".bias"))
    mapped[name] = (got + ".weight") if (got and bare) else got
known = sorted(gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[key])
print(json.dumps({"known": known, "mapped": mapped}))
"""


def test_glm5_next_map_matches_llama_cpp_converter_tables():
    """gguf 0.19.0 has no glm5-next: every GGUF template is one of llama.cpp 0.3.36's GLM5_NEXT tensors, and every
    HF name of the map (the releases' names, under model.language_model.) is renamed as its converter renames it."""
    import json
    import subprocess
    import sys

    import ggml_ref
    import llamacpp_convert

    try:
        root = llamacpp_convert.sources()
    except ggml_ref.RefUnavailable as exc:
        pytest.skip(str(exc))
    m = naming_map("glm5-next")
    hf_names = {}
    for e in m.tensors:
        if e.derived:  # kv_b_proj split per head: the converter's own code, not its tables
            continue
        hf_names["model.language_model." + e.hf[0].removeprefix("model.").replace("{L}", "3")] = e
    hf_names.pop("model.language_model.lm_head.weight")
    proc = subprocess.run([sys.executable, "-c", _UPSTREAM_TABLES, str(root), "glm5-next",
                           json.dumps(sorted(hf_names)), "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    up = json.loads(proc.stdout)
    known = {t.replace("{bid}", "{L}") for t in up["known"]}
    templates = [e.gguf for e in m.tensors] + [f["gguf-merged"][0] for p, f in m.experts.items() if p != "gate_up"]
    for t in templates:
        assert t in known or t.rsplit(".", 1)[0] in known, t  # llama.cpp's ssm_a has no .weight
    for name, e in hf_names.items():
        assert up["mapped"][name] == e.gguf.replace("{L}", "3"), name
        assert m.to_gguf(name) == e.gguf.replace("{L}", "3"), name  # through the prefix alias
    assert m.to_gguf("lm_head.weight") == "output.weight"
    conv = m.lookup("model.layers.0.self_attn.q_conv1d.weight")  # [C, 1, K] -> [1, C, 1, K] as the converter
    assert conv.gguf_name == "blk.0.ssm_conv1d_q.weight" and dict(conv.transform) == {"squeeze": True,
                                                                                       "unsqueeze": (0, 2)}


def test_unsqueeze_transform_reshapes_without_moving_bytes(tmp_path):
    """A KDA conv kernel [C, 1, K] becomes llama.cpp's [1, C, 1, K] (squeeze, then unsqueeze [0, 2]): same rows of
    K, same bytes; a map's list-valued transform loads into a hashable entry."""
    from ktconvert.formats import transforms
    from ktconvert.convert.source import Segment

    t = {"squeeze": True, "unsqueeze": [0, 2]}
    p = _write_map(tmp_path, lambda d: d["tensors"].append(
        {"gguf": "blk.{L}.ssm_conv1d.weight", "hf": "model.layers.{L}.conv.weight", "group": "attention", "transform": t}))
    hit = load_naming_map(p).lookup("model.layers.0.conv.weight")
    assert dict(hit.transform) == {"squeeze": True, "unsqueeze": (0, 2)} and isinstance(hash(hit), int)
    seg = Segment(0, 12, "model.layers.0.conv.weight")
    shape, segs = transforms.apply("conv", (12, 1, 4), dict(hit.transform), None, seg, "test")
    assert shape == (1, 12, 1, 4) and segs == (seg,)
    assert transforms.apply("conv", (12, 4), t, None, seg, "test")[0] == (1, 12, 1, 4)  # a 2-D kernel as well
    w = np.arange(48, dtype=np.float32).reshape(12, 1, 4)
    out = transforms.redo(w, t, None, "test")
    assert out.shape == (1, 12, 1, 4) and np.array_equal(out.ravel(), w.ravel())
    assert np.array_equal(transforms.undo(out, t, None, "test").ravel(), w.ravel())  # size-1 axes: the caller's


def _write_map(tmp_path, mutate):
    data = yaml.safe_load((resources.rules_dir() / "naming" / "qwen3moe.yaml").read_text())
    mutate(data)
    p = tmp_path / "map.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("arch"), "not a valid naming map: 'arch' is a required property"),
        (lambda d: d["tensors"].append({"gguf": "blk.{L}.x.weight", "hf": "a.{Q}.b", "group": "norm"}), "schema"),
        (lambda d: d["tensors"].append({"gguf": "blk.{L}.x.weight", "hf": "m.12.b", "group": "norm"}), "schema"),
        (lambda d: d["tensors"].append({"gguf": "blk.{L}.attn_q.weight", "hf": "z.{L}", "group": "norm"}),
         "cannot be told apart"),
        (lambda d: d["experts"]["gate"].update({"hf-split": "model.layers.{L}.g.weight"}), "needs exactly {E}, {L}"),
        (lambda d: d["tensors"].append({"gguf": "blk.{L}.x.{E}.weight", "hf": "q.{L}", "group": "norm"}),
         "may only use {L}"),
        (lambda d: d["experts"].pop("down"), "experts must name down"),
    ],
)
def test_broken_maps_are_refused_with_the_place(tmp_path, mutate, message):
    p = _write_map(tmp_path, mutate)
    with pytest.raises(InputError) as exc:
        load_naming_map(p)
    assert message in str(exc.value) and str(p) in str(exc.value)


def test_map_yaml_syntax_error_names_the_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("arch: x\ntensors: [\n")
    with pytest.raises(InputError, match=r"bad.yaml:\d+:\d+: invalid YAML"):
        load_naming_map(p)


def test_unknown_arch_lists_the_known_ones():
    with pytest.raises(InputError, match="known: .*deepseek_v3.*qwen3moe"):
        naming_map("gpt2")

