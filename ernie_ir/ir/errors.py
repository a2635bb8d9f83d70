"""Exception types of ernie-ir.

Every error a user can cause (bad IR text, bad checkpoint, bad pipeline, bad
option) is an `ErnieIRError`. The CLI prints its message as one line and
exits with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ErnieIRError(Exception):
    """An error caused by the input, with a message that names the problem and the fix."""


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
