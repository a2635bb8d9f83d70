"""The docs' examples run as written (so they cannot rot).

Each page's fenced blocks run in order, in one namespace, in an empty folder:
- `python` blocks are executed;
- a `text` block right after a `python` block is the output that block must print;
- `bash` blocks: each `ernie-ir ...` line runs the CLI in this process (so passes the
  page registered are known) and must exit 0;
- `toml` blocks are parsed, and entry-point tables must name a known group.
A page listed in FULLY_EXECUTED may hold no other kind of block. The pages of PYTHON_ONLY run
their `python` blocks alone (each at least the number given), in one namespace; their command
lines are shown against `/data/...` folders and the user's files. README.md and
docs/user-guide.md run whole, commands included, in tests/test_guide_runs.py.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
FULLY_EXECUTED = {"pass-authoring.md"}
PYTHON_ONLY = {"frontends.md": 2, "fusion.md": 3, "quantization.md": 1}
ENTRY_POINT_GROUPS = {"ernie_ir.passes", "ernie_ir.ops", "ernie_ir.targets"}


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in order (language "" when unlabeled)."""
    return re.findall(r"^```([\w-]*)\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return [code for lang, code in fenced_blocks(path) if lang == "python"]


def run_cli_line(line: str, where: str) -> None:
    from ernie_ir.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(shlex.split(line, comments=True)[1:])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    assert code == 0, f"{where}: `{line}` exited {code}: {err.getvalue()}{out.getvalue()}"


def check_toml(code: str, where: str) -> None:
    data = tomllib.loads(code)
    groups = data.get("project", {}).get("entry-points", {})
    for group in groups:
        assert group in ENTRY_POINT_GROUPS, f"{where}: unknown entry-point group {group!r}"


def run_page(name: str, python_only: bool = False) -> None:
    blocks = fenced_blocks(DOCS / name)
    assert any(lang == "python" for lang, _ in blocks), f"{name} has no python examples"
    if python_only:
        blocks = [(lang, code) for lang, code in blocks if lang == "python"]
    namespace: dict[str, object] = {"__name__": f"docs_{name.replace('-', '_').replace('.', '_')}"}
    printed: str | None = None
    for i, (lang, code) in enumerate(blocks, 1):
        where = f"{name}[block {i}]"
        if lang == "python":
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(compile(code, where, "exec"), namespace)
            printed = buf.getvalue()
            continue
        if lang == "text" and printed is not None:
            assert printed.strip() == code.strip(), f"{where}: the block before prints\n{printed}"
        elif lang == "bash":
            for line in code.splitlines():
                if line.strip().startswith("ernie-ir "):
                    run_cli_line(line.strip(), where)
        elif lang == "toml":
            check_toml(code, where)
        elif name in FULLY_EXECUTED:
            pytest.fail(f"{where}: a {lang or 'unlabeled'} block is neither run nor checked "
                        "(use python, bash, toml, or text right after the python it shows)")
        printed = None


@pytest.mark.parametrize("name", ["pass-authoring.md", "ir.md", "architecture.md", "ops.md"])
def test_doc_examples_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    from ernie_ir.passes.infra.registry import REGISTRY

    REGISTRY.ensure_loaded()  # snapshot the built-ins too, or the cleanup below would drop them
    before = dict(REGISTRY.passes)
    from ernie_ir.ir import registry as ops

    ops_before = set(ops.all_ops())  # docs/ops.md registers an op
    try:
        run_page(name)
    finally:
        # The pages register passes; keep the registry as other tests expect it.
        for key in set(REGISTRY.passes) - set(before):
            del REGISTRY.passes[key]
            REGISTRY.origins.pop(key, None)
        for key in set(ops.all_ops()) - ops_before:
            ops.REGISTRY.remove(key)


@pytest.mark.parametrize("name", sorted(PYTHON_ONLY))
def test_doc_python_examples_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python examples of pages whose commands need data folders (docs/frontends.md,
    fusion.md, quantization.md): each page's blocks in order, in one namespace."""
    assert len(python_blocks(DOCS / name)) >= PYTHON_ONLY[name], f"{name} lost python examples"
    monkeypatch.chdir(tmp_path)
    run_page(name, python_only=True)


def test_a_text_block_that_differs_from_the_output_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nprint('hello')\n```\n\n```text\ngoodbye\n```\n", encoding="utf-8")
    global DOCS
    saved, DOCS = DOCS, tmp_path
    try:
        with pytest.raises(AssertionError, match="the block before prints"):
            run_page("page.md")
    finally:
        DOCS = saved
