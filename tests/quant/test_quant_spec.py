"""The quantization spec is plain data on the IR core (`ernie_ir.ir.quant_spec`), and
`ernie_ir.passes.quant.config` still exports every name it did, as the same objects."""

from __future__ import annotations

import pytest

import ernie_ir.ir.quant_spec as spec
import ernie_ir.passes.quant.config as config
from ernie_ir.frontends import load_model
from ernie_ir.passes import run_pipeline

MOVED = ["ALIASES", "ERNIEKIT_WINT8MIX_INT8", "PASS_PRESETS", "PASS_PRESET_DESCRIPTIONS", "PRESETS",
         "PRESET_DESCRIPTIONS", "ROUTED_EXPERTS", "Algo", "Decision", "QuantConfig", "QuantConfigError",
         "QuantRule", "QuantSpec", "compile_pattern", "match_path", "resolve_quant_name",
         "split_quant_options"]


@pytest.mark.parametrize("name", MOVED)
def test_the_config_module_re_exports_the_spec(name: str) -> None:
    assert getattr(config, name) is getattr(spec, name)
    assert name in config.__all__


def test_the_graph_queries_stay_with_the_passes() -> None:
    for name in ("find_targets", "decide_target", "expert_paths", "module_path", "WeightSite", "LINEAR_OPS",
                 "EXPERT_OPS", "ALREADY_QUANTIZED"):
        assert hasattr(config, name) and not hasattr(spec, name)


@pytest.mark.parametrize("preset", sorted(spec.PRESETS))
def test_what_annotate_records_reads_back_as_the_config(preset: str) -> None:
    graph = load_model("ernie-4.5-21b-a3b@meta")
    run_pipeline(graph, f"quant-annotate{{preset={preset}}}")
    cfg = spec.QuantConfig.preset(preset)
    assert spec.recorded_config(graph.metadata) == cfg
    decided = [p for p in graph.params.values() if spec.ANNOTATION_KEY in p.annotations]
    assert decided
    for p in decided:
        decision = spec.recorded_spec(p.annotations)
        assert decision is not None and decision == cfg.rules[p.annotations["quant"]["rule"]].spec()


def test_missing_and_bad_records() -> None:
    assert spec.recorded_config({}) is None and spec.recorded_spec({}) is None
    with pytest.raises(spec.QuantConfigError, match=r"metadata\['quantization'\] is not a"):
        spec.recorded_config({"quantization": {"rules": "x"}})
    with pytest.raises(spec.QuantConfigError, match="is not a quantization decision"):
        spec.recorded_spec({"quant": {"algo": "int3"}})
