"""Fuzz `--quant-config FILE.yaml`: every accepted form (ours, ERNIEKit, FastDeploy, PaddleSlim)
with mutated keys and rules, mutated YAML text, and the YAML specials (tags, aliases, nesting)."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
from _fuzz_strategies import check_total, fuzz_settings, quant_config_property, quant_config_texts
from hypothesis import example, given

from ernie_ir.passes.quant.config import QuantConfig, QuantConfigError, compile_pattern

READER_ERROR = "name: fp8\nrules:\n- algo: fp8\n  match: x\x1c\n"  # PyYAML ReaderError: several lines
DEEP = "- " + "[" * 3000 + "]" * 3000  # RecursionError in PyYAML's composer
RULES_NOT_A_LIST = "preset: wint8mix\nrules: 0\n"  # TypeError: [*rules] of an int
BAD_TAG = "name: x\nrules: [{match: .*, algo: !!int x}]\n"  # ValueError from PyYAML's constructor


@pytest.mark.slow
@fuzz_settings(250)
@given(quant_config_texts())
@example(READER_ERROR)
@example(DEEP)
@example(RULES_NOT_A_LIST)
@example(BAD_TAG)
def test_quant_config_is_total(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        check_total(quant_config_property, Path(tmp) / "q.yaml", text)


@pytest.mark.parametrize(("text", "words"), [
    (READER_ERROR, "invalid YAML"), (DEEP, "nested too deeply"), (RULES_NOT_A_LIST, "rules must be a list"),
    (BAD_TAG, "tagged value")])
def test_quant_config_regressions(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "q.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(QuantConfigError, match=words) as info:
        QuantConfig.from_yaml(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_patterns_compile_without_warnings() -> None:
    """A FutureWarning would be a second stderr line before the one error line."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compile_pattern("re:x[[a]").fullmatch("x[") is not None
