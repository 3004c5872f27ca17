"""The documentation's copy-paste blocks run as written, the set-up commands the README opens with are what CI
runs, and the docs site builds.

A block is meant to be pasted when the line before its fence is the ``runs as written`` marker; such blocks
start with ``KT=$(mktemp -d)`` and must leave the repository untouched. They live in ``README.md`` and in the pages
under ``docs/`` (every page is walked)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

README = (REPO / "README.md").read_text()
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))
MARK = "<!-- runs as written (tests/test_readme.py)"
BLOCK = re.compile(r"^" + re.escape(MARK) + r"[^\n]*\n```bash\n(.*?)\n```", re.M | re.S)
BLOCKS = [(f"{page.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}", m.group(1))
          for page in PAGES for text in [page.read_text()] for m in BLOCK.finditer(text)]
SKIP_DIRS = {".venv", ".git", ".pytest_cache", "__pycache__", ".cache", "build", "dist", ".hypothesis"}


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for f in filenames:
            st = os.stat(os.path.join(dirpath, f))
            out[os.path.relpath(os.path.join(dirpath, f), root)] = (st.st_size, st.st_mtime_ns)
    return out


def test_the_readme_marks_its_copy_paste_blocks():
    assert len(BLOCKS) >= 3, "the walkthrough blocks lost their marker"
    for where, body in BLOCKS:
        assert body.startswith("KT=$(mktemp -d)"), f"{where}: a runnable block starts with KT=$(mktemp -d)"
        assert "..." not in body, f"{where}: '...' is not something a shell can run"


def test_ci_runs_the_readme_test_command_exactly():
    fence = README.split("```bash\n", 1)[1].split("\n```", 1)[0]
    test_cmd = [ln for ln in fence.splitlines() if "pytest" in ln]
    assert len(test_cmd) == 1
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert test_cmd[0] in ci, ".ci/run must run the README's test command, exactly"


@pytest.mark.parametrize("where,body", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_block_runs_as_written(tmp_path, where, body):
    before = _tree(REPO)
    env = dict(os.environ, TMPDIR=str(tmp_path), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               OMP_NUM_THREADS="1")
    env.pop("CI", None)  # the blocks are a user's shell session; `golden` refuses to run under CI by design
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{where} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    after = _tree(REPO)
    assert after == before, f"{where} changed the repository: {sorted(set(after) ^ set(before))[:5]}"


def test_every_code_fence_is_closed():
    """An unclosed fence turns the rest of a page into code (the README's first block lost its closing one once)."""
    for page in PAGES:
        fences = [n for n, line in enumerate(page.read_text().splitlines(), 1) if line.lstrip().startswith("```")]
        assert len(fences) % 2 == 0, f"{page.relative_to(REPO)}: the fence at line {fences[-1]} is never closed"


def test_the_readme_is_a_first_read():
    """What a newcomer reads first stays short; the reference lives in docs/."""
    lines = README.count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move reference material to a page under docs/"


def test_the_docs_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: every page is in the nav, every link between pages and anchors resolves."""
    if not _has_mkdocs():
        pytest.fail("mkdocs is not installed: it is in the `test` extra (pip install -c constraints.txt -e '.[test]')")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(REPO / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert (tmp_path / "site" / "index.html").is_file()


def _has_mkdocs() -> bool:
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        return False
    return True
