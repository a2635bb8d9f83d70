"""Lines of `ernie-ir compile`'s output that summarise the report: the fallbacks, grouped."""

from __future__ import annotations

from ernie_ir.targets.compile import FallbackGroup

HEAD_SCOPES = 3
"""Scopes named per fallback line without --verbose; the rest are counted ("and N more")."""


def _scope(scope: str, n: int) -> str:
    return scope + (f" (x{n})" if n > 1 else "")


def fallback_lines(groups: list[FallbackGroup], *, verbose: bool = False,
                   head: int = HEAD_SCOPES) -> list[str]:
    """One line per group (op, kernel and reason): how many nodes fell back, to what, why, and
    the first `head` scopes ("and N more"); `verbose`: every scope, one indented line each."""
    lines: list[str] = []
    for g in groups:
        nodes = f"{g.count} {g.op} node{'s' if g.count != 1 else ''}"
        line = f"fallback: {nodes} -> {g.kernel}: {g.reason}"
        scopes = g.scope_counts()
        if verbose:
            lines.append(f"{line}; at:")
            lines.extend(f"  {_scope(s, n)}" for s, n in scopes)
            continue
        shown = ", ".join(_scope(s, n) for s, n in scopes[:head])
        rest = len(scopes) - head
        more = f" and {rest} more (--verbose lists them)" if rest > 0 else ""
        lines.append(f"{line}; at {shown}{more}")
    return lines
