"""Checkpoint reading: safetensors (single, sharded) and Paddle .pdparams, lazily."""

from __future__ import annotations

import pickle
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ernie_ir.frontends import CheckpointError, UntrustedPickleError, open_checkpoint
from ernie_ir.frontends.pdparams import PdparamsFile, _FileSpan
from ernie_ir.ir import DType, WeightError
from ernie_ir.ir.weights import write_safetensors


def _pickle(path: Path, obj: object, protocol: int = 4) -> Path:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)
    return path


def test_pdparams_large_arrays_stay_on_disk(tmp_path: Path):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((256, 300)).astype(np.float32)  # 300 KB: written outside pickle frames
    small = rng.standard_normal(7).astype(np.float16)
    bf16 = rng.standard_normal((128, 300)).astype(ml_dtypes.bfloat16).view(np.uint16)  # as paddle saves bf16
    fortran = np.asfortranarray(rng.standard_normal((64, 300)).astype(np.float32))
    state = {"a.weight": big, "b.bias": small, "c.weight": bf16, "d.weight": fortran,
             "StructuredToParameterName@@": {"a.weight": "linear_0.w_0"}}
    f = PdparamsFile(_pickle(tmp_path / "m.pdparams", state))
    assert sorted(f.keys()) == ["a.weight", "b.bias", "c.weight", "d.weight"]
    assert isinstance(f.entries["a.weight"].data, _FileSpan)
    src = f.source("a.weight")
    assert (src.dtype, src.shape) == (DType.F32, (256, 300))
    np.testing.assert_array_equal(src.read(), big)
    np.testing.assert_array_equal(f.source("b.bias").read(), small)
    c = f.source("c.weight")
    assert c.dtype == DType.BF16
    np.testing.assert_array_equal(c.read().view(np.uint16), bf16)
    np.testing.assert_array_equal(f.source("d.weight").read(), fortran)


def test_pdparams_protocol_2_and_paddle_tensor_tuples(tmp_path: Path):
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = PdparamsFile(_pickle(tmp_path / "p2.pdparams", {"w": arr}, protocol=2))
    np.testing.assert_array_equal(f.source("w").read(), arr)
    f = PdparamsFile(_pickle(tmp_path / "t.pdparams", {"w": ("linear_0.w_0", arr)}))
    np.testing.assert_array_equal(f.source("w").read(), arr)


def test_pdparams_refuses_other_globals(tmp_path: Path):
    class Evil:
        def __reduce__(self):
            return (eval, ("1 + 1",))

    with pytest.raises(WeightError, match=r"refusing to load builtins\.eval"):
        PdparamsFile(_pickle(tmp_path / "e.pdparams", {"w": Evil()}))
    with pytest.raises(WeightError, match="holds a list"):
        PdparamsFile(_pickle(tmp_path / "l.pdparams", [1, 2]))


def test_open_checkpoint_prefers_safetensors_and_gates_pickle(tmp_path: Path):
    arr = np.ones((2, 3), np.float32)
    _pickle(tmp_path / "model_state.pdparams", {"x": arr})
    with pytest.raises(UntrustedPickleError, match="--trust-pickle"):
        open_checkpoint(tmp_path)
    store = open_checkpoint(tmp_path, trust_pickle=True)
    assert store.format == "pdparams" and store.keys() == ["x"]
    write_safetensors(tmp_path / "model.safetensors", [("x", arr)])
    assert open_checkpoint(tmp_path).format == "safetensors"  # no trust needed


def test_duplicate_keys_across_files(tmp_path: Path):
    arr = np.ones(3, np.float32)
    write_safetensors(tmp_path / "a.safetensors", [("x", arr)])
    write_safetensors(tmp_path / "b.safetensors", [("x", arr)])
    with pytest.raises(CheckpointError, match="tensor 'x' is stored twice"):
        open_checkpoint(tmp_path)


def test_index_out_of_sync(tmp_path: Path):
    import json

    write_safetensors(tmp_path / "model-00001-of-00001.safetensors", [("x", np.ones(3, np.float32))])
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "model-00001-of-00001.safetensors", "y": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(CheckpointError, match="lists tensors its shards do not hold: y"):
        open_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CheckpointError, match="not a valid index"):
        open_checkpoint(tmp_path)


def test_gpt_from_pdparams_builds_without_reading_arrays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import json

    from ernie_ir.frontends import GeneratedWeights, build_graph, load_model, parse_config
    from ernie_ir.runtime.interpreter import run_graph

    config = {"architectures": ["GPTForCausalLM"], "vocab_size": 512, "hidden_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 512,
              "max_position_embeddings": 64, "fuse_attention_qkv": True}
    source = build_graph(parse_config(config), GeneratedWeights(3), name="gpt")
    state = {name: np.array(p.read()) for name, p in source.params.items()}
    state["lm_head.weight"] = state["gpt.embeddings.word_embeddings.weight"]  # PaddleNLP stores the copy
    (tmp_path / "config.json").write_text(json.dumps(config))
    _pickle(tmp_path / "model_state.pdparams", state)

    def forbidden(*args, **kwargs):
        raise AssertionError("building the graph read array bytes")

    with monkeypatch.context() as m:
        m.setattr(np, "memmap", forbidden)
        graph = load_model(str(tmp_path), trust_pickle=True)
    assert graph.metadata["format"] == "pdparams"
    ids = {"input_ids": np.array([[1, 2, 3, 4]])}
    np.testing.assert_array_equal(run_graph(graph, ids)["logits"], run_graph(source, ids)["logits"])
