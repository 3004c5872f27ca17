"""Optional dependencies, imported only where a command needs them, with the one-line install error.

Core dependencies are imported at module level; an optional one (transformers for goldens, matplotlib for
``verify --plot``, kt-kernel's bindings in a kernel child process) goes through :func:`require`, so a missing
package is one ``EnvironmentProblem`` (exit 3) that says what needs it and how to install it, never an
ImportError traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ktconvert.errors import EnvironmentProblem


def require(module: str, *, needed_for: str, install: str) -> ModuleType:
    """``module`` imported, or an EnvironmentProblem: ``{needed_for} needs {module} ... ({install})``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        missing = getattr(exc, "name", None) in (None, top, module)
        what = "which is not installed" if missing else f"which does not import ({exc})"
        raise EnvironmentProblem(f"{needed_for} needs {top}, {what}", fix=install) from None
