"""Fuzz the safetensors reader and graph folders: valid files with mutated headers (lengths,
offsets, dtypes, shapes, duplicate keys, int4 metadata, the 8-byte length prefix), truncated or
extended. Opening reads the header only; reading a tensor returns its declared shape, never more
memory than the file holds."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
from _fuzz_strategies import (
    check_total,
    fuzz_settings,
    graph_folder_property,
    print_graph,
    safetensors_files,
    safetensors_property,
    safetensors_seed,
    seed_graph,
    split_safetensors,
)
from hypothesis import example, given

from ernie_ir.ir.errors import WeightError
from ernie_ir.ir.weights import SafetensorsFile

_TMP = tempfile.mkdtemp(prefix="ernie-ir-fuzz-seed-")
SEED = safetensors_seed(_TMP)
GRAPH_TEXT = print_graph(seed_graph(), with_hashes=True)


def _file(header: dict | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


NESTED = _file(b'{"x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")  # RecursionError in json.loads
LONG_OFFSET = _file(b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [' + b"9" * 5000 + b", 4]}}",
                    b"\0" * 4)  # ValueError: int() of more than 4300 digits
EMPTY_HUGE = _file({"e": {"dtype": "F32", "shape": [0, 10**30], "data_offsets": [0, 0]}})
EMPTY_HUGE_WITH_DATA = _file({"e": {"dtype": "U8", "shape": [10**30, 0], "data_offsets": [0, 0]},
                              "b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\1")
INT4_HUGE = _file({"__metadata__": {"ernie_ir.int4": json.dumps({"q": [0, 2**70]})},
                   "q": {"dtype": "U8", "shape": [0, 2**69], "data_offsets": [0, 0]}})
PREFIX_MAX = b"\xff" * 8 + SEED[8:]
INT4_META_DEEP = _file({"__metadata__": {"ernie_ir.int4": "[" * 50_000}})  # RecursionError
INT4_META_DIGITS = _file({"__metadata__": {"ernie_ir.int4": "1" * 5000}})  # ValueError


@pytest.mark.slow
@fuzz_settings(450)
@given(safetensors_files(SEED))
@example(SEED)
@example(NESTED)
@example(LONG_OFFSET)
@example(EMPTY_HUGE)
@example(EMPTY_HUGE_WITH_DATA)
@example(INT4_HUGE)
@example(PREFIX_MAX)
@example(INT4_META_DEEP)
@example(INT4_META_DIGITS)
def test_safetensors_reader_is_total(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        check_total(safetensors_property, Path(tmp) / "f.safetensors", raw, trace_memory=True)


@pytest.mark.slow
@fuzz_settings(200)
@given(safetensors_files(SEED))
@example(SEED)
@example(NESTED)
def test_graph_folder_is_total(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        check_total(graph_folder_property, Path(tmp), GRAPH_TEXT, raw, trace_memory=True)


@pytest.mark.parametrize(("raw", "words"), [
    (NESTED, "too deeply"), (LONG_OFFSET, "digits|too long"), (EMPTY_HUGE, "2\\*\\*63"),
    (EMPTY_HUGE_WITH_DATA, "2\\*\\*63"), (INT4_HUGE, "2\\*\\*63"), (PREFIX_MAX, "header length"),
    (INT4_META_DEEP, "ernie_ir.int4"), (INT4_META_DIGITS, "ernie_ir.int4")])
def test_safetensors_regressions(tmp_path: Path, raw: bytes, words: str) -> None:
    path = tmp_path / "f.safetensors"
    path.write_bytes(raw)
    with pytest.raises(WeightError, match=words) as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value)


def test_seed_file_round_trips() -> None:
    """The seed is a valid file with every dtype the reader knows, so mutations start from sense."""
    header, _data = split_safetensors(SEED)
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {
        "F32", "BF16", "U8", "BOOL", "F8_E4M3", "I64"}
    with tempfile.TemporaryDirectory() as tmp:
        _elapsed, accepted = check_total(safetensors_property, Path(tmp) / "f.safetensors", SEED)
    assert accepted
