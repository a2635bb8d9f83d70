"""Run `ernie-ir` in the test's own process and check the CLI's error contract.

    code, out, err = cli(capsys, "show", "gpt-345m@tiny")
    code, out, err = run_cli("train", "art", "--steps", "2")  # no capsys: module-scoped fixtures
    line = user_error(capsys, "compile", "gpt-345m@tiny", "--target", "tpu")  # the one error line

Importable from every test folder: tests/conftest.py puts tests/ on sys.path.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from ernie_ir.cli.app import main


def cli(capsys: pytest.CaptureFixture[str], *argv: str, width: int | None = None) -> tuple[int, str, str]:
    """`ernie-ir ARGV` in this process: (exit code, stdout, stderr). `width`: lay rich tables out at
    that many columns (in-process they get 80 unless told otherwise)."""
    from ernie_ir.cli import common

    capsys.readouterr()
    saved = common.out._width, common.err._width
    if width is not None:
        common.out._width = common.err._width = width
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        common.out._width, common.err._width = saved
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_cli(*argv: str) -> tuple[int, str, str]:
    """`ernie-ir ARGV` in this process without capsys (module-scoped fixtures have none): (exit
    code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def user_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The CLI's error contract: exit 2, one `error:` line on stderr, no traceback, empty stdout;
    returns that line."""
    code, out, err = cli(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert out == "", out
    return lines[0]
