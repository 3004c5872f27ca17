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

    @classmethod
    def first_of(cls, problems: list[tuple[str, str | None, str | None]], path: str, kind: str = "") -> InputError:
        """The first of ``problems`` (``(message, where, fix)``, at least one) as the one line, counting the rest
        for ``ktconvert inspect`` (``kind``: "FP8 ", "quantization ", or "" for any)."""
        message, where, fix = problems[0]
        if len(problems) > 1:
            message += f" (and {len(problems) - 1} more {kind}problem(s); ktconvert inspect lists them)"
        return cls(message, path=path, where=where, fix=fix)


class EnvironmentProblem(KtError):
    """A missing optional dependency or tool (exit 3)."""


class UsageProblem(KtError):
    """Options that contradict each other or name nothing usable (exit 2)."""

    exit_code = 2
