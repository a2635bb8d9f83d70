"""`quant-annotate` takes a `QuantConfig` object as well as a preset name or a file path.

A researcher building a layer-selective quantization in Python should not have to write a
YAML file first: `QuantAnnotate({"config": cfg})` and `quant-annotate{config=...}` in a
pipeline (the config written inline) decide exactly what the same config read from a file
decides, and the pipeline text of such a pass round-trips.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ernie_ir.load import load_input
from ernie_ir.passes import PipelineError, run_pipeline
from ernie_ir.passes.infra.pipeline import Pipeline, load_pipeline
from ernie_ir.passes.quant.annotate import ANNOTATION, QuantAnnotate, QuantAnnotateOptions
from ernie_ir.passes.quant.config import QuantConfig
from ernie_ir.passes.quant.weight_only import WeightOnlyQuant

# Layer-selective: layer 1's MLP in INT4, every out_proj in INT8, nothing else.
CONFIG = {
    "name": "layer-selective",
    "rules": [
        {"match": r".*\.layers\.1\.linear[12]", "algo": "weight_only_int4"},
        {"match": r".*out_proj", "algo": "weight_only_int8"},
    ],
}
MODEL = "gpt-345m@tiny"


def _annotations(graph) -> dict[str, dict]:
    return {name: p.annotations[ANNOTATION] for name, p in graph.params.items()
            if ANNOTATION in p.annotations}


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "layer-selective.yaml"
    path.write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    return path


def test_a_config_object_annotates_what_the_same_config_file_annotates(config_file: Path):
    cfg = QuantConfig.from_dict(CONFIG)
    from_object = load_input(MODEL)
    run_pipeline(from_object, Pipeline([QuantAnnotate({"config": cfg})]))
    from_file = load_input(MODEL)
    run_pipeline(from_file, f'quant-annotate{{config="{config_file}"}}')

    got = _annotations(from_object)
    assert got == _annotations(from_file)
    assert sorted(got) == [
        "gpt.decoder.layers.0.self_attn.out_proj.weight",
        "gpt.decoder.layers.1.linear1.weight",
        "gpt.decoder.layers.1.linear2.weight",
        "gpt.decoder.layers.1.self_attn.out_proj.weight",
    ]
    assert got["gpt.decoder.layers.1.linear1.weight"]["algo"] == "weight_only_int4"
    assert got["gpt.decoder.layers.0.self_attn.out_proj.weight"]["algo"] == "weight_only_int8"
    assert from_object.metadata["quantization"]["name"] == "layer-selective"


def test_options_accept_an_object_a_path_and_a_string(config_file: Path):
    cfg = QuantConfig.from_dict(CONFIG)
    assert QuantAnnotate(QuantAnnotateOptions(config=cfg)).config == cfg
    assert QuantAnnotate({"config": config_file}).config.rules == cfg.rules
    assert QuantAnnotate({"config": str(config_file)}).config.rules == cfg.rules


def test_a_pipeline_with_a_config_object_converts_and_round_trips():
    cfg = QuantConfig.from_dict(CONFIG)
    pipeline = Pipeline([QuantAnnotate({"config": cfg}), WeightOnlyQuant()])
    text = str(pipeline)
    assert text.startswith('quant-annotate{config={name=layer-selective,rules=[{algo=weight_only_int4,')
    assert load_pipeline(text) == pipeline
    graph = load_input(MODEL)
    result = run_pipeline(graph, pipeline)
    assert result.changed_by == ["quant-annotate", "weight-only-quant"]
    ops = {n.scope: n.op for n in graph if n.op in ("linear", "weight_only_linear")}
    assert ops["gpt.decoder.layers.1.linear1"] == "weight_only_linear"
    assert ops["gpt.decoder.layers.0.linear1"] == "linear"
    assert str(graph.params["gpt.decoder.layers.1.linear1.quant_weight"].type) == "i4[64,256]"
    assert str(graph.params["gpt.decoder.layers.0.self_attn.out_proj.quant_weight"].type).startswith("i8[")


def test_an_inline_config_in_pipeline_text_is_validated_like_a_file():
    with pytest.raises(PipelineError, match=r"quant-annotate: bad option \(config"):
        load_pipeline('quant-annotate{config={rules=[{match="(", algo=weight_only_int8}]}}')
    with pytest.raises(PipelineError, match="give exactly one of preset=NAME or config="):
        QuantAnnotate({"preset": "wint8", "config": QuantConfig.preset("wint4")})
