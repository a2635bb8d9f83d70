"""`sensitivity --skip-top K --out q.yaml`: PaddleSlim's QAT section with the K most sensitive
linears in `skip_tensor_map`, read back by `compile --quant-config` (issue 39 item 3), and the
seed's loop at @tiny: sensitivity, skip, QAT, train, compile for inference, LAMBADA accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from _cli_kit import cli, user_error

from ernie_ir.ir.paddleslim_quant import SkipMapError, skip_entry, skip_tensor_map
from ernie_ir.ir.quant_spec import QuantConfigError
from ernie_ir.load import load_input
from ernie_ir.passes.quant.config import QuantConfig, decide_target, find_targets

GPT = "gpt-345m@tiny"
SEQ = 24
LAMBADA = ["the quick brown fox jumps over the lazy dog", "hello world how are you today",
           "once upon a time there was a small model", "hello"]
"""Cloze passages (LAMBADA's jsonl: one {"text": ...} a line): the last word is the one to predict."""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("cal") / "c.jsonl"
    path.write_text("".join(json.dumps({"input_ids": rng.integers(0, 1024, 2 * SEQ).tolist()}) + "\n"
                            for _ in range(2)))
    return path


@pytest.mark.parametrize("model", ["gpt-345m@tiny", "ernie-4.5-0.3b@tiny", "ernie-4.5-21b-a3b@tiny"])
def test_each_units_skip_entry_names_that_unit_and_no_other(model: str) -> None:
    """The writer's names (skip_entry) and the reader's matching (QuantConfig.decide) agree on
    every unit: routed and shared experts of one layer, attention and MLP, layer 1 and 11 apart."""
    sites = find_targets(load_input(model))
    qat = QuantConfig.preset("qat-int8")
    for site in sites:
        config = qat.model_copy(update={"skip_tensor_map": skip_tensor_map([site.path])})
        floats = {s.path for s in sites if decide_target(config, s).spec is None}
        assert floats == {site.path}, (site.path, config.skip_tensor_map)
    assert skip_entry("gpt.decoder.layers.3.linear2") == ("block_3", "linear2")  # PaddleFleetX's name
    assert skip_entry("ernie.layers.1.mlp.shared_experts.up_gate_proj") == (
        "block_1", "mlp.shared_experts.up_gate_proj")
    with pytest.raises(SkipMapError, match="no decoder layer"):
        skip_entry("lm_head")


def test_paddlefleetx_configs_compress_section_is_read(tmp_path: Path) -> None:
    """A whole PaddleFleetX QAT config: `compile --quant-config` reads its Compress.Quantization."""
    path = tmp_path / "qat_gpt.yaml"
    path.write_text(
        "Global: {seed: 1024}\nModel: {name: GPT, num_layers: 2}\n"
        "Compress:\n  pretrained: null\n  Quantization:\n    enable: True\n"
        "    weight_quantize_type: 'abs_max'\n    activation_quantize_type: 'moving_average_abs_max'\n"
        "    weight_preprocess_type: None\n    activation_preprocess_type: 'PACT'\n"
        "    weight_bits: 8\n    activation_bits: 8\n"
        "    quantizable_layer_type: ['Linear', 'ColumnParallelLinear', 'RowParallelLinear']\n"
        "    onnx_format: True\n    freeze_embedding: True\n"
        "    skip_tensor_map:\n      block_1: ['linear2']\n")
    config = QuantConfig.from_yaml(path)
    assert config.skip_tensor_map == {"block_1": ("linear2",)}
    rule = config.rules[0]
    assert (rule.algo.value, rule.weight_quantize_type, rule.activation_preprocess_type) == ("qat", "abs_max",
                                                                                             "PACT")
    floats = {s.path for s in find_targets(load_input(GPT)) if decide_target(config, s).spec is None}
    assert floats == {"gpt.decoder.layers.1.linear2"}


@pytest.mark.parametrize(("skip", "expect"), [
    ("{block_0: linear2}", {"block_0": ("linear2",)}),  # one name, as PaddleFleetX's `in` test takes it
    ("{block_0: null}", {"block_0": ()}),
    ("[linear2]", "maps block_N to linear names"),  # was an AttributeError traceback
    ("{block_0: [1]}", "give a list of linear names"),
    ("{3: [linear2]}", "keys are block_N"),
])
def test_skip_maps_are_read_as_paddlefleetx_gives_them_or_refused_in_one_line(tmp_path: Path, skip: str,
                                                                              expect: object) -> None:
    path = tmp_path / "q.yaml"
    path.write_text(f"Quantization: {{weight_quantize_type: abs_max, skip_tensor_map: {skip}}}\n")
    if isinstance(expect, dict):
        assert QuantConfig.from_yaml(path).skip_tensor_map == expect
    else:
        with pytest.raises(QuantConfigError, match=str(expect)) as e:
            QuantConfig.from_yaml(path)
        assert "\n" not in str(e.value)


def test_bad_skip_requests_are_one_line_and_write_nothing(data: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "q.yaml"
    assert "go together" in user_error(capsys, "sensitivity", GPT, "--data", str(data), "--skip-top", "2")
    assert "must be 1 or more" in user_error(capsys, "sensitivity", GPT, "--data", str(data),
                                             "--skip-top", "0", "--out", str(out))
    out.write_text("mine\n")
    assert "pass --force" in user_error(capsys, "sensitivity", GPT, "--data", str(data),
                                        "--skip-top", "2", "--out", str(out))
    assert out.read_text() == "mine\n"


@pytest.mark.slow
def test_the_seeds_loop_keeps_the_most_sensitive_linears_float_from_qat_to_eval(data: Path, tmp_path: Path,
                                                                               capsys) -> None:
    """sensitivity --skip-top 2 -> compile --quant-config (QAT) -> train 2 steps -> compile for
    inference -> eval --task lambada: the two costliest units stay float all the way, the rest end
    up int8, and the loop ends with the seed's figure, LAMBADA cloze accuracy."""
    pytest.importorskip("paddle")  # training
    q = tmp_path / "q.yaml"
    line = user_error(capsys, "sensitivity", GPT, "--data", str(data), "--seq-len", str(SEQ),
                      "--skip-top", "9", "--out", str(q))
    assert "--skip-top 9 is more than the model's 8 units" in line
    assert list(tmp_path.iterdir()) == []  # not even a temp file
    code, out, err = cli(capsys, "sensitivity", GPT, "--data", str(data), "--seq-len", str(SEQ), "--format",
                         "int8", "--mode", "exact", "--skip-top", "2", "--out", str(q), "--json")
    assert code == 0, err
    report = json.loads(out)
    ranked = [u["unit"] for u in sorted(report["units"], key=lambda u: u["kl"], reverse=True)]
    assert report["skipped"] == ranked[:2] and report["out"] == str(q)

    written = yaml.safe_load(q.read_text())["Compress"]["Quantization"]
    assert written["skip_tensor_map"] == {b: list(n) for b, n in skip_tensor_map(ranked[:2]).items()}
    assert written["weight_quantize_type"] == "abs_max" and written["activation_preprocess_type"] == "PACT"
    assert QuantConfig.from_yaml(q).skip_tensor_map == skip_tensor_map(ranked[:2])

    art, inf = tmp_path / "qat", tmp_path / "qat-int8"
    for argv in (("compile", GPT, "--target", "cuda", "--quant-config", str(q), "--mode", "training",
                  "--out", str(art)),
                 ("train", str(art), "--steps", "2", "--data", str(data), "--max-seq-len", str(SEQ)),
                 ("compile", str(art), "--target", "cuda", "--out", str(inf))):
        code, _, err = cli(capsys, *argv)
        assert code == 0, (argv, err)

    trained = load_input(str(art))
    assert trained.metadata["quantization"]["skip_tensor_map"] == {
        b: list(n) for b, n in skip_tensor_map(ranked[:2]).items()}
    graph = load_input(str(inf))
    units = [u["unit"] for u in report["units"]]
    for unit in units:  # skipped: the float weight, no activation quantizer; the rest int8
        int8 = f"{unit}.quant_weight" in graph.params
        assert int8 == (unit not in ranked[:2]), unit
        assert (f"{unit}.weight" in graph.params) == (unit in ranked[:2]), unit
        assert (f"{unit}.activation_quant.scale" in graph.params) == (unit not in ranked[:2]), unit
    source = json.loads((inf / "manifest.json").read_text())["source"]
    assert source["steps"] == 2 and not source.get("synthetic")  # trained on --data

    # the seed judges the loop by LAMBADA cloze accuracy (GPT-345M INT8 with skipped layers 44.94%)
    lambada = tmp_path / "lambada_test.jsonl"
    lambada.write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    code, out, err = cli(capsys, "eval", str(inf), "--task", "lambada", "--data", str(lambada), "--seq-len",
                         str(SEQ), "--compare-to", GPT, "--json")
    assert code == 0, err
    scored = json.loads(out)
    assert scored["task"] == "lambada" and scored["examples"] == len(LAMBADA)
    assert scored["unscored"] == 1  # "hello": nothing before its last word; the script counts it correct
    assert 1 <= scored["correct"] <= scored["examples"]
    assert 0 <= scored["accuracy"] <= 1 and scored["accuracy"] == scored["correct"] / scored["examples"]
    assert 0 <= scored["accuracy_reference"] <= 1  # the float model beside it
