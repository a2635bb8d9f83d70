"""pytest plugin: collects golden cases (`*.ir` files starting with `// golden case`)
as tests, and offers the `golden` fixture for goldens written from test code.

`pytest --update-goldens` (or ERNIE_IR_UPDATE_GOLDENS=1) rewrites failing
goldens instead of failing; CI only checks. Goldens compare param values (a
content hash per param) as well as structure; `pytest --golden-structure-only`
compares structure alone (and `golden.check(..., structure_only=True)` does for
one golden, which it then writes without hashes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .golden import STRUCTURE, VALUES, GoldenCase, _is_golden, _written_by_test, update_requested


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite failing ernie-ir golden files instead of failing")
    parser.addoption("--golden-structure-only", action="store_true", default=False,
                     help="compare ernie-ir goldens by structure only (not param values)")


def _updating(config: pytest.Config) -> bool:
    return bool(config.getoption("--update-goldens", default=False)) or update_requested()


def _structure_only(config: pytest.Config) -> bool:
    return bool(config.getoption("--golden-structure-only", default=False))


def pytest_collect_file(parent: pytest.Collector, file_path: Path) -> pytest.Collector | None:
    if file_path.suffix == ".ir" and _is_golden(file_path) and not _written_by_test(file_path):
        return GoldenFile.from_parent(parent, path=file_path)
    return None


class GoldenFile(pytest.File):
    def collect(self) -> Any:
        yield GoldenItem.from_parent(self, name=self.path.name)


class GoldenMismatch(Exception):
    pass


class GoldenItem(pytest.Item):
    def runtest(self) -> None:
        case = GoldenCase.read(self.path)
        actual = case.compute()
        result = case.check(actual, structure_only=_structure_only(self.config))
        if result.ok:
            return
        if _updating(self.config):
            case.write(actual)
            return
        raise GoldenMismatch(f"{result.reason}\n{result.diff}\n"
                             "(run pytest --update-goldens or `ernie-ir golden update` to accept)")

    def repr_failure(self, excinfo: Any, style: Any = None) -> str:
        if isinstance(excinfo.value, GoldenMismatch):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"golden: {self.path.name}"


class GoldenFixture:
    """`golden.check(graph, path, input=..., pipeline=...)` in a test."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def check(self, graph: Any, path: str | Path, *, input: str = "<test>", pipeline: str = "",
              structure_only: bool = False) -> None:
        """Compare `graph` with the golden at `path` (structure and param values, or with
        `structure_only` structure alone, and a new golden is then written without hashes)."""
        p = Path(path)
        if p.exists():
            case = GoldenCase.read(p)
        else:
            case = GoldenCase.new(p, input, pipeline, compare=STRUCTURE if structure_only else VALUES)
        result = case.check(graph, structure_only=structure_only or _structure_only(self.config))
        if result.ok:
            return
        if _updating(self.config):
            case.write(graph)
            return
        pytest.fail(f"golden {p} differs: {result.reason}\n{result.diff}", pytrace=False)


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> GoldenFixture:
    return GoldenFixture(request.config)
