import pytest

from ktconvert.errors import InputError
from ktconvert.io import yamlpos


def test_positions_of_values_and_keys():
    loaded = yamlpos.load_text('- match:\n    name: "^lm_head$"\n  replace: {class: default}\n')
    assert loaded.data == [{"match": {"name": "^lm_head$"}, "replace": {"class": "default"}}]
    assert loaded.pos[("0", "match", "name")] == (2, 11)
    assert loaded.key_pos[("0", "match", "name")] == (2, 5)
    assert loaded.pos[("0", "replace", "class")] == (3, 20)


def test_duplicate_keys_are_reported_not_silently_dropped():
    loaded = yamlpos.load_text("a: 1\nb: 2\na: 3\n")
    (problem,) = loaded.problems
    assert problem.code == "KT102" and (problem.line, problem.col) == (3, 1)
    assert "first at line 1" in problem.message


def test_int_keys_stay_ints_like_upstream_full_loader():
    loaded = yamlpos.load_text("transfer_map: {30: 'cuda:1', '31': cpu}\n")
    assert loaded.data["transfer_map"] == {30: "cuda:1", "31": "cpu"}


@pytest.mark.parametrize("text", [
    "- !!python/object/apply:os.system ['true']\n",
    "a: !!python/name:os.system\n",
    "- !custom {x: 1}\n",
])
def test_tags_that_would_construct_objects_are_refused(text):
    with pytest.raises(yamlpos.YamlSyntaxError, match="unsupported tag"):
        yamlpos.load_text(text)


def test_alias_bomb_is_linear():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 30):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    loaded = yamlpos.load_text("\n".join(lines) + "\n")  # 10**30 leaves if expanded; shared objects here
    assert loaded.data["a29"][0] is loaded.data["a28"]


def test_recursive_alias_is_an_error():
    with pytest.raises(yamlpos.YamlSyntaxError, match="recursive alias"):
        yamlpos.load_text("a: &a [*a]\n")


def test_syntax_error_has_position():
    with pytest.raises(yamlpos.YamlSyntaxError) as info:
        yamlpos.load_text("- match: {name: x\n  replace: 1\n")
    assert info.value.line >= 1 and info.value.col >= 1


def test_read_text_refuses_binary_bad_utf8_and_huge(tmp_path):
    b = tmp_path / "b.yaml"
    b.write_bytes(b"\x00\x01\x02")
    with pytest.raises(InputError, match="binary file"):
        yamlpos.read_text(b)
    u = tmp_path / "u.yaml"
    u.write_bytes(b"- match: {name: \xff}\n")
    with pytest.raises(InputError, match="invalid UTF-8 at byte 16"):
        yamlpos.read_text(u)
    h = tmp_path / "h.yaml"
    with open(h, "wb") as fh:
        fh.truncate(yamlpos.MAX_BYTES + 1)
    with pytest.raises(InputError, match="MB"):
        yamlpos.read_text(h)
