"""Helpers for the pass-infrastructure tests: IR text in, IR text out.

Tests state graphs as IR text (`ir(...)`), run a rule set or a pipeline, and
compare with an expected IR text structurally (`assert_ir`), so a failure
shows the first difference and both graphs.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _cli_kit import cli as run_cli

import ernie_ir  # noqa: F401  (registers the op set)
from ernie_ir.ir import Graph
from ernie_ir.ir.equality import structural_diff
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.weights import GeneratedSource
from ernie_ir.passes import Pass, RewriteRule, RuleSet
from ernie_ir.passes.infra.registry import REGISTRY

VENV_BIN = Path(sys.executable).parent
ERNIE_IR = str(VENV_BIN / "ernie-ir")


def ir(text: str) -> Graph:
    """Parse IR text written indented inside a test."""
    return parse_graph(textwrap.dedent(text).strip() + "\n")


def assert_ir(actual: Graph, expected: str | Graph) -> None:
    """`actual` equals `expected` structurally (value names do not matter)."""
    want = ir(expected) if isinstance(expected, str) else expected
    why = structural_diff(actual, want)
    assert why is None, (f"{why}\n--- actual ---\n{print_graph(actual)}"
                         f"--- expected ---\n{print_graph(want)}")


def apply_rules(graph: Graph, *rules: RewriteRule) -> int:
    return RuleSet(rules).apply(graph)


def explain_one(graph: Graph, rule: RewriteRule) -> Any:
    (trace,) = RuleSet([rule]).explain(graph)
    return trace


def with_weights(graph: Graph, seed: int = 0) -> Graph:
    """Give every param deterministic random data (params from text have none)."""
    for i, p in enumerate(graph.params.values()):
        p.source = GeneratedSource(p.type.dtype, [int(d) for d in p.type.shape], seed=seed + i,
                                   std=0.5)
    return graph


def random_inputs(graph: Graph, sizes: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for v in graph.inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in v.type.shape]
        out[v.name or ""] = rng.standard_normal(shape).astype(np.float32)
    return out


@contextlib.contextmanager
def registered(*classes: type[Pass]) -> Iterator[None]:
    """Make test passes known to pipelines for the duration of a test."""
    REGISTRY.ensure_loaded()
    added = []
    for cls in classes:
        if cls.name not in REGISTRY.passes:
            REGISTRY.add(cls, origin="tests/passes")
            added.append(cls.name)
    try:
        yield
    finally:
        for name in added:
            REGISTRY.passes.pop(name, None)
            REGISTRY.origins.pop(name, None)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`ernie-ir ARGV` in this process, tables 240 columns wide: (exit code, stdout, stderr)."""
    return run_cli(capsys, *argv, width=240)


def run_tool(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None
             ) -> subprocess.CompletedProcess[str]:
    """Run a console script of the venv in a subprocess (wide, plain output)."""
    full_env = {k: v for k, v in os.environ.items() if k != "ERNIE_IR_UPDATE_GOLDENS"}
    full_env.update(COLUMNS="240", NO_COLOR="1")
    full_env.update(env or {})
    return subprocess.run(list(argv), env=full_env, cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def one_error_line(stderr: str) -> str:
    """The CLI's error contract: one line on stderr, no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    return lines[0]
