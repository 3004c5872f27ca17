"""A package face whose names load their module on first use (PEP 562): a process that needs one small module of a
package (a conversion worker reading rows) does not pay for importing all of it."""

from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """The ``__getattr__`` of ``package``: ``exports`` maps each public name to the module defining it, imported
    when the name is first asked for (then kept in the package, so later lookups cost nothing). Any other name is
    an ``AttributeError``, as the import system needs for ``from package import submodule``."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
