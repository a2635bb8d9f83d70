"""Fuzz the plain functions behind CLI options: --device-memory, --tokens (ids or a .npy file),
--quant, and the patterns of a quant config."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from _fuzz_strategies import (
    MEMORY_TEXTS,
    PATTERN_TEXTS,
    QUANT_TEXTS,
    TOKEN_TEXTS,
    check_total,
    fuzz_settings,
    memory_property,
    npy_files,
    npy_tokens_property,
    pattern_property,
    quant_property,
    tokens_property,
)
from hypothesis import example, given

from ernie_ir.ir import ErnieIRError
from ernie_ir.planning.units import parse_memory

HUGE_EXPONENT = "0.5e999999999999KB"  # 10 ** 999999999999: never returns
OVERFLOW = "80e309GB"  # OverflowError: int too large to convert to float
LONG_EXPONENT = "1e" + "9" * 5000 + "GB"  # ValueError: int() of more than 4300 digits
KELVIN = "80\u212a"  # KELVIN SIGN matches [K] under re.IGNORECASE, then KeyError 'K'


@fuzz_settings(300)
@given(MEMORY_TEXTS)
@example(HUGE_EXPONENT)
@example(OVERFLOW)
@example(LONG_EXPONENT)
@example(KELVIN)
def test_memory_sizes_are_total(text: str) -> None:
    check_total(memory_property, text)


@pytest.mark.parametrize("text", [HUGE_EXPONENT, OVERFLOW, LONG_EXPONENT, KELVIN, "1e-400G"])
def test_memory_regressions(text: str) -> None:
    elapsed, accepted = check_total(memory_property, text)
    assert not accepted and elapsed < 1.0
    with pytest.raises(ErnieIRError, match="--device-memory"):
        parse_memory(text)


def test_memory_sizes_still_read() -> None:
    assert parse_memory("80GiB") == parse_memory("80G") == parse_memory("80gb") == 80 * 2**30
    assert parse_memory("1.5T") == 3 * 2**39
    assert parse_memory("8e10B") == 80_000_000_000
    assert parse_memory(" 512 MiB ") == 512 * 2**20


@fuzz_settings(250)
@given(TOKEN_TEXTS)
def test_token_lists_are_total(text: str) -> None:
    check_total(tokens_property, text)


@fuzz_settings(200)
@given(npy_files())
@example(b"")  # EOFError from np.load
@example(b"\x93NUMPY\x01\x00v\x00{'descr': '<i8', 'fortran_order': False, 'shape': (1000000000000, "
         b"1000000000000), }" + b" " * 40 + b"\n")  # OverflowError from the memory map (bad_input corpus)
def test_token_files_are_total(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        check_total(npy_tokens_property, Path(tmp) / "ids.npy", raw, trace_memory=True)


@fuzz_settings(150)
@given(QUANT_TEXTS)
def test_quant_names_are_total(text: str) -> None:
    check_total(quant_property, text)


@fuzz_settings(150)
@given(PATTERN_TEXTS)
@example("x{99999999999}")  # OverflowError from re.compile
@example("(" * 5000)  # RecursionError from re.compile
def test_quant_patterns_are_total(text: str) -> None:
    check_total(pattern_property, text)
