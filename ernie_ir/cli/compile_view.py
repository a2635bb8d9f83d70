"""`ernie-ir compile`'s report as lines and tables: where the artifact went, its pipeline and
executables, params by dtype, the kernel plan and the fallbacks, grouped. Prints nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ernie_ir.targets.compile import CompileReport, FallbackGroup

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


def report_lines(report: CompileReport, *, verbose: bool = False) -> list[Any]:
    """What `compile` prints after its warnings: text lines and rich tables, in order."""
    from .numbers import count
    from .tables import KeyTable

    if report.stopped:
        return [f"{report.stopped}: wrote the graph folder {report.out} (not an artifact; "
                f"`ernie-ir show {report.out}` prints it)"]
    lines: list[Any] = [f"compiled {report.model} for {report.target} ({report.mode}) -> {report.out}"]
    if report.parallel:
        lines.append(f"layout: {report.parallel}")
    lines.append(f"pipeline: {report.pipeline}")
    lines.append(f"executables: {', '.join(report.emit) or 'none (graph only)'}")
    if report.serve:
        from ernie_ir.formats.fastdeploy import SCRIPT

        lines.append(f"serve with FastDeploy ({Path(report.out) / SCRIPT} runs it): {report.serve}")
    if report.onnx_numerics is not None:
        lines.append(f"onnx numerics: {report.onnx_numerics}")
    params = KeyTable("dtype", "before", "after", numbers=("before", "after"), title="params by dtype")
    for dtype in sorted(set(report.params_before) | set(report.params_after)):
        b = report.params_before.get(dtype, {})
        a = report.params_after.get(dtype, {})
        params.add_row(dtype, f"{count(b.get('count', 0))} / {count(b.get('bytes', 0))} B",
                       f"{count(a.get('count', 0))} / {count(a.get('bytes', 0))} B")
    plan = KeyTable("kernel", "nodes", numbers=("nodes",), title="kernel plan")
    counts: dict[str, int] = {}
    for k in report.kernel_plan:
        counts[k["kernel"]] = counts.get(k["kernel"], 0) + 1
    for kernel, n in sorted(counts.items()):
        plan.add_row(kernel, count(n))
    return [*lines, params, plan, *fallback_lines(report.fallback_groups(), verbose=verbose)]
