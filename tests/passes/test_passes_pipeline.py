"""Pipelines as text and YAML: parsing, validation with precise errors, presets, and the
canonical text (`str(pipeline)`) that parses back to itself."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from _passes_testkit import registered
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import Field

from ernie_ir.ir import DType, Graph
from ernie_ir.passes import Pass, PassContext, PassOptions, Pipeline, PipelineError, load_pipeline
from ernie_ir.passes.infra.pipeline_syntax import PassSpec, parse_pipeline_text
from ernie_ir.passes.infra.registry import REGISTRY


class KnobsOptions(PassOptions):
    rank: int = 8
    alpha: float = 1.0
    enabled: bool = True
    label: str = "default"
    targets: list[str] = Field(default_factory=list)
    sizes: tuple[int, ...] = ()
    mode: Literal["fast", "exact"] = "exact"
    dtype: DType = DType.BF16
    max_len: int = 0


class Knobs(Pass):
    """A pass with one option of every kind; it changes nothing."""

    name = "t-knobs"
    description = "Has options of every kind."
    Options = KnobsOptions

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        return False


@pytest.fixture(autouse=True)
def knobs() -> Iterator[None]:
    with registered(Knobs):
        yield


@pytest.fixture
def presets() -> Iterator[None]:
    added = {"t-cleanup": "canonicalize,t-knobs{rank=2},dce", "t-loop-a": "dce,t-loop-b",
             "t-loop-b": "t-loop-a"}
    for name, text in added.items():
        REGISTRY.add_preset(name, text, f"test preset {name}")
    try:
        yield
    finally:
        for name in added:
            REGISTRY.presets.pop(name, None)


def options_of(pipeline: Pipeline, index: int = 0) -> dict[str, object]:
    return pipeline.passes[index].options.model_dump()


# -- text --------------------------------------------------------------------------------------------


def test_pipeline_text_option_values_have_types():
    (spec,) = parse_pipeline_text(
        't-knobs{rank=32, alpha=0.5, enabled=false, label="a b, {c}", targets=[".*qkv.*", o_proj],'
        "sizes=[1,-2], mode=fast, dtype=f16, max-len=3}")
    assert spec == PassSpec("t-knobs", {
        "rank": 32, "alpha": 0.5, "enabled": False, "label": "a b, {c}",
        "targets": [".*qkv.*", "o_proj"], "sizes": [1, -2], "mode": "fast", "dtype": "f16",
        "max_len": 3,
    }, "position 1")


@pytest.mark.parametrize(("text", "value"), [
    ("1", 1), ("-3", -3), ("1.5", 1.5), ("1e-3", 0.001), ("-2.5e+2", -250.0), ("true", True),
    ("False", False), ("none", None), ("fast", "fast"), ("a/b.yaml", "a/b.yaml"),
    ('"12"', "12"), ('"true"', "true"), ('"with \\"quotes\\""', 'with "quotes"'), ("[]", []),
    ("[[1, 2], [x]]", [[1, 2], ["x"]]),
])
def test_pipeline_text_values(text: str, value: object):
    (spec,) = parse_pipeline_text(f"p{{v={text}}}")
    assert spec.options == {"v": value}
    assert type(spec.options["v"]) is type(value)


def test_pipeline_text_names_positions_and_whitespace():
    specs = parse_pipeline_text("  canonicalize , cse{ }, dce  ")
    assert [(s.name, s.options, s.where) for s in specs] == [
        ("canonicalize", {}, "position 1"), ("cse", {}, "position 2"), ("dce", {}, "position 3")]
    assert parse_pipeline_text("") == [] and parse_pipeline_text("   ") == []
    assert str(load_pipeline("")) == ""


@pytest.mark.parametrize(("text", "message"), [
    ("dce,,cse", "pipeline 'dce,,cse': expected a pass name at character 5"),
    ("dce,", "pipeline 'dce,': expected a pass name at character 5"),
    ("9dce", "pipeline '9dce': expected a pass name at character 1"),
    ("dce cse", "pipeline 'dce cse': expected ',', found 'c' at character 5"),
    ("t-knobs{rank=1", "pipeline 't-knobs{rank=1': expected ',', found 'end of text' at character 15"),
    ("t-knobs{rank}", "pipeline 't-knobs{rank}': expected '=', found '}' at character 13"),
    ("t-knobs{=1}", "pipeline 't-knobs{=1}': expected an option name at character 9"),
    ("t-knobs{rank=}", "pipeline 't-knobs{rank=}': expected a value, found '}' at character 14"),
    ('t-knobs{label="open}', "pipeline 't-knobs{label=\"open}': unterminated string at character 15"),
    ("t-knobs{targets=[a,b}", "pipeline 't-knobs{targets=[a,b}': expected ',', found '}' at "
                              "character 21"),
    ("t-knobs{rank=1,rank=2}", "pipeline 't-knobs{rank=1,rank=2}': option 'rank' given twice at "
                               "character 16"),
    ("t-knobs{max-len=1,max_len=2}", "pipeline 't-knobs{max-len=1,max_len=2}': option 'max_len' "
                                     "given twice at character 19"),
])
def test_malformed_pipeline_text_names_the_character(text: str, message: str):
    with pytest.raises(PipelineError) as e:
        load_pipeline(text)
    assert str(e.value) == message


@pytest.mark.parametrize(("text", "message"), [
    ("canonicalise", "position 1: unknown pass 'canonicalise' (did you mean canonicalize?); "
                     "`ernie-ir passes` lists them"),
    ("dce,t-knob", "position 2: unknown pass 't-knob' (did you mean t-knobs?); "
                   "`ernie-ir passes` lists them"),
    ("zzz", "position 1: unknown pass 'zzz'; `ernie-ir passes` lists them"),
    ("t-knobs{rank=high}", "position 1: pass t-knobs: bad option (rank: Input should be a valid "
                           "integer, unable to parse string as an integer); valid options: rank, "
                           "alpha, enabled, label, targets, sizes, mode, dtype, max_len"),
    ("t-knobs{mode=slow}", "position 1: pass t-knobs: bad option (mode: Input should be 'fast' or "
                           "'exact')"),
    ("t-knobs{dtype=f64}", "position 1: pass t-knobs: bad option (dtype: Input should be 'f32', "),
    ("t-knobs{rnak=3}", "position 1: pass t-knobs: bad option (rnak: Extra inputs are not "
                        "permitted)"),
    ("dce{aggressive=true}", "position 1: pass dce: bad option (aggressive: Extra inputs are not "
                             "permitted); valid options: none"),
    ("O1{x=1}", "preset O1 (position 1) takes no options; its pipeline is canonicalize,cse,dce"),
])
def test_invalid_pipelines_say_what_and_where(text: str, message: str):
    with pytest.raises(PipelineError) as e:
        load_pipeline(text)
    assert str(e.value).startswith(message)


# -- presets ---------------------------------------------------------------------------------------


def test_a_preset_expands_in_place():
    assert str(load_pipeline("fuse-linear-bias,O1,t-knobs")) == \
        "fuse-linear-bias,canonicalize,cse,dce,t-knobs"


def test_presets_expand_recursively_and_keep_their_options(presets: None):
    pipeline = load_pipeline("t-cleanup,O1")
    assert str(pipeline) == "canonicalize,t-knobs{rank=2},dce,canonicalize,cse,dce"
    assert options_of(pipeline, 1)["rank"] == 2


def test_a_preset_that_names_itself_is_an_error(presets: None):
    with pytest.raises(PipelineError, match=r"^preset t-loop-\w expands recursively$"):
        load_pipeline("t-loop-a")


def test_a_preset_cannot_shadow_a_pass():
    with pytest.raises(PipelineError, match=r"^preset 'dce' clashes with a pass of that name$"):
        REGISTRY.add_preset("dce", "cse", "shadow")


# -- YAML ----------------------------------------------------------------------------------------


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_yaml_pipeline_as_a_list_and_under_a_pipeline_key(tmp_path: Path):
    as_list = write(tmp_path, "list.yaml", "- canonicalize\n- t-knobs: {rank: 4, max-len: 9}\n- dce:\n")
    keyed = write(tmp_path, "keyed.yml", """\
