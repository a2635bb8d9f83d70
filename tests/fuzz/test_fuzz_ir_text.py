"""Fuzz the IR text parser: mutated printed graphs parse, or fail with one IRParseError line.

Each regression example is an input that once escaped as a non-project exception.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from _fuzz_strategies import (
    SMALL_IR,
    check_total,
    fuzz_settings,
    ir_file_property,
    ir_files,
    ir_texts,
    parse_ir_both_paths,
    parse_ir_property,
)
from hypothesis import example, given

DEEP_ATTR = SMALL_IR.replace("{axis = -1}", "{axis = " + "[" * 5000 + "]" * 5000 + "}")
DEEP_META = SMALL_IR.replace('{model = "m"', "{model = " + "{a = " * 3000 + "1" + "}" * 3000)
LONG_DIM = SMALL_IR.replace("f32[4,4]", "f32[" + "9" * 5000 + ",4]")
LONG_INT = SMALL_IR.replace("axis = -1", "axis = " + "9" * 5000)
HUGE_DIM = SMALL_IR.replace("f32[4,4]", "f32[" + "9" * 30 + ",4]")
SURROGATE_LOC = SMALL_IR.replace('loc("proj")', 'loc("\\ud800")')
SURROGATE_META = SMALL_IR.replace('"m"', '"\\udc00"')
SURROGATE_NAME = SMALL_IR.replace('@"quoted name"', '@"\\ud800"')
RAW_SURROGATE = SMALL_IR.replace('"m"', '"\ud800"')
# Accepted by the fast path only (found by benchmarks/fuzz_soak.py):
TAB_IN_SCOPE = SMALL_IR.replace('loc("act")', 'loc("\t")')  # a raw control character in a string
TWO_STRINGS_SCOPE = SMALL_IR.replace('loc("act")', 'loc("act""act")')
NEWLINE_KEY = SMALL_IR.replace("{axis = -1}", '{"a\\nb" = 1}')  # the message held a raw newline
NEWLINE_PARAM = SMALL_IR.replace("linear(%x, @w)", 'linear(%x, @"a\\nb")')
JUNK_RESULT = SMALL_IR.replace("  return %3", "  %9 junk = add(%x, %xa) : f32[B,4]\n  return %3")


@pytest.mark.slow
@fuzz_settings(500)
@given(ir_texts())
@example(DEEP_ATTR)  # RecursionError in the attribute reader
@example(DEEP_META)  # RecursionError in the dict reader
@example(LONG_DIM)  # ValueError: int() of more than 4300 digits
@example(LONG_INT)
@example(HUGE_DIM)  # a dim no int64 holds
@example(SURROGATE_LOC)  # parsed, then UnicodeEncodeError when printed to disk
@example(SURROGATE_META)
@example(SURROGATE_NAME)
@example(RAW_SURROGATE)
@example(NEWLINE_KEY)
@example(NEWLINE_PARAM)
def test_ir_parser_is_total(text: str) -> None:
    check_total(parse_ir_property, text)


@pytest.mark.slow
@fuzz_settings(150)
@given(ir_texts())
@example(DEEP_ATTR)
@example(SURROGATE_LOC)
@example(TAB_IN_SCOPE)
@example(TWO_STRINGS_SCOPE)
@example(JUNK_RESULT)
def test_fast_and_general_parser_agree(text: str) -> None:
    check_total(parse_ir_both_paths, text)


@fuzz_settings(150)
@given(ir_files())
@example(SMALL_IR.encode("utf-8") + b"\xff")
@example("\ufeff".encode() + SMALL_IR.encode("utf-8"))
@example(SURROGATE_LOC.encode("utf-8"))
def test_ir_files_are_total(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        check_total(ir_file_property, Path(tmp) / "g.ir", raw)


def test_regressions_are_refused_with_a_position() -> None:
    """The inputs above are refused (not silently accepted), each at its line."""
    import re

    import pytest

    from ernie_ir.ir import IRParseError
    from ernie_ir.ir.parser import parse_graph

    for text, line, words in [(DEEP_ATTR, 6, "nested"), (DEEP_META, 2, "nested"),
                              (LONG_DIM, 3, "2**63"), (LONG_INT, 6, "digits"),
                              (HUGE_DIM, 3, "2**63"), (SURROGATE_LOC, 5, "surrogate"),
                              (SURROGATE_META, 2, "surrogate"), (SURROGATE_NAME, 4, "surrogate"),
                              (RAW_SURROGATE, 2, "surrogate"), (TAB_IN_SCOPE, 6, "control character"),
                              (TWO_STRINGS_SCOPE, 6, "expected ')'"), (JUNK_RESULT, 9, "expected '='")]:
        for fast in (True, False):
            with pytest.raises(IRParseError, match=re.escape(words)) as info:
                parse_graph(text, fast=fast)
            assert info.value.line == line, (words, str(info.value))
