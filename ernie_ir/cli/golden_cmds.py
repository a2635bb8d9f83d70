"""`ernie-ir golden check` and `golden update`: compare golden-graph files with what the
code builds now (ernie_ir.testing.golden), or rewrite the ones that differ."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import out

StructureOnlyOpt = Annotated[bool, typer.Option(
    "--structure-only", help="Compare structure only, not param values (goldens record a content "
    "hash per param).")]


def _golden(paths: list[str] | None, update: bool, structure_only: bool = False) -> None:
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.testing.golden import check_goldens

    if not paths:
        default = Path("tests/golden")
        if not default.is_dir():
            raise ErnieIRError("no PATHS given and ./tests/golden does not exist: name golden files "
                               "or folders, or run from the project root")
        paths = [str(default)]
    results = check_goldens(paths, update=update, structure_only=structure_only)
    if not results:
        raise ErnieIRError(f"no golden files (*.ir starting with '// golden case') under "
                           f"{', '.join(paths)}: check the paths")
    failed = 0
    for r in results:
        if r.ok:
            out.print(f"ok       {r.case.path}", markup=False)
        elif r.updated:
            out.print(f"updated  {r.case.path} ({r.reason})", markup=False)
        else:
            failed += 1
            out.print(f"FAIL     {r.case.path}: {r.reason}", markup=False)
            if r.diff:
                out.print(r.diff, markup=False)
    out.print(f"{len(results)} golden file(s), {failed} failed"
              + (f", {sum(r.updated for r in results)} updated" if update else ""), markup=False)
    if failed:
        raise typer.Exit(1)


def golden_check(paths: Annotated[list[str] | None, typer.Argument(help="Golden files or folders.")] = None,
                 structure_only: StructureOnlyOpt = False) -> None:
    """Check golden files (default: ./tests/golden): structure and param values; exit 1 and
    show diffs on mismatch."""
    _golden(paths, update=False, structure_only=structure_only)


def golden_update(paths: Annotated[list[str] | None, typer.Argument(help="Golden files or folders.")] = None,
                  structure_only: StructureOnlyOpt = False) -> None:
    """Rewrite the golden files that fail (and only those), with a hash per param."""
    _golden(paths, update=True, structure_only=structure_only)
