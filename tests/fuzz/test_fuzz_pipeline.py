"""Fuzz the pipeline readers: text (`cse,lora{rank=2}`) and YAML, built against the registry.

An accepted pipeline must also print (`str(pipeline)`) to text that builds the same pipeline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _fuzz_strategies import (
    check_total,
    fuzz_settings,
    pipeline_text_property,
    pipeline_texts,
    pipeline_yaml_property,
    pipeline_yamls,
)
from hypothesis import example, given

from ernie_ir.passes.infra.pipeline import load_pipeline
from ernie_ir.passes.infra.pipeline_syntax import PipelineError, parse_pipeline_text, parse_pipeline_yaml

BAD_ESCAPE = 'fuse-parallel-block{bogus="N\\q",rank=nan}'  # JSONDecodeError: invalid \escape
BAD_UNICODE_ESCAPE = 'cse{rank="\\u0"}'
CONTROL_CHAR = 'lora{dtype="x\x17"}'  # JSONDecodeError: invalid control character
DEEP_FLOW = "- " + "[" * 3000 + "]" * 3000  # RecursionError in PyYAML's composer (slow, too)
DEEP_BLOCK = "- " * 2000 + "cse"
UNCLOSED_FLOW = "- " + "[" * 3000
BAD_TAGS = ["- !!int x", "- !!timestamp x", "- !!bool maybe", "- {lora: {rank: !!float .}}"]
"""PyYAML's constructors: ValueError, AttributeError, KeyError (found by benchmarks/fuzz_soak.py)."""
READER_ERROR = "T\x89"  # PyYAML ReaderError: a message of several lines
ALIAS_BOMB = ("a: &a [1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
              "c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\npipeline: [{lora: {rank: 2, targets: *c}}]\n")


@pytest.mark.slow
@fuzz_settings(500)
@given(pipeline_texts())
@example(BAD_ESCAPE)
@example(BAD_UNICODE_ESCAPE)
@example(CONTROL_CHAR)
def test_pipeline_text_is_total(text: str) -> None:
    check_total(pipeline_text_property, text)


@pytest.mark.slow
@fuzz_settings(300)
@given(pipeline_yamls())
@example(DEEP_FLOW)
@example(DEEP_BLOCK)
@example(UNCLOSED_FLOW)
@example(READER_ERROR)
@example(ALIAS_BOMB)
@example(BAD_TAGS[0])
@example(BAD_TAGS[1])
@example(BAD_TAGS[2])
@example('- {cse: {"x\\ny": 1}}')  # the option name went into the message raw: two lines
def test_pipeline_yaml_is_total(text: str) -> None:
    check_total(pipeline_yaml_property, text)


@pytest.mark.parametrize("text", [BAD_ESCAPE, BAD_UNICODE_ESCAPE, CONTROL_CHAR])
def test_bad_strings_name_the_position(text: str) -> None:
    with pytest.raises(PipelineError, match=r"invalid string .* at character"):
        parse_pipeline_text(text)


@pytest.mark.parametrize("text", [DEEP_FLOW, DEEP_BLOCK, UNCLOSED_FLOW])
def test_deep_yaml_is_refused_quickly(text: str) -> None:
    elapsed, accepted = check_total(parse_pipeline_yaml, text)
    assert not accepted and elapsed < 5.0
    with pytest.raises(PipelineError, match=r"fuzz\.yaml: (nested deeper|invalid YAML)"):
        parse_pipeline_yaml(text, "fuzz.yaml")


@pytest.mark.parametrize("text", BAD_TAGS)
def test_bad_yaml_tags_are_refused(text: str) -> None:
    with pytest.raises(PipelineError, match=r"p\.yaml: invalid YAML: a tagged value cannot be read"):
        parse_pipeline_yaml(text, "p.yaml")


def test_yaml_reader_error_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(READER_ERROR.encode("utf-8"))
    with pytest.raises(PipelineError) as info:
        load_pipeline(str(path))
    assert "\n" not in str(info.value) and "invalid YAML" in str(info.value)