description: the same pipeline, spelled out
pipeline:
  - canonicalize
  - t-knobs:
      rank: 4
      max_len: 9
  - dce
""")
    for path in (as_list, keyed):
        pipeline = load_pipeline(path)
        assert str(pipeline) == "canonicalize,t-knobs{rank=4,max_len=9},dce"
        assert options_of(pipeline, 1)["max_len"] == 9


def test_yaml_option_values_keep_their_yaml_types(tmp_path: Path):
    path = write(tmp_path, "p.yaml", """\
pipeline:
  - t-knobs:
      alpha: 2.5e-1
      enabled: no
      label: "true"
      targets: [".*qkv.*", o_proj]
      sizes: [2, 3]
      dtype: f16
""")
    assert str(load_pipeline(path)) == ('t-knobs{alpha=0.25,enabled=false,label="true",'
                                        'targets=[.*qkv.*,o_proj],sizes=[2,3],dtype=f16}')


@pytest.mark.parametrize(("text", "message"), [
    ("pipeline:\n  - dce\n  - cse: {a: [1, 2\n",
     "bad.yaml: invalid YAML at line 4, column 1: expected ',' or ']', but got '<stream end>'"),
    ("- dce\n-\tcse\n", "bad.yaml: invalid YAML at line 2, column 2: found character '\\t' that "
                         "cannot start any token"),
    ("passes: [dce]\nextra: 1\n", "bad.yaml: expected a list of passes or a 'pipeline:' key, "
                                  "found keys ['extra', 'passes']"),
    ("dce\n", "bad.yaml: a pipeline is a list of passes"),
    ("- dce: 1\n", "item 1 of bad.yaml: options of 'dce' must be a mapping"),
    ("- [dce]\n", "item 1 of bad.yaml: expected a pass name or {name: {options}}"),
    ("- dce\n- {cse: {}, dce: {}}\n", "item 2 of bad.yaml: expected a pass name or {name: {options}}"),
    ("- dce\n- csee\n", "item 2 of bad.yaml: unknown pass 'csee' (did you mean cse?)"),
    ("- t-knobs: {rank: [1]}\n", "item 1 of bad.yaml: pass t-knobs: bad option (rank: Input should "
                                 "be a valid integer)"),
])
def test_invalid_yaml_pipelines_say_what_and_where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  text: str, message: str):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "bad.yaml", text)
    with pytest.raises(PipelineError) as e:
        load_pipeline("bad.yaml")
    assert str(e.value).startswith(message)


def test_a_missing_yaml_file_is_named(tmp_path: Path):
    with pytest.raises(PipelineError, match=r"^pipeline file .*nope\.yaml does not exist$"):
        load_pipeline(str(tmp_path / "nope.yaml"))


# -- canonical text ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "canonical"), [
    ("dce", "dce"),
    (" canonicalize , cse ", "canonicalize,cse"),
    ("t-knobs{rank=8,alpha=1.0,enabled=true,mode=exact}", "t-knobs"),  # defaults are left out
    ("t-knobs{max-len=4, rank=2}", "t-knobs{rank=2,max_len=4}"),  # schema order, underscores
    ('t-knobs{label="fast"}', "t-knobs{label=fast}"),
    ('t-knobs{label="none"}', 't-knobs{label="none"}'),
    ('t-knobs{label="1.5"}', 't-knobs{label="1.5"}'),
    ('t-knobs{label=""}', 't-knobs{label=""}'),
    ('t-knobs{label="it\'s \\"x\\", {y}"}', 't-knobs{label="it\'s \\"x\\", {y}"}'),
    ("t-knobs{alpha=1e-05,sizes=[1,2]}", "t-knobs{alpha=1e-05,sizes=[1,2]}"),
    ("t-knobs{alpha=3}", "t-knobs{alpha=3.0}"),
    ("t-knobs{targets=[a, \"b c\", \"1\"]}", 't-knobs{targets=[a,"b c","1"]}'),
    ("t-knobs{dtype=f32}", "t-knobs{dtype=f32}"),
    ("O1", "canonicalize,cse,dce"),
])
def test_str_of_a_pipeline_is_canonical_and_parses_to_itself(text: str, canonical: str):
    pipeline = load_pipeline(text)
    assert str(pipeline) == canonical
    again = load_pipeline(str(pipeline))
    assert str(again) == canonical
    assert [p.options for p in again] == [p.options for p in pipeline]


option_values = st.fixed_dictionaries({}, optional={
    "rank": st.integers(-(2**63), 2**63),
    "alpha": st.floats(allow_nan=False),
    "enabled": st.booleans(),
    "label": st.text(max_size=12),
    "targets": st.lists(st.text(max_size=6), max_size=3),
    "sizes": st.lists(st.integers(-5, 10**6), max_size=3).map(tuple),
    "mode": st.sampled_from(["fast", "exact"]),
    "dtype": st.sampled_from(list(DType)),
    "max_len": st.integers(0, 10),
})


@settings(max_examples=60, deadline=None)
@given(options=option_values)
def test_any_options_round_trip_through_the_pipeline_text(options: dict[str, object]):
    pipeline = Pipeline([Knobs(options), *load_pipeline("cse")])
    text = str(pipeline)
    again = load_pipeline(text)
    assert str(again) == text
    got = again.passes[0].options
    for key, value in options.items():
        have = getattr(got, key)
        if isinstance(value, float) and math.isinf(value):
            assert have == value
        else:
            assert have == value, (key, text)
