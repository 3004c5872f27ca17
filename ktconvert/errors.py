"""Typed errors raised by library code; only the CLI turns them into messages and exit codes."""

from __future__ import annotations


class KtError(Exception):
    """Base of every error the tool reports to a user as one line, never as a traceback."""

    exit_code = 3

    def __init__(self, message: str, *, path: str | None = None, where: str | None = None, fix: str | None = None):
        self.message = message
        self.path = path
        self.where = where
        self.fix = fix
        super().__init__(self.one_line())

    def one_line(self) -> str:
        """``FILE[:WHERE]: MESSAGE (fix: ...)``: the file, the place in it, and what to do."""
        head = ""
        if self.path:
            head = str(self.path) + (f":{self.where}" if self.where else "") + ": "
        elif self.where:
            head = f"{self.where}: "
        tail = f" ({self.fix})" if self.fix else ""
        return f"{head}{self.message}{tail}"


class InputError(KtError):
    """An input file or directory cannot be read or is malformed (exit 3)."""


class EnvironmentProblem(KtError):
    """A missing optional dependency or tool (exit 3)."""


class UsageProblem(KtError):
    """Options that contradict each other or name nothing usable (exit 2)."""

    exit_code = 2
