"""``ktconvert demo``: the README's first command, end to end on the embedded default."""

from click.testing import CliRunner

from ktconvert.cli import cli


def test_demo_runs_every_step_and_passes(tmp_path):
    keep = tmp_path / "demo"
    r = CliRunner().invoke(cli, ["demo", "--keep", str(keep)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    for n in range(1, 6):
        assert f"[{n}/5]" in r.output
    assert "sha256 of every file matches" in r.output
    assert "0 errors, 0 warnings" in r.output
    assert "within tolerance profile q4_k_m" in r.output
    assert "demo passed" in r.output
    assert (keep / "converted" / "model.gguf").is_file() and (keep / "model" / "config.json").is_file()


def test_demo_refuses_an_existing_keep_dir(tmp_path):
    r = CliRunner().invoke(cli, ["demo", "--keep", str(tmp_path)])
    assert r.exit_code == 2 and "already exists" in r.output
