"""pipeline_for: the CLI's --quant / --quant-config / --lora-* flags as pipeline text; presets registered."""

from __future__ import annotations

from pathlib import Path

import pytest

from ernie_ir.frontends import load_model
from ernie_ir.passes import all_passes, all_presets, load_pipeline, run_pipeline
from ernie_ir.passes.quant.cli_flags import QuantFlagError, pipeline_for
from ernie_ir.passes.quant.config import QuantConfigError
from ernie_ir.runtime import Interpreter


def _p(quant=None, config=None, rank=None, alpha=None, targets=None, adapter=None) -> str:  # type: ignore[no-untyped-def]
    return pipeline_for(quant, config, rank, alpha, targets, adapter)


@pytest.mark.parametrize(("args", "text", "resolved"), [
    ({}, "", ""),
    ({"quant": "none"}, "", ""),
    ({"quant": "wint8mix"}, "wint8mix", "quant-annotate{preset=wint8mix},weight-only-quant"),
    ({"quant": "wint4/8"}, "wint8mix", "quant-annotate{preset=wint8mix},weight-only-quant"),
    ({"quant": "qat-int8"}, "qat-int8", "quant-annotate{preset=qat-int8},qat-insert"),
    ({"quant": "fp8"}, "fp8", "quant-annotate{preset=fp8},fp8-quant"),
    ({"quant": "wint8mix", "rank": 8}, "wint8mix,lora{rank=8}",
     "quant-annotate{preset=wint8mix},weight-only-quant,lora{rank=8}"),
    ({"rank": 4, "alpha": 16, "targets": [".*qkv_proj.*", "glob:*.o_proj"]},
     'lora{rank=4,alpha=16.0,targets=[.*qkv_proj.*,"glob:*.o_proj"]}',
     'lora{rank=4,alpha=16.0,targets=[.*qkv_proj.*,"glob:*.o_proj"]}'),
])
def test_flags_to_pipeline_text(args: dict, text: str, resolved: str) -> None:
    assert _p(**args) == text
    assert (str(load_pipeline(text)) if text else "") == resolved


def test_quant_config_file_gets_the_convert_passes_its_algorithms_need(tmp_path: Path) -> None:
    f = tmp_path / "mix.yaml"
    f.write_text("rules:\n  - {match: '.*', algo: fp8}\n  - {match: '.*experts.*', algo: weight_only_int4}\n")
    text = _p(config=f)
    assert text == f'quant-annotate{{config="{f}"}},weight-only-quant,fp8-quant'
    g = load_model("ernie-4.5-21b-a3b@tiny")
    run_pipeline(g, text, evaluator=Interpreter)  # fp8-quant calibrates with it
    ops = {n.op for n in g}
    assert {"fp8_linear", "dequantize"} <= ops and "linear" not in ops


def test_adapter_flag(tmp_path: Path) -> None:
    (tmp_path / "lora_config.json").write_text('{"r": 4}')
    assert _p(adapter=tmp_path) == f'lora-import{{path="{tmp_path}"}}'


@pytest.mark.parametrize(("args", "message"), [
    ({"quant": "wint8", "config": Path("q.yaml")},
     "give --quant PRESET or --quant-config FILE.yaml, not both"),
    ({"quant": "int3"}, "unknown quantization 'int3'"),
    ({"alpha": 16.0}, "--lora-alpha and --lora-targets need --lora-rank R"),
    ({"targets": [".*"]}, "--lora-alpha and --lora-targets need --lora-rank R"),
    ({"rank": 0}, "--lora-rank must be a positive integer"),
    ({"rank": 4, "alpha": -1.0}, "--lora-alpha must be positive"),
    ({"rank": 4, "targets": ["("]}, "not a valid regular expression"),
    ({"rank": 4, "adapter": Path("/nonexistent")}, "do not combine it with --lora-rank"),
    ({"adapter": Path("/nonexistent")}, "not a LoRA adapter folder"),
    ({"config": Path("/nonexistent/q.yaml")}, "does not exist"),
])
def test_bad_flags_are_one_clear_line(args: dict, message: str) -> None:
    with pytest.raises((QuantFlagError, QuantConfigError)) as e:
        _p(**args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_presets_and_passes_are_registered() -> None:
    presets = all_presets()
    for name in ("wint8", "wint4", "wint8mix", "wint8mix-erniekit", "qat-int8", "fp8"):
        assert name in presets and presets[name].description
    for name in ("quant-annotate", "weight-only-quant", "qat-insert", "fp8-quant", "lora", "lora-merge",
                 "lora-import"):
        assert name in all_passes()
