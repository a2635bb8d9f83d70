"""FastDeploy's `quantization_config` is written from what the quant passes recorded.

The resolved `QuantConfig` (`graph.metadata["quantization"]`, quant-annotate's), each packed
weight's decision under it (its `quant` annotation) and the w4a8c8 / wint2 passes' records: with
them, the config of the artifact's own rank graphs is the one its config.json holds; without one
of them, one line names the missing record (no guess from the weights' names).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ernie_ir.artifacts.manifest import load_rank_graphs
from ernie_ir.formats.fastdeploy import FastDeployError, quantization_config
from ernie_ir.ir import Graph
from ernie_ir.targets import CompileOptions, compile_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_testkit import tiny_config, write_paddle_checkpoint

DENSE = "ernie-4.5-0.3b@tiny"
# sizes that pack at sm80 and take W4A8's Hadamard block (tests/quant/test_w4a8c8_wint2_presets.py)
MOE_CFG = {**tiny_config("ernie-4.5-21b-a3b"), "hidden_size": 128, "moe_intermediate_size": 512,
           "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}


def compiled(out: Path, model: str, **kw: Any) -> tuple[Any, list[Graph], dict[str, Any] | None]:
    """(mapping, rank graphs, the written quantization_config; None where FastDeploy's loader could
    not read the folder and compile left it out, saying why)."""
    report = compile_model(model, "cuda", CompileOptions(out=out, **kw))
    said = [w for w in report.warnings if "FastDeploy" in w]
    mapping, ranks = load_rank_graphs(out)
    if said:
        assert "fastdeploy" not in report.emit and not (out / "config.json").exists(), said
        return mapping, ranks, None
    return mapping, ranks, json.loads((out / "config.json").read_text())["quantization_config"]


def refusal(ranks: list[Graph], mapping: Any = None) -> str:
    with pytest.raises(FastDeployError) as e:
        quantization_config(ranks, mapping)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[Graph], dict[str, Any]]:
    return compiled(tmp_path_factory.mktemp("dense") / "a", DENSE, quant="wint8", tp=2, cuda_arch=70)


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("moe") / "src"
    write_paddle_checkpoint(folder, MOE_CFG)
    return folder


def test_the_records_give_the_written_config(dense: tuple[Any, list[Graph], dict[str, Any]]) -> None:
    mapping, ranks, written = dense
    assert quantization_config(ranks, mapping) == written == {
        "quantization": "wint8", "is_quantized": True, "is_permuted": True}


def test_a_missing_quantization_record_is_one_line(dense: tuple[Any, list[Graph], dict[str, Any]]) -> None:
    mapping, ranks, _ = dense
    for g in ranks:
        g.metadata.pop("quantization")
    why = refusal(ranks, mapping)
    assert "records no quantization config" in why and "graph.metadata['quantization']" in why


def test_a_missing_or_contrary_weight_decision_is_one_line(tmp_path: Path) -> None:
    mapping, ranks, _ = compiled(tmp_path / "a", DENSE, quant="wint8", cuda_arch=70)
    weight = next(p for p in ranks[0].params.values() if p.name.endswith("o_proj.quant_weight"))
    decision = weight.annotations.pop("quant")
    assert "o_proj.quant_weight is quantized but records no decision" in refusal(ranks, mapping)
    weight.annotations["quant"] = {**decision, "algo": "weight_only_int4"}
    assert "recorded as weight_only_int4 but packed as 8-bit" in refusal(ranks, mapping)
    weight.annotations["quant"] = {**decision, "group_size": 64}
    assert "group-wise scales (group 64)" in refusal(ranks, mapping)
    ranks[0].metadata["quantization"] = {"name": "broken", "rules": []}
    assert "graph.metadata['quantization'] is not a quantization config" in refusal(ranks, mapping)


def test_a_float_model_records_nothing_and_is_not_quantized(tmp_path: Path) -> None:
    compile_model(DENSE, "cuda", CompileOptions(out=tmp_path / "a", cuda_arch=70))
    mapping, ranks = load_rank_graphs(tmp_path / "a")
    assert refusal(ranks, mapping).startswith("the model is not quantized (it records no quantization")


@pytest.mark.parametrize(("quant", "key"), [("w4a8c8", "w4a8c8"), ("wint2{w4_end_layer=1}", "wint2")])
def test_the_expert_passes_records_are_read(moe_source: Path, tmp_path: Path, quant: str, key: str) -> None:
    mapping, ranks, written = compiled(tmp_path / "a", str(moe_source), quant=quant)
    if key == "w4a8c8":  # not written (FastDeploy's tensor-parallel W4A8 load fails), still read
        assert written is None and quantization_config(ranks, mapping)["moe_quant_type"] == "w4a8"
    else:
        assert quantization_config(ranks, mapping) == written
    record = ranks[0].metadata.pop(key)
    assert f"the graph records no {key} pass (graph.metadata[{key!r}])" in refusal(ranks, mapping)
    if key == "w4a8c8":  # the C8 KV cache is what the record says, checked against its scales
        ranks[0].metadata[key] = {**record, "kv_cache_quant_type": None}
        assert "disagree on an int8 KV cache" in refusal(ranks, mapping)
    else:  # the layer split comes from the record
        ranks[0].metadata[key] = {**record, "w4_end_layer": 0, "w2_start_layer": 1}
        moe = quantization_config(ranks, mapping)["moe_quant_config"]
        assert moe["moe_w4_quant_config"]["quant_end_layer"] == 0
        assert moe["moe_w2_quant_config"]["quant_start_layer"] == 1
