"""Size rules on ernie_ir/: no function over 100 lines (the CLI's command functions included),
and none over 10 parameters outside the typer command signatures in cli/. A long function or a
long parameter list is where intent stops being a typed object passed down; these rules keep it
that way as the code grows. The modules are read with `ast`; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ernie_ir"
MAX_LINES = 100
MAX_PARAMS = 10


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        rel = path.relative_to(PACKAGE.parent).as_posix()
        found += [(rel, n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return found


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return count - (1 if names and names[0].arg in ("self", "cls") else 0)


def _typer_command(path: str, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A CLI command: a module-level function of ernie_ir/cli/ whose parameters are typer options."""
    if not path.startswith("ernie_ir/cli/"):
        return False
    text = ast.unparse(fn.args)
    return "typer." in text or "Opt" in text or "ModelArg" in text


def test_no_function_is_over_100_lines() -> None:
    long = [f"{path}:{fn.lineno} {fn.name}: {fn.end_lineno - fn.lineno + 1} lines"  # type: ignore[operator]
            for path, fn in _functions() if fn.end_lineno - fn.lineno + 1 > MAX_LINES]  # type: ignore[operator]
    assert long == []


def test_no_function_takes_over_10_parameters() -> None:
    many = [f"{path}:{fn.lineno} {fn.name}: {_params(fn)} parameters"
            for path, fn in _functions() if _params(fn) > MAX_PARAMS and not _typer_command(path, fn)]
    assert many == []


def test_the_rules_can_fail() -> None:
    tree = ast.parse("def f(a, b, c, d, e, f, g, h, i, j, k):\n" + "    x = 1\n" * 101)
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert _params(fn) == 11 and fn.end_lineno - fn.lineno + 1 > MAX_LINES  # type: ignore[operator]
    assert not _typer_command("ernie_ir/targets/compile.py", fn)
