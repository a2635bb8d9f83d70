"""`ernie-ir --version` and `--help` load typer and not the library (issue 13, item 8).

Each case runs the CLI's `main` in a fresh interpreter and reports which modules it
imported; no timing (benchmarks/cli_startup.py measures the figure).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("numpy", "ml_dtypes", "networkx", "pydantic", "pydantic_core", "onnx", "onnxruntime", "paddle",
         "yaml", "safetensors", "markdown_it", "pygments", "importlib.metadata",
         "ernie_ir.ir", "ernie_ir.ops", "ernie_ir.passes", "ernie_ir.frontends", "ernie_ir.runtime",
         "ernie_ir.targets", "ernie_ir.planning", "ernie_ir.load", "ernie_ir.testing")

PROBE = """
import json, sys
sys.argv[0] = "ernie-ir"
from ernie_ir.cli.app import main
try:
    main({args!r})
except SystemExit as e:
    code = e.code
else:
    code = None
print(json.dumps({{"code": code, "modules": sorted(sys.modules)}}))
"""


def imported_by(*args: str) -> tuple[object, set[str], str]:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(args=list(args))], capture_output=True,
                          text=True, check=True, timeout=120)
    *text, last = proc.stdout.strip().splitlines()
    report = json.loads(last)
    return report["code"], set(report["modules"]), "\n".join(text)


def heavy(modules: set[str], allow: tuple[str, ...] = ()) -> list[str]:
    return sorted(m for m in modules
                  if any(m == h or m.startswith(h + ".") for h in HEAVY if h not in allow))


def test_version_imports_no_library_module() -> None:
    code, modules, text = imported_by("--version")
    assert code == 0 and text.startswith("ernie-ir ")
    # the installed version is read from the package metadata, only here
    assert heavy(modules, allow=("importlib.metadata",)) == []


# typer >= 0.24 coerces option values (the root's --version too, once a subcommand runs) with
# pydantic TypeAdapters, so a subcommand's --help imports pydantic through typer, not through
# ernie-ir; the library stays out.
TYPER_COERCION = ("pydantic", "pydantic_core", "importlib.metadata")


@pytest.mark.parametrize("args, allow", [
    (["--help"], ()),
    (["golden", "--help"], TYPER_COERCION),
    (["compile", "--help"], TYPER_COERCION),
    (["train", "--help"], TYPER_COERCION),
])
def test_help_imports_no_library_module(args: list[str], allow: tuple[str, ...]) -> None:
    code, modules, text = imported_by(*args)
    assert code == 0 and "Usage: ernie-ir" in text
    assert heavy(modules, allow) == []


def test_a_usage_error_imports_no_library_module() -> None:
    code, modules, _ = imported_by("--no-such-option")
    assert code == 2
    assert heavy(modules) == []


@pytest.mark.slow
def test_a_command_still_reaches_the_library() -> None:
    code, modules, text = imported_by("passes")
    assert code in (0, None) and "fp8-quant" in text
    assert {"ernie_ir.passes", "pydantic"} <= modules
