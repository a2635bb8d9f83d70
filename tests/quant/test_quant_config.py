"""QuantConfig: rule semantics (ignore first, last match wins), presets, aliases, YAML, annotations."""

from __future__ import annotations

from pathlib import Path

import pytest

from ernie_ir.frontends import load_model
from ernie_ir.ir import ErnieIRError
from ernie_ir.passes import PipelineError, run_pipeline
from ernie_ir.passes.quant.config import Algo, QuantConfig, QuantConfigError, QuantRule, resolve_quant_name

MOE = "ernie-4.5-21b-a3b@tiny"
DENSE = "ernie-4.5-0.3b@tiny"
GPT = "gpt-345m@tiny"


def _annotations(model: str, pipeline: str) -> tuple[dict[str, str], list[str]]:
    g = load_model(model)
    result = run_pipeline(g, pipeline)
    algos = {n: p.annotations["quant"]["algo"] for n, p in g.params.items() if "quant" in p.annotations}
    return algos, result.warnings


def _cfg(*rules: tuple[str, str], **kw: object) -> QuantConfig:
    return QuantConfig(rules=tuple(QuantRule(match=m, algo=Algo(a)) for m, a in rules), **kw)  # type: ignore[arg-type]


# -- the decision rule ---------------------------------------------------------------------------------


def test_last_matching_rule_wins() -> None:
    cfg = _cfg((".*", "weight_only_int8"), (".*mlp.*", "weight_only_int4"), (".*down_proj", "none"))
    assert cfg.decide(["ernie.layers.0.self_attn.qkv_proj"]).spec.algo == Algo.WEIGHT_ONLY_INT8
    assert cfg.decide(["ernie.layers.0.mlp.up_gate_proj"]).spec.algo == Algo.WEIGHT_ONLY_INT4
    d = cfg.decide(["ernie.layers.0.mlp.down_proj"])
    assert d.spec is None and d.rule == 2


def test_ignore_wins_over_every_rule() -> None:
    cfg = _cfg((".*", "weight_only_int8"), (".*qkv_proj", "weight_only_int4"), ignore=(".*layers.0.*",))
    d = cfg.decide(["ernie.layers.0.self_attn.qkv_proj"])
    assert d.spec is None and d.ignored_by == ".*layers.0.*"
    assert cfg.decide(["ernie.layers.1.self_attn.qkv_proj"]).spec.algo == Algo.WEIGHT_ONLY_INT4


def test_regex_is_a_full_match_and_glob_needs_its_prefix() -> None:
    cfg = _cfg(("qkv_proj", "weight_only_int8"))
    assert cfg.decide(["ernie.layers.0.self_attn.qkv_proj"]).spec is None  # not a search
    cfg = _cfg(("glob:*.self_attn.*", "weight_only_int8"), ("re:.*o_proj", "weight_only_int4"))
    assert cfg.decide(["ernie.layers.3.self_attn.qkv_proj"]).spec.algo == Algo.WEIGHT_ONLY_INT8
    assert cfg.decide(["ernie.layers.3.self_attn.o_proj"]).spec.algo == Algo.WEIGHT_ONLY_INT4


def test_skip_tensor_map_keeps_named_linears_of_a_block_float() -> None:
    cfg = QuantConfig.from_dict({"weight_quantize_type": "abs_max", "activation_preprocess_type": "PACT",
                                 "skip_tensor_map": {"block_1": ["linear2"]}})
    assert cfg.decide(["gpt.decoder.layers.1.linear2"]).spec is None
    assert cfg.decide(["gpt.decoder.layers.1.linear1"]).spec.algo == Algo.QAT
    assert cfg.decide(["gpt.decoder.layers.11.linear2"]).spec.algo == Algo.QAT


# -- presets on the tiny built-ins ------------------------------------------------------------------


def test_wint8mix_routed_experts_int4_everything_else_int8_incl_shared_experts() -> None:
    algos, warnings = _annotations(MOE, "quant-annotate{preset=wint8mix}")
    assert not warnings
    assert algos["ernie.layers.1.mlp.experts.up_gate_proj.weight"] == "weight_only_int4"
    assert algos["ernie.layers.1.mlp.experts.down_proj.weight"] == "weight_only_int4"
    assert algos["ernie.layers.1.mlp.shared_experts.up_gate_proj.weight"] == "weight_only_int8"
    assert algos["ernie.layers.0.mlp.up_gate_proj.weight"] == "weight_only_int8"
    assert algos["ernie.layers.2.self_attn.qkv_proj.weight"] == "weight_only_int8"
    # embeddings, router, correction bias and norms are never candidates
    for name in ("ernie.embed_tokens.weight", "ernie.layers.1.mlp.gate.weight",
                 "ernie.layers.1.mlp.moe_statics.e_score_correction_bias", "ernie.norm.weight"):
        assert name not in algos


def test_wint8mix_erniekit_keeps_shared_experts_bf16() -> None:
    algos, _ = _annotations(MOE, "quant-annotate{preset=wint8mix-erniekit}")
    assert "ernie.layers.1.mlp.shared_experts.up_gate_proj.weight" not in algos
    assert algos["ernie.layers.1.mlp.experts.down_proj.weight"] == "weight_only_int4"
    assert algos["ernie.layers.1.self_attn.o_proj.weight"] == "weight_only_int8"


def test_annotation_records_spec_rule_and_config() -> None:
    g = load_model(MOE)
    run_pipeline(g, "quant-annotate{preset=wint8mix}")
    ann = g.params["ernie.layers.2.mlp.experts.up_gate_proj.weight"].annotations["quant"]
    assert ann == {"algo": "weight_only_int4", "group_size": -1, "rule": 1}
    assert g.metadata["quantization"]["name"] == "wint8mix"
    assert "quant-annotated" in g.metadata["properties"]


