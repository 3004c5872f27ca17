"""``quantize --to kt-amx --type AMXINT8 --form kt-tree``: kt-kernel's persistent INT8 tree for SFT. kt-kernel
0.7.2's own validator (``kt_kernel.sft.weight_manifest.validate_persistent_int8_weights``, run in a child process)
accepts it with hashes verified; every ``.kt`` file holds the bytes of the merged form's tensor; ktconvert's
manifest sits beside the tree; ``inspect`` reads it; both validators refuse the same broken trees."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file

from convert_helpers import tiny
from ktconvert.cli import cli
from ktconvert.errors import InputError
from ktconvert.formats.kt_tree import check_kt_tree
from lora_helpers import kt_kernel_dir, run_child

VALIDATE = r"""
import json, sys
from kt_kernel.sft.weight_manifest import validate_persistent_int8_weights
out = []
for root in sys.argv[2:]:
    try:
        v = validate_persistent_int8_weights(root, verify_hashes=True, **json.loads(sys.argv[1]))
        out.append([v.file_count, v.size_bytes, v.schema_version])
    except Exception as exc:
        out.append(f"{type(exc).__name__}: {exc}")
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("kt-tree")
    model = tiny(root, "qwen3_moe")
    r = CliRunner()
    for form in ("kt-tree", "merged"):
        res = r.invoke(cli, ["quantize", str(model), str(root / form), "--to", "kt-amx", "--type", "AMXINT8",
                             "--form", form])
        assert res.exit_code == 0, res.output
    return root, model


def test_tree_layout_bytes_and_manifest_beside(trees):
    root, _ = trees
    tree = root / "kt-tree"
    assert sorted(p.name for p in tree.iterdir()) == ["_layer_0", "_layer_1", "kt-weight-manifest.json"]
    side = json.loads((root / "kt-tree.manifest.json").read_text())
    assert side["form"] == "kt-tree" and side["kt_tree"]["files"] == 2 * 2 * 8 * 6
    assert not (root / ".kt-tree.kt-amx-merged").exists()
    merged = {}
    for f in (root / "merged").glob("*.safetensors"):
        merged.update(load_file(str(f)))
    n = 0
    for f in tree.glob("_layer_*/_numa_*/*.kt"):
        L, part = int(f.parent.parent.name[7:]), int(f.parent.name[6:])
        _, proj, e, _, kind, _ = f.name.split("_")
        name = f"blk.{L}.ffn_{proj}_exps.{e}.numa.{part}.{'weight' if kind == 'quant' else 'scale'}"
        assert f.read_bytes() == merged[name].tobytes(), name
        n += 1
    assert n == len(merged) == 192


def _broken(root):
    """(name, edit) pairs: each breaks the tree in one way kt-kernel refuses."""
    def flip(t):
        f = next(t.glob("_layer_1/_numa_1/INT8_up_3_*quant_.kt"))
        b = bytearray(f.read_bytes())
        b[7] ^= 1
        f.write_bytes(bytes(b))

    def extra(t):
        (t / "manifest.json").write_text("{}")

    def missing(t):
        next(t.glob("_layer_0/_numa_0/INT8_down_5_*scale_.kt")).unlink()

    return {"flipped-byte": flip, "extra-root-entry": extra, "missing-file": missing}


def test_kt_kernel_validator_accepts_it_and_refuses_what_we_refuse(trees, tmp_path):
    kt_kernel_dir()
    root, _ = trees
    roots = [str(root / "kt-tree")]
    for name, edit in _broken(root).items():
        d = tmp_path / name
        shutil.copytree(root / "kt-tree", d)
        edit(d)
        with pytest.raises(InputError):
            check_kt_tree(d)
        roots.append(str(d))
    geometry = {"layer_indices": [0, 1], "numa_count": 2, "expert_num": 8, "hidden_size": 256, "intermediate_size": 256}
    got = json.loads(run_child(VALIDATE, json.dumps(geometry), *roots))
    side_bytes = json.loads((root / "kt-tree.manifest.json").read_text())["kt_tree"]["bytes"]
    assert got[0] == [192, side_bytes, 2]
    for g, why in zip(got[1:], ("INT8 SHA256 mismatch", "root entries differ", "missing or unsafe INT8 manifest file")):
        assert g.startswith("ValueError") and why in g, got
    t = check_kt_tree(root / "kt-tree")
    assert (t.layers, t.experts, t.hidden, t.intermediate, t.parts, t.files) == ([0, 1], 8, 256, 256, 2, 192)


def test_inspect_reads_the_tree(trees):
    root, model = trees
    res = CliRunner().invoke(cli, ["inspect", str(root / "kt-tree"), "--config", str(model / "config.json"),
                                   "-o", "json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["container"] == "kt-tree" and rep["kt_tree"]["hashes"] == "verified" and rep["problems"] == []
    cfg = json.loads((model / "config.json").read_text())
    (root / "other.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 512}))
    res = CliRunner().invoke(cli, ["inspect", str(root / "kt-tree"), "--config", str(root / "other.json")])
    assert res.exit_code == 1 and "intermediate_size 256, the model's config says 512" in res.stdout


def test_tree_needs_amxint8(trees, tmp_path):
    _, model = trees
    res = CliRunner().invoke(cli, ["quantize", str(model), str(tmp_path / "t"), "--to", "kt-amx", "--type", "AMXINT4",
                                   "--form", "kt-tree"])
    assert res.exit_code == 2 and "needs --to kt-amx --type AMXINT8" in res.stderr
    assert list(tmp_path.iterdir()) == []
