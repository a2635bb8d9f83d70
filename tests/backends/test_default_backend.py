"""`--backend auto` (the default of `run`, `generate`, `eval`): the fastest backend an artifact
offers, said in one line; and the interpreter's weight-only path dequantizing each weight once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli, user_error

from ernie_ir.artifacts import load_rank_graphs, read_manifest
from ernie_ir.backends import PREFERENCE, choose_backend, reference_backend, resolve_backend
from ernie_ir.backends import sessions as sessions_module
from ernie_ir.runtime.interpreter import Interpreter
from ernie_ir.targets import CompileOptions, compile_model

IDS = np.array([[1, 5, 9, 2, 7, 3]], dtype=np.int64)


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("auto")
    made = {"plain": root / "plain", "onnx": root / "onnx", "moe": root / "moe"}
    compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(out=made["plain"], quant="wint8mix",
                                                                emit="paddle"))
    compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(out=made["onnx"], quant="wint8mix",
                                                                emit="onnx,paddle"))
    compile_model("ernie-4.5-21b-a3b@tiny", "cuda", CompileOptions(out=made["moe"], quant="wint8mix",
                                                                   emit="paddle"))
    return made


def test_preference_puts_onnxruntime_first_and_the_interpreter_last() -> None:
    assert PREFERENCE == ("paddle-inference", "onnxruntime", "paddle", "interpreter")


def test_auto_picks_onnxruntime_where_offered(arts: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions_module, "_paddle_device", lambda target: None)  # a CPU machine
    assert choose_backend(read_manifest(arts["onnx"])).name == "onnxruntime"
    plain = choose_backend(read_manifest(arts["plain"]))
    assert plain.name == "interpreter" and "--emit onnx" in plain.why  # paddle: no GPU here
    assert resolve_backend(arts["onnx"], "paddle") is None  # a named backend is forced
    assert resolve_backend("ernie-4.5-0.3b@tiny", "auto").name == "interpreter"
    assert resolve_backend(arts["onnx"], "auto", as_compiled=False).name == "interpreter"


def test_auto_picks_paddle_on_its_device(arts: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions_module, "_paddle_device", lambda target: "gpu:0")
    choice = choose_backend(read_manifest(arts["plain"]))
    assert (choice.name, choice.why) == ("paddle", "Paddle's kernels on gpu:0")
    monkeypatch.setattr(sessions_module, "_onnxruntime_importable", lambda: False)
    assert choose_backend(read_manifest(arts["onnx"])).name == "paddle"


def test_run_says_which_backend_in_one_line_and_json_stays_json(
        arts: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "run", str(arts["onnx"]), "--tokens", "1,2,3", "--json")
    assert code == 0, err
    assert json.loads(out)["backend"] == "onnxruntime"
    assert err.splitlines() == [
        "backend: onnxruntime (the fastest this artifact offers; --backend to choose)"]
    code, out, err = cli(capsys, "run", str(arts["onnx"]), "--tokens", "1,2,3", "--backend", "interpreter",
                         "--json")
    assert code == 0 and json.loads(out)["backend"] == "interpreter" and err == ""


def test_a_refusal_stays_one_line_under_auto(arts: dict[str, Path],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    line = user_error(capsys, "run", str(arts["onnx"]), "--tokens", "1,x")
    assert "backend:" not in line


@pytest.mark.slow
def test_a_model_compared_with_itself_runs_both_sides_on_one_backend(
        arts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art = str(arts["onnx"])
    assert reference_backend(art, "onnxruntime") == "onnxruntime"
    assert reference_backend("ernie-4.5-0.3b@tiny", "onnxruntime") == "interpreter"
    assert reference_backend(str(arts["plain"]), "onnxruntime") == "interpreter"
    code, out, err = cli(capsys, "run", art, "--tokens", "1,5,9,2", "--compare-to", art, "--json")
    assert code == 0, err
    assert json.loads(out)["max_abs_error"] == 0.0
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"input_ids": [1, 5, 9, 2, 7, 3, 3, 8]}) + "\n")
    code, out, err = cli(capsys, "eval", art, "--data", str(corpus), "--seq-len", "8", "--compare-to", art,
                         "--json")
    assert code == 0, err
    assert json.loads(out)["kl_max"] == 0.0


def _dequantize_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every dequantization the kernels make."""
    from ernie_ir.ops import dequantize, packed_weight, weight_only_linear

    calls: list[int] = []
    for module in (dequantize, packed_weight, weight_only_linear):
        real = module.weight_dequantize

        def counted(*a, _real=real, **k):
            calls.append(1)
            return _real(*a, **k)

        monkeypatch.setattr(module, "weight_dequantize", counted)
    return calls


@pytest.mark.parametrize("which", ["plain", "moe"])
def test_the_interpreter_dequantizes_each_weight_once_with_the_same_numbers(
        arts: dict[str, Path], which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, graphs = load_rank_graphs(arts[which], verify=False)
    graph = graphs[0]
    feed = {graph.inputs[0].name: IDS}
    name = graph.output_names[0]
    calls = _dequantize_calls(monkeypatch)
    uncached = Interpreter(graph, weight_cache_bytes=0)
    want = [uncached.run(feed)[name], uncached.run({graph.inputs[0].name: IDS[:, :4]})[name]]
    per_run = len(calls)
    assert per_run > 0
    calls.clear()
    interp = Interpreter(graph)
    first = interp.run(feed)[name]
    assert len(calls) == per_run // 2  # the first run dequantizes every weight once
    second = interp.run({graph.inputs[0].name: IDS[:, :4]})[name]
    assert len(calls) == per_run // 2  # and never again
    np.testing.assert_array_equal(first, want[0])
    np.testing.assert_array_equal(second, want[1])
    quantized = [p for p in graph.params if p.endswith("quant_weight")]
    assert quantized and not any(p in interp._params for p in quantized)  # the int8 copies let go


def test_several_ranks_keep_their_interpreters_across_decode_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ernie_ir.backends.interpreter.session import interpreter_step
    from ernie_ir.runtime.spmd import run_spmd

    out = tmp_path / "tp2"
    compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(out=out, quant="wint8", tp=2, emit="paddle"))
    _, graphs = load_rank_graphs(out, verify=False)
    feed = {graphs[0].inputs[0].name: IDS}
    name = graphs[0].output_names[0]
    want = run_spmd(graphs, feed)[0][name]
    step = interpreter_step(graphs)
    calls = _dequantize_calls(monkeypatch)
    np.testing.assert_array_equal(step(feed)[name], want)
    first = len(calls)
    np.testing.assert_array_equal(step(feed)[name], want)
    assert first > 0 and len(calls) == first  # the second step dequantizes nothing
