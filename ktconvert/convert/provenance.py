"""What a manifest records about how it was made, beyond the plan: the git commit of the ktconvert that ran
(when it runs from a git checkout) and the sha256 of the recipe file. Never fails: what cannot be found is left
out."""

from __future__ import annotations

import functools
import hashlib
import subprocess
from pathlib import Path

from ktconvert.convert.recipe import Recipe, presets

ROOT = Path(__file__).resolve().parents[2]  # the checkout holding ktconvert/, or site-packages


@functools.lru_cache(maxsize=None)
def git_commit(root: Path = ROOT) -> dict:
    """``{"commit": sha, "dirty": True?}`` of the checkout ``root`` that holds ktconvert's own sources; ``{}`` when
    ktconvert is installed (no ``.git`` beside the package: an enclosing repository is not ktconvert's), when git is
    missing, or when git fails."""
    if not (root / ".git").exists():
        return {}
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                              text=True, timeout=20)
        if head.returncode != 0:
            return {}
        top, commit = head.stdout.split()
        if Path(top).resolve() != root.resolve():
            return {}
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                 "ktconvert", "rules"], capture_output=True, text=True, timeout=20)
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, **({"dirty": True} if status.returncode == 0 and status.stdout.strip() else {})}


def recipe_sha256(recipe: Recipe) -> str | None:
    """sha256 of the file the recipe was read from (a preset's ``rules/convert/NAME.yaml`` or the user's file);
    ``None`` for a recipe made from options (``--type T``), whose content the manifest records whole."""
    src = recipe.source
    path = presets().get(src[len("preset "):]) if src.startswith("preset ") else Path(src)
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None and path.is_file() else None
    except OSError:
        return None
