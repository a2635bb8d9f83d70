"""Library-level checks behind the bad-input corpus: the shared readers, the streaming
finiteness test, the config caps, the LoRA rank bound and the CLI's last-resort handlers."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ernie_ir.cli.app import main
from ernie_ir.frontends import ConfigError, parse_config
from ernie_ir.frontends.config import MAX_LAYERS
from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.inputs import loads_json, open_regular, read_token_ids
from ernie_ir.ir.weights import count_nonfinite

CFG = {"architectures": ["Ernie4_5_ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
       "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
                                   ml_dtypes.float8_e5m2])
def test_count_nonfinite_agrees_with_numpy_isfinite(dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(10_007) * 4).astype(np.float32)
    special = [np.nan, np.inf, -np.inf] if np.dtype(dtype) != np.dtype(ml_dtypes.float8_e4m3fn) else [np.nan]
    idx = rng.choice(x.size, 37, replace=False)
    x[idx] = np.resize(special, idx.size)
    arr = x.astype(dtype)
    want = int(arr.size - np.count_nonzero(np.isfinite(arr.astype(np.float32))))
    assert want >= 37 - 1  # the reference sees the injected values
    assert count_nonfinite(arr) == want
    assert count_nonfinite(np.zeros(5, np.int8)) == 0


def test_count_nonfinite_in_chunks_counts_every_value(monkeypatch):
    from ernie_ir.ir import weights

    monkeypatch.setattr(weights, "_FINITE_CHUNK", 1000)
    x = np.ones(10_500, np.float32)
    x[[0, 999, 1000, 10_499]] = np.nan
    assert count_nonfinite(x.reshape(105, 100)) == 4


def test_open_regular_refuses_a_fifo_at_once_and_a_device(tmp_path: Path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(ErnieIRError, match="is a FIFO"):
        open_regular(fifo, "checkpoint")
    assert time.monotonic() - start < 1.0
    with pytest.raises(ErnieIRError, match="is a device"):
        open_regular("/dev/zero", "training data file")
    with pytest.raises(ErnieIRError, match="is a folder"):
        open_regular(tmp_path, "config file")
    (tmp_path / "ok").write_bytes(b"abc")
    with open_regular(tmp_path / "ok") as f:
        assert f.read() == b"abc"


@pytest.mark.parametrize("text, fragment", [
    ("[" * 100_000 + "]" * 100_000, "nest too deeply"),
    ('{"a": ' + "9" * 5000 + "}", "Exceeds the limit"),
    ("", "empty"),
    ("{", "not valid JSON"),
    (b"\xff", "not UTF-8"),
])
def test_loads_json_is_one_line_naming_the_source(text, fragment):
    with pytest.raises(ErnieIRError) as info:
        loads_json(text, "cfg.json")
    assert str(info.value).startswith("cfg.json") and fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_read_token_ids_refuses_pickles_and_keeps_uint64_values_honest(tmp_path: Path):
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ErnieIRError, match=r"not a plain \.npy array"):
        read_token_ids(tmp_path / "obj.npy")
    np.save(tmp_path / "big.npy", np.array([[2**63 + 1]], np.uint64))
    with pytest.raises(ErnieIRError, match="9223372036854775809"):
        read_token_ids(tmp_path / "big.npy")
    np.save(tmp_path / "ok.npy", np.array([1, 2, 3], np.int32))
    assert read_token_ids(tmp_path / "ok.npy").tolist() == [[1, 2, 3]]


def test_config_caps_and_finite_floats():
    assert parse_config({**CFG, "num_hidden_layers": MAX_LAYERS}).num_hidden_layers == MAX_LAYERS
    with pytest.raises(ConfigError, match=r"'num_hidden_layers'.*less than or equal to 1024.*cap"):
        parse_config({**CFG, "num_hidden_layers": MAX_LAYERS + 1})
    for key, value in (("rope_theta", float("inf")), ("rope_theta", float("nan")), ("rms_norm_eps", 1e30)):
        with pytest.raises(ConfigError, match=key):
            parse_config({**CFG, key: value})
    with pytest.raises(ConfigError, match="rope_theta"):
        parse_config({**{k: v for k, v in CFG.items() if k != "rope_theta"},
                      "rope_parameters": {"rope_theta": float("inf")}})


def test_lora_rank_above_min_in_out_is_refused_before_the_graph_changes():
    from ernie_ir.frontends import load_model
    from ernie_ir.ir.printer import print_graph
    from ernie_ir.passes import run_pipeline
    from ernie_ir.passes.lora.insert import LoraError

    g = load_model("gpt-345m@tiny")  # hidden 64: every linear has min(in, out) = 64
    before = print_graph(g)
    with pytest.raises(LoraError, match=r"LoRA rank 65 exceeds min\(in, out\) = 64"):
        run_pipeline(g, "lora{rank=65}")
    assert print_graph(g) == before
    run_pipeline(g, "lora{rank=64}")
    assert any(n.op == "lora" for n in g)


@pytest.mark.parametrize("exc, fragment", [(MemoryError(), "out of memory"),
                                          (RecursionError(), "nests too deeply"),
                                          (EOFError("Ran out of input"), "ended early")])
def test_main_turns_last_resort_errors_into_one_line(exc, fragment, monkeypatch, capsys):
    import ernie_ir.load

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(ernie_ir.load, "load_input", boom)  # the CLI imports it per command
    with pytest.raises(SystemExit) as info:
        main(["show", "gpt-345m@tiny"])
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines


def test_a_compile_of_nan_weights_names_the_tensor_and_leaves_nothing(tmp_path: Path):
    from ernie_ir.frontends import load_model
    from ernie_ir.ir.weights import write_safetensors
    from ernie_ir.targets import CompileOptions, compile_model

    g = load_model("gpt-345m@tiny")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(g.metadata["config"]))
    tensors = {p.name: np.array(p.source.read()) for p in g.params.values()}
    name = next(n for n in tensors if n.endswith("linear1.weight"))
    tensors[name][3, 4] = np.inf
    write_safetensors(model / "model.safetensors", list(tensors.items()))
    for quant in (None, "wint8"):
        with pytest.raises(ErnieIRError, match=name.replace(".", r"\.")):
            compile_model(str(model), "cuda", CompileOptions(quant=quant, out=tmp_path / "out"))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# -- issue 24: bad inputs that still escaped ------------------------------------------------------

def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv)
    captured = capsys.readouterr()
    return int(info.value.code or 0), captured.out, captured.err


def test_a_golden_whose_ir_does_not_parse_is_an_error_for_check_and_repaired_by_update(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "g.ir"
    path.write_text("// golden case\n// input: gpt-345m@tiny\n// pipeline: dce\nhello world (\n")
    code, out, err = _cli(["golden", "check", str(path)], capsys)
    assert (code, out) == (2, "")
    assert err.strip() == (f"error: golden IR does not parse: {path}:4:1: expected 'graph', found 'hello' "
                           f"(repair the file, or rewrite it with `ernie-ir golden update {path}`)")
    code, out, err = _cli(["golden", "update", str(path)], capsys)
    assert code == 0 and f"updated  {path}" in out, err
    code, out, err = _cli(["golden", "check", str(path)], capsys)
    assert code == 0 and f"ok       {path}" in out, err


def test_run_save_logits_writes_exactly_the_path_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    dest = tmp_path / "logits"  # np.save(path) would have written logits.npy
    code, out, err = _cli(["run", "gpt-345m@tiny", "--tokens", "1,2", "--json", "--save-logits", str(dest)],
                          capsys)
    assert code == 0, err
    assert json.loads(out)["saved"] == str(dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits"]
    assert np.load(dest).shape == (1, 2, 1024)


def test_an_attribute_of_the_wrong_type_never_reaches_the_ops_validator():
    from ernie_ir.ir import DType, OpError, get_op

    op = get_op("weight_only_linear")  # its validator compares: `v != -1 and v <= 0`
    for value, got in [(DType.BF16, "the dtype bf16"), (DType.I8, "the dtype i8"), (True, "true")]:
        with pytest.raises(OpError, match=rf"^op weight_only_linear: attribute group_size: expected int, "
                                          rf"got {got}$"):
            op.make_attrs({"group_size": value})
    with pytest.raises(OpError, match=r"^op rms_norm: attribute eps: inf is not a finite number"):
        get_op("rms_norm").make_attrs({"eps": float("1e309")})
    assert op.make_attrs({"group_size": 64}).group_size == 64


def test_verify_checks_the_manifests_mode_against_a_training_artifacts_own_records(tmp_path: Path):
    pytest.importorskip("paddle")
    from ernie_ir.artifacts import ArtifactError
    from ernie_ir.targets import CompileOptions, compile_model, verify_artifact

    art = tmp_path / "train"
    compile_model("gpt-345m@tiny", "cuda", CompileOptions(mode="training", lora_rank=2, out=art))
    assert verify_artifact(art).mode == "training"
    manifest = json.loads((art / "manifest.json").read_text())
    for field, value, source in [("mode", "inference", "the executables folder training/"),
                                 ("target", "ascend", "graph.ir"), ("cuda_arch", 75, "graph.ir")]:
        (art / "manifest.json").write_text(json.dumps({**manifest, field: value}))
        with pytest.raises(ArtifactError, match=rf"manifest\.json says {field} .* but {source} records"):
            verify_artifact(art)
