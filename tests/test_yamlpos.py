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
    assert problem.id == "KT102" and (problem.line, problem.col) == (3, 1)
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
    for i in range(1, 5):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    loaded = yamlpos.load_text("\n".join(lines) + "\n")  # 10**5 leaves if expanded; shared objects here
    assert loaded.data["a4"][0] is loaded.data["a3"]


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


def _bomb(inside_list: bool, depth: int = 24) -> str:
    """A billion-laughs document: each anchor is a list of ten aliases of the previous one (10**depth leaves)."""
    if inside_list:
        lines = ["- &l0 [x, x, x, x, x, x, x, x, x, x]"]
        lines += [f"- &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, depth)]
    else:
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
        lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, depth)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("inside_list", [True, False])
def test_alias_expansion_is_capped_before_anything_walks_it(inside_list):
    """Issue 15: the builder shared aliased objects, but the schema validator walked the expansion: a bomb inside a
    list hung check-rules (20 s and 1 GB, then killed). Now refused at the node that passes the cap."""
    with pytest.raises(yamlpos.YamlSyntaxError, match="aliases expand this document to more than") as info:
        yamlpos.load_text(_bomb(inside_list))
    assert info.value.line == 6  # 10**6 values are passed at the sixth anchor
    small = yamlpos.load_text(_bomb(inside_list, depth=4))  # 10**4 leaves: an ordinary document
    assert small.data is not None


@pytest.mark.parametrize("inside_list", [True, False])
def test_check_rules_finishes_an_alias_bomb_in_bounded_time_and_memory(tmp_path, inside_list):
    import time

    from child_peak import run_cli

    f = tmp_path / "bomb.yaml"
    f.write_text(_bomb(inside_list))
    t0 = time.monotonic()
    code, peak_mib, out, _ = run_cli(["check-rules", str(f)], timeout=60)  # the child's own peak, not the suite's
    seconds = time.monotonic() - t0
    assert code == 1 and "KT101" in out and "alias bomb" in out
    assert seconds < 10 and peak_mib < 400, (seconds, peak_mib)


def test_deep_nesting_is_an_error_not_a_crash():
    with pytest.raises(yamlpos.YamlSyntaxError, match="nesting depth"):
        yamlpos.load_text("[" * 50000 + "]" * 50000 + "\n")
