"""Exception types of ernie-ir.

Every error a user can cause (bad IR text, bad checkpoint, bad pipeline, bad
option) is an `ErnieIRError`. The CLI prints its message as one line and
exits with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ErnieIRError(Exception):
    """An error caused by the input, with a message that names the problem and the fix.

    A refusal of one option may carry it as fields: `flag` (as the user typed it, e.g. "--pp"),
    `value` (what they gave) and `fix` (what to do instead); the message is then the problem
    alone, and `one_line()` (what the CLI prints, and `str()`) reads
    "--pp 0: the number of pipeline stages must be an integer >= 1: give --pp 1 or more"."""

    def __init__(self, message: str = "", *args: object, flag: str | None = None, value: object = None,
                 fix: str | None = None) -> None:
        self.problem, self.flag, self.value, self.fix = message, flag, value, fix
        super().__init__(message, *args)

    def one_line(self) -> str:
        """The error as one line: flag and value, the problem, the fix (where they are given)."""
        head = None if self.flag is None else f"{self.flag}{'' if self.value is None else f' {self.value}'}"
        problem = self.problem if self.flag is not None else super().__str__()
        text = ": ".join(part for part in (head, problem, self.fix) if part)
        return " ".join(text.splitlines())

    def __str__(self) -> str:
        return self.one_line() if self.flag is not None or self.fix else super().__str__()


class IRParseError(ErnieIRError):
    """Malformed IR text. Carries the 1-based line and column."""

    def __init__(self, message: str, line: int, column: int, source: str = "<ir>") -> None:
        self.line = line
        self.column = column
        self.source = source
        super().__init__(f"{source}:{line}:{column}: {message}")


class OpError(ErnieIRError):
    """An op used with the wrong inputs, attributes or types."""


class VerificationError(ErnieIRError):
    """The graph breaks an invariant. `problems` lists every one found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        head = problems[0] if problems else "graph is invalid"
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"{head}{more}")


class WeightError(ErnieIRError):
    """A weight file or weight source that cannot be read as declared."""
