"""GPTQ on the weight-only grid: the numerics against the paper, and `method=gptq` end to end."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli, user_error

from ernie_ir.frontends import load_model
from ernie_ir.ops.quant_numerics import INT_BOUND, weight_quantize, weight_scales
from ernie_ir.passes import load_pipeline, run_pipeline
from ernie_ir.passes.quant.cli_flags import pipeline_for
from ernie_ir.passes.quant.config import Method, QuantConfig, QuantConfigError, preset_method
from ernie_ir.passes.quant.gptq import GptqError, gptq_quantize
from ernie_ir.runtime import Interpreter

DENSE = "ernie-4.5-0.3b@tiny"
MOE = "ernie-4.5-21b-a3b@tiny"


def paper_gptq(w: np.ndarray, h: np.ndarray, bits: int, damp: float, actorder: bool) -> np.ndarray:
    """Frantar et al. 2022, Algorithm 1 with B = 1 (no lazy batches), written from the equations:
    rows of W^T [out, in] are quantized column by column; each column's error, divided by
    [H^-1]_jj of the upper Cholesky factor of H^-1, updates the later columns."""
    bound = INT_BOUND[bits]
    s = weight_scales(w, bits).astype(np.float64)
    s = np.where(s == 0, 1.0, s)
    wt = w.astype(np.float64).T.copy()
    h = h.astype(np.float64).copy()
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    wt[:, dead] = 0
    perm = np.argsort(-np.diag(h), kind="stable") if actorder else np.arange(h.shape[0])
    wt, h = wt[:, perm], h[np.ix_(perm, perm)]
    h += damp * np.mean(np.diag(h)) * np.eye(h.shape[0])
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # U^T U = H^-1
    q = np.zeros_like(wt)
    for j in range(wt.shape[1]):
        t = wt[:, j] / s
        q[:, j] = np.clip(np.sign(t) * np.floor(np.abs(t) + 0.5), -bound, bound)
        err = (wt[:, j] - q[:, j] * s) / u[j, j]
        wt[:, j:] -= np.outer(err, u[j, j:])
    out = np.empty_like(q)
    out[:, perm] = q
    return out.T.astype(np.int8)


def _correlated(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    mix = rng.normal(size=(k, k)) / np.sqrt(k)
    return rng.normal(size=(n, k)) @ mix * 2.0 + 0.3 * rng.normal(size=(n, k))


@pytest.mark.parametrize(("bits", "actorder"), [(4, False), (4, True), (8, False)])
def test_gptq_matches_the_papers_algorithm(bits: int, actorder: bool) -> None:
    rng = np.random.default_rng(bits + actorder)
    k, n = 96, 24
    x = _correlated(rng, 400, k)
    x[:, 5] = 0  # a dead input channel: H_55 = 0
    h = 2 * x.T @ x / len(x)
    w = rng.normal(size=(k, n)).astype(np.float32)
    codes, scale = gptq_quantize(w, h, bits, damp=0.01, block_size=32, actorder=actorder)
    ref = paper_gptq(w, h, bits, 0.01, actorder)
    assert np.array_equal(codes, ref)
    assert np.array_equal(scale, weight_scales(w, bits))  # RTN's grid: the scale is RTN's own
    assert np.abs(codes).max() <= INT_BOUND[bits]
    assert not codes[5].any()  # the dead channel's weights are 0


def test_gptq_output_error_is_below_rtn_on_correlated_inputs() -> None:
    rng = np.random.default_rng(7)
    k, n = 64, 32
    x = _correlated(rng, 1000, k)
    w = rng.normal(size=(k, n)).astype(np.float32)
    codes, scale = gptq_quantize(w, 2 * x.T @ x, 4)
    rtn, rtn_scale = weight_quantize(w, 4)
    sf = scale.astype(np.float32)

    def err(q: np.ndarray) -> float:
        return float(np.linalg.norm(x @ w - x @ (q * sf)))

    assert err(codes) < 0.9 * err(rtn)
    assert np.array_equal(scale, rtn_scale)


def test_singular_hessian_names_the_layer_and_the_damp_to_try() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 64))  # rank 4 < 64 inputs: singular without dampening
    w = rng.normal(size=(64, 8)).astype(np.float32)
    with pytest.raises(GptqError, match=r"Hessian of layers\.0\.q .*singular.*try damp=0\.01"):
        gptq_quantize(w, x.T @ x, 4, damp=0.0, name="layers.0.q")


def test_method_option_on_presets_and_rules(tmp_path: Path) -> None:
    assert preset_method("wint4{method=gptq}") == Method.GPTQ
    assert preset_method("wint4") is None
    cfg = QuantConfig.preset("wint8mix").with_method("gptq")
    assert cfg.methods == {Method.GPTQ}
    assert cfg.to_dict()["rules"][1] == {"match": ".*mlp.experts.*", "algo": "weight_only_int4",
                                         "group_size": -1, "method": "gptq"}
    assert QuantConfig.preset("wint8").to_dict()["rules"][0].get("method") is None  # rtn: as before
    rules = tmp_path / "q.yaml"
    rules.write_text("rules:\n  - {match: '.*', algo: weight_only_int8}\n"
                     "  - {match: '.*mlp.*', algo: weight_only_int4, method: gptq}\n")
    assert QuantConfig.from_yaml(rules).methods == {Method.RTN, Method.GPTQ}
    ids = _ids(tmp_path / "ids.npy", 1, 8)
    assert pipeline_for(None, rules, None, None, None, None, calib_data=ids) == (
        f'quant-annotate{{config="{rules}"}},calibrated-quant{{calibration_file={ids}}},weight-only-quant')
    with pytest.raises(QuantConfigError, match="method=gptq calibrates weight-only"):
        QuantConfig.from_dict({"rules": [{"match": ".*", "algo": "fp8", "method": "gptq"}]})


def _ids(path: Path, rows: int, seq: int, seed: int = 0) -> Path:
    np.save(path, np.random.default_rng(seed).integers(0, 1024, size=(rows, seq)))
    return path


def _calibrated(model: str, preset: str, ids: Path, **opts: object) -> tuple:
    graph = load_model(model)
    floats = {p.name: np.asarray(p.read()) for p in graph.params.values()}
    extra = "".join(f",{k}={v}" for k, v in opts.items())
    text = (f"quant-annotate{{preset={preset},method=gptq}},calibrated-quant{{calibration_file=\"{ids}\""
            f"{extra}}},weight-only-quant")
    result = run_pipeline(graph, load_pipeline(text), evaluator=Interpreter)
    return graph, floats, result


def test_calibration_flags_become_the_pass_options(tmp_path: Path) -> None:
    ids = _ids(tmp_path / "ids.npy", 2, 16)
    text = pipeline_for("wint8mix{method=gptq}", None, None, None, None, None, calib_data=ids,
                        calib_samples=4, calib_seq_len=8)
    assert text == (f"quant-annotate{{preset=wint8mix,method=gptq}},calibrated-quant{{calibration_file="
                    f"{ids},samples=4,seq_len=8}},weight-only-quant")
    load_pipeline(text)  # the options are the pass's own


def test_a_graph_without_weights_needs_no_calibration_data() -> None:
    text = pipeline_for("wint4{method=gptq}", None, None, None, None, None)
    assert text == "quant-annotate{preset=wint4,method=gptq},calibrated-quant,weight-only-quant"
    graph = load_model("ernie-4.5-0.3b@meta")  # `plan`, `compile --meta`: typed params, no data
    run_pipeline(graph, load_pipeline(text), evaluator=Interpreter)
    q = graph.params["ernie.layers.3.mlp.down_proj.quant_weight"]
    assert str(q.type) == "i4[3072,1024]" and q.source is None


@pytest.mark.slow
def test_dense_layers_are_calibrated_on_rtns_grid(tmp_path: Path) -> None:
    ids = _ids(tmp_path / "ids.npy", 4, 32)
    graph, floats, _ = _calibrated(DENSE, "wint4", ids)
    name = "ernie.layers.1.mlp.down_proj"
    q = np.asarray(graph.params[f"{name}.quant_weight"].read()).astype(np.int8)
    s = np.asarray(graph.params[f"{name}.weight_scale"].read())
    rtn, rtn_scale = weight_quantize(floats[f"{name}.weight"], 4)
    assert np.array_equal(s, rtn_scale) and np.abs(q).max() <= 7
    assert not np.array_equal(q, rtn)  # calibrated codes, not the rounded ones
    rec = graph.metadata["calibration"]
    assert rec["methods"] == ["gptq"] and rec["weights"] == 8
    assert rec["data"] == {"file": "ids.npy", "sha256": hashlib.sha256(ids.read_bytes()).hexdigest(),
                           "windows": 4, "seq_len": 32}


@pytest.mark.slow
def test_each_layer_calibrates_on_the_outputs_of_the_quantized_layers_before_it(tmp_path: Path) -> None:
    ids = _ids(tmp_path / "ids.npy", 4, 32)
    graph, floats, _ = _calibrated(DENSE, "wint4", ids)
    seen: dict[str, np.ndarray] = {}
    wanted = {n.inputs[0]: n.inputs[1].name for n in graph if n.op == "weight_only_linear"}

    def observe(node, results) -> None:  # type: ignore[no-untyped-def]
        for v, arr in zip(node.outputs, results, strict=True):
            if v in wanted:
                seen[wanted[v]] = np.asarray(arr, np.float32).reshape(-1, arr.shape[-1])

    Interpreter(graph).run({"input_ids": np.load(ids)}, observer=observe)  # layer 0 quantized
    for name in ("ernie.layers.0.self_attn.qkv_proj", "ernie.layers.1.self_attn.qkv_proj"):
        x = seen[f"{name}.quant_weight"]  # layer 1's: what quantized layer 0 gives it
        h = (x.T @ x).astype(np.float64)  # as the pass sums it: one chunk's float32 product
        codes, _ = gptq_quantize(floats[f"{name}.weight"], 2 * h / len(x), 4, name=name)
        assert np.array_equal(np.asarray(graph.params[f"{name}.quant_weight"].read()).astype(np.int8), codes)


def test_experts_with_too_few_tokens_fall_back_to_rtn_and_are_named(tmp_path: Path) -> None:
    ids = _ids(tmp_path / "ids.npy", 1, 12)  # 12 tokens x top-6 over 16 experts: none gets 16
    graph, floats, result = _calibrated(MOE, "wint8mix", ids)
    stack = "ernie.layers.1.mlp.experts.up_gate_proj"
    q = np.asarray(graph.params[f"{stack}.quant_weight"].read()).astype(np.int8)
    assert np.array_equal(q, weight_quantize(floats[f"{stack}.weight"], 4)[0])
    named = graph.metadata["calibration"]["rtn_experts"]
    assert "ernie.layers.1.mlp.experts.0" in named and len(named) == 2 * 16
    assert any("rounded to nearest" in w and "ernie.layers.1.mlp.experts.0" in w for w in result.warnings)
    dense = "ernie.layers.1.self_attn.o_proj"  # int8 and calibrated all the same
    qd = np.asarray(graph.params[f"{dense}.quant_weight"].read())
    assert not np.array_equal(qd, weight_quantize(floats[f"{dense}.weight"], 8)[0])


@pytest.mark.slow
def test_compile_gptq_end_to_end_and_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = _ids(tmp_path / "ids.npy", 4, 32)
    out = tmp_path / "art"
    code, _, err = cli(capsys, "compile", DENSE, "--target", "cuda", "--quant", "wint4{method=gptq}",
                       "--calib-data", str(ids), "--out", str(out))
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert "calibrated-quant" in manifest["pipeline"]
    assert manifest["calibration"]["methods"] == ["gptq"]
    assert manifest["calibration"]["data"]["sha256"] == hashlib.sha256(ids.read_bytes()).hexdigest()
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"input_ids": list(range(1, 70))}) + "\n")
    code, text, err = cli(capsys, "eval", str(out), "--data", str(corpus), "--compare-to", DENSE,
                          "--seq-len", "32", "--backend", "interpreter")
    assert code == 0, err
    assert "KL(reference || model)" in text


@pytest.mark.parametrize(("quant", "data", "extra", "message"), [
    ("wint4{method=gptq}", None, (), "give --calib-data"),
    ("wint4{method=gptq}", "missing.npy", (), "no such file"),
    ("wint4{method=gptq}", "empty", (), "empty"),
    ("wint4{method=gptq}", "ids", ("--calib-seq-len", "64"), "shorter than one calibration window of 64"),
    ("wint4{method=gptq}", "ids", ("--calib-samples", "0"), "--calib-samples must be a positive integer"),
    ("wint4{method=bogus}", "ids", (), "unknown method 'bogus'"),
    ("wint4{method=awq}", "ids", (), "method awq is not built yet"),
    ("fp8{method=gptq}", "ids", (), "quantizes none"),
    ("wint8", "ids", (), "--calib-data calibrates"),
    ("w4a8c8", "ids", ("--calib-seq-len", "8"), "--calib-seq-len sizes the calibration of method=gptq"),
])
def test_bad_calibration_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], quant: str,
                                           data: str | None, extra: tuple[str, ...], message: str) -> None:
    args = ["compile", DENSE, "--target", "cuda", "--quant", quant, "--out", str(tmp_path / "art"), *extra]
    if data == "ids":
        args += ["--calib-data", str(_ids(tmp_path / "ids.npy", 2, 16))]
    elif data == "empty":
        np.save(tmp_path / "e.npy", np.zeros((1, 0), np.int64))
        args += ["--calib-data", str(tmp_path / "e.npy")]
    elif data is not None:
        args += ["--calib-data", str(tmp_path / data)]
    line = user_error(capsys, *args)
    assert message in line, line
    assert not (tmp_path / "art").exists()


def test_singular_hessian_in_a_compile_is_one_line(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    ids = _ids(tmp_path / "ids.npy", 1, 3)  # 3 tokens: every Hessian has rank <= 3
    pipeline = (f'quant-annotate{{preset=wint4,method=gptq}},calibrated-quant{{calibration_file="{ids}",'
                "damp=0},weight-only-quant")
    line = user_error(capsys, "compile", DENSE, "--target", "cuda", "--pipeline", pipeline,
                      "--out", str(tmp_path / "art"))
    assert "ernie.layers.0.self_attn.qkv_proj.weight is singular" in line and "try damp=0.01" in line
    assert not (tmp_path / "art").exists()
