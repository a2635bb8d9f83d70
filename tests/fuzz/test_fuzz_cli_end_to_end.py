"""Crashes the fuzzer found, through the real command line: exit 2, one `error:` line on stderr,
nothing on stdout (the CLI contract the readers' ErnieIRErrors exist for)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _cli_kit import user_error
from test_fuzz_ir_text import DEEP_ATTR, NEWLINE_PARAM, SURROGATE_LOC

GPT = "gpt-345m@tiny"


@pytest.mark.parametrize(("text", "says"), [(DEEP_ATTR, "nested deeper"), (SURROGATE_LOC, "surrogate"),
                                            (NEWLINE_PARAM, "undeclared param")])
def test_show_bad_ir(capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "g.ir"
    path.write_text(text, encoding="utf-8")
    assert says in user_error(capsys, "show", str(path))


@pytest.mark.parametrize("size", ["0.5e999999999999KB", "80e309GB", "80\u212a"])
def test_plan_bad_device_memory(capsys: pytest.CaptureFixture[str], size: str) -> None:
    assert "--device-memory" in user_error(capsys, "plan", GPT, "--target", "cuda", "--device-memory", size)


def test_run_empty_token_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "ids.npy").write_bytes(b"")
    assert "not a plain .npy array" in user_error(capsys, "run", GPT, "--tokens", str(tmp_path / "ids.npy"))


def test_show_pipeline_yaml_nested(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("- " + "[" * 3000 + "]" * 3000, encoding="utf-8")
    assert "nested deeper" in user_error(capsys, "show", GPT, "--pipeline", str(tmp_path / "p.yaml"))
