"""Fuzz config.json: built-in configs with mutated fields, and mutated config.json files.

An accepted config must also give JSON metadata and, when it has few layers, a meta graph.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from _fuzz_strategies import (
    check_total,
    config_dicts,
    config_file_property,
    config_property,
    config_texts,
    fuzz_settings,
)
from hypothesis import example, given

from ernie_ir.frontends.config import read_config
from ernie_ir.frontends.errors import ConfigError

GPT = {"architectures": ["GPTForCausalLM"], "vocab_size": 1024, "hidden_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256,
       "max_position_embeddings": 128}
DEEP = b"[" * 100_000  # RecursionError from json.loads
LONG_INT = b'{"architectures": ["GPTForCausalLM"], "vocab_size": ' + b"1" * 5000 + b"}"  # ValueError


@pytest.mark.slow
@fuzz_settings(450)
@given(config_dicts())
@example(GPT)
@example({"architectures": ["a\nb"]})  # the name went into the message raw: two lines
def test_config_dict_is_total(data: dict) -> None:
    check_total(config_property, data, trace_memory=True)


@pytest.mark.slow
@fuzz_settings(300)
@given(config_texts())
@example(DEEP)
@example(LONG_INT)
@example(b"1" * 5000)
@example(b'{"a": ' * 50_000)
def test_config_file_is_total(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        check_total(config_file_property, Path(tmp), raw)


@pytest.mark.parametrize(("raw", "words"), [(DEEP, "too deeply"), (LONG_INT, "digits")])
def test_config_file_regressions(tmp_path: Path, raw: bytes, words: str) -> None:
    (tmp_path / "config.json").write_bytes(raw)
    with pytest.raises(ConfigError, match=words) as info:
        read_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)