def test_wint8mix_on_a_dense_model_warns_and_is_wint8() -> None:
    algos, warnings = _annotations(DENSE, "quant-annotate{preset=wint8mix}")
    assert set(algos.values()) == {"weight_only_int8"}
    assert len(warnings) == 1
    assert "no routed experts" in warnings[0] and "wint8mix on a dense model is wint8" in warnings[0]


def test_rules_and_ignores_that_match_nothing_warn_with_the_rule(tmp_path: Path) -> None:
    f = tmp_path / "q.yaml"
    f.write_text("rules:\n  - {match: '.*', algo: weight_only_int8}\n"
                 "  - {match: '.*no_such_layer.*', algo: weight_only_int4}\n"
                 "ignore: ['.*lm_head.*']\n")
    algos, warnings = _annotations(GPT, f"quant-annotate{{config=\"{f}\"}}")
    assert len(algos) == 8
    assert any("rule 1 ('.*no_such_layer.*' -> weight_only_int4) matched no linear" in w for w in warnings)
    assert any("ignore pattern '.*lm_head.*' matched no linear" in w for w in warnings)


def test_experts_of_one_stack_must_agree() -> None:
    cfg = _cfg((".*", "weight_only_int8"), (r".*experts\.[0-3]\..*", "weight_only_int4"))
    g = load_model(MOE)
    from ernie_ir.passes.quant.config import decide_target, find_targets

    stack = next(t for t in find_targets(g) if t.experts)
    with pytest.raises(QuantConfigError, match="must share one quantization"):
        decide_target(cfg, stack)


# -- names, aliases and files ---------------------------------------------------------------------


@pytest.mark.parametrize(("name", "preset"), [
    ("wint8", "wint8"), ("WINT4", "wint4"), ("wint4/8", "wint8mix"), ("weight_only_int8", "wint8"),
    ("mix_quant", "wint8mix"), ("tensor_wise_fp8", "fp8"), ("qat", "qat-int8"), ("fp8", "fp8"),
])
def test_aliases(name: str, preset: str) -> None:
    assert resolve_quant_name(name) == preset
    assert QuantConfig.preset(name).name == preset


def test_unknown_preset_lists_the_valid_ones() -> None:
    with pytest.raises(QuantConfigError, match=r"unknown quantization 'wint3' \(did you mean wint8\?\); "
                       "presets and aliases: wint8, "):
        QuantConfig.preset("wint3")
    with pytest.raises(ErnieIRError, match="unknown quantization"):
        run_pipeline(load_model(GPT), "quant-annotate{preset=int3}")


def test_yaml_forms(tmp_path: Path) -> None:
    cases = {
        "erniekit.yaml": ("compute_type: wint4/8\n", "wint8mix"),
        "fastdeploy.yaml": ("quantization: mix_quant\ndense_quant_type: wint8\nmoe_quant_type: wint4\n",
                            "wint8mix"),
        "preset.yaml": ("preset: wint8\nignore: ['.*o_proj']\n", "wint8"),
    }
    for fname, (text, name) in cases.items():
        (tmp_path / fname).write_text(text)
        assert QuantConfig.from_yaml(tmp_path / fname).name == name
    cfg = QuantConfig.from_yaml(tmp_path / "preset.yaml")
    assert cfg.ignore == (".*o_proj",)
    (tmp_path / "slim.yaml").write_text(
        "Quantization:\n  enable: True\n  weight_quantize_type: 'abs_max'\n"
        "  activation_quantize_type: 'moving_average_abs_max'\n  weight_preprocess_type: None\n"
        "  activation_preprocess_type: 'PACT'\n  weight_bits: 8\n  activation_bits: 8\n"
        "  quantizable_layer_type: ['Linear', 'ColumnParallelLinear', 'RowParallelLinear']\n"
        "  onnx_format: True\n  freeze_embedding: True\n  skip_tensor_map:\n    block_0: ['linear2']\n")
    slim = QuantConfig.from_yaml(tmp_path / "slim.yaml")
    (rule,) = slim.rules
    assert rule.algo == Algo.QAT and rule.weight_quantize_type == "abs_max"
    assert rule.activation_preprocess_type == "PACT" and slim.skip_tensor_map == {"block_0": ("linear2",)}


@pytest.mark.parametrize(("text", "message"), [
    ("rules: [{match: '.*', algo: weight_only_int8, group_size: 32}]", "group_size must be -1"),
    ("rules: [{match: '(', algo: weight_only_int8}]", "not a valid regular expression"),
    ("rules: [{match: '.*', algo: int3}]", "rules.0.algo"),
    ("rules: []", "at least one rule"),
    ("rules: [{match: '.*', algo: fp8}]\nbogus: 1", "bogus"),
    ("rules: [\n  - oops", "invalid YAML at line"),
    ("quantization: mix_quant\nmoe_quant_type: wint2", "unsupported FastDeploy quant type 'wint2'"),
])
def test_bad_config_files_give_one_clear_line(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(QuantConfigError, match=message) as e:
        QuantConfig.from_yaml(f)
    assert "\n" not in str(e.value)


def test_missing_config_file_and_option_misuse(tmp_path: Path) -> None:
    with pytest.raises(QuantConfigError, match="does not exist"):
        QuantConfig.from_yaml(tmp_path / "nope.yaml")
    with pytest.raises(PipelineError, match=r"exactly one of preset=NAME or config=FILE\.yaml"):
        run_pipeline(load_model(GPT), "quant-annotate")
