"""One record for everything a check finds: a check-rules finding, a preflight finding, a convert-lora finding, a
tensor a release format cannot read, a layout problem inspect reports, why a kt-kernel method cannot run a shape or a
weight type, a defect the YAML loader found.

Library code returns these; each command renders them in its own pinned text and JSON shape (the renderer maps the
fields to the names its schema has always used, e.g. ``where`` is check-rules' ``file`` and inspect's ``kind`` is
``id``). Torch-free and import-free: every package may use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

ERROR, WARNING, INFO = "error", "warning", "info"


@dataclass(frozen=True)
class Diagnostic:
    """``id``: a stable ID (``KT102``, ``PF124``, ``missing-experts``), ``""`` where the producer has none;
    ``severity``: ``error``, ``warning`` or ``info``; ``where``: the file, tensor, flag or field it is about;
    ``line``/``col``: the position in that file (1-based); ``extra``: the producer's own data (check-rules'
    ``rule_index`` and ``path``, a layout problem's ``layer`` and ``tensors``, LLAMAFILE's ``alternative``)."""

    id: str
    severity: str
    message: str
    fix: str = ""
    where: str | None = None
    line: int | None = None
    col: int | None = None
    extra: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    def __hash__(self) -> int:
        return hash((self.id, self.severity, self.message, self.fix, self.where, self.line, self.col,
                     tuple(sorted(self.extra.items()))))
