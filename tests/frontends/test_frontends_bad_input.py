"""Bad input: each case is refused with one clear line naming the problem (and exit code 2 from the CLI).

The issue's list: missing or unknown `architectures`, config/tensor shape
mismatch, a missing tensor, a truncated safetensors file, a layout that mixes
both conventions, pickle without the trust flag; plus the neighbours of each.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _fe_testkit import hf_to_paddle, random_hf_ernie, read_tensors, write_checkpoint

from ernie_ir.cli.app import main
from ernie_ir.frontends import (
    CheckpointError,
    ConfigError,
    FrontendError,
    UnknownModelError,
    UntrustedPickleError,
    load_model,
)

CFG = {
    "architectures": ["Ernie4_5_ForCausalLM"], "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "vocab_size": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
}


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """A valid Paddle-layout checkpoint folder to break."""
    return write_checkpoint(tmp_path / "model", CFG, hf_to_paddle(random_hf_ernie(CFG, seed=0), CFG))


def _rewrite_config(folder: Path, edit: Callable[[dict], None]) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def _rewrite_tensors(folder: Path, edit: Callable[[dict], None]) -> None:
    tensors = read_tensors(folder)
    edit(tensors)
    (folder / "model.safetensors").unlink()
    write_checkpoint(folder, json.loads((folder / "config.json").read_text()), tensors)


def _pdparams(folder: Path, state: dict) -> None:
    with open(folder / "model_state.pdparams", "wb") as f:
        pickle.dump(state, f, protocol=4)


def expect(folder: Path | str, error: type[FrontendError], *fragments: str,
           trust_pickle: bool = False) -> str:
    """The error's type and message fragments, from the library and (exit 2, one line) from the CLI."""
    with pytest.raises(error) as info:
        load_model(str(folder), trust_pickle=trust_pickle)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    return message


def cli_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["show", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# -- config.json -----------------------------------------------------------------------------------


def test_missing_architectures(good: Path, capsys):
    _rewrite_config(good, lambda c: c.pop("architectures"))
    expect(good, ConfigError, "config.json has no 'architectures' key", "Ernie4_5_ForCausalLM")
    assert "no 'architectures' key" in cli_error(capsys, str(good))


def test_unknown_architecture(good: Path, capsys):
    _rewrite_config(good, lambda c: c.update(architectures=["LlamaForCausalLM"]))
    expect(good, ConfigError, "architecture LlamaForCausalLM is not supported",
           "supported: Ernie4_5_ForCausalLM")
    assert "LlamaForCausalLM is not supported" in cli_error(capsys, str(good))


def test_missing_required_key_names_the_published_value(good: Path):
    _rewrite_config(good, lambda c: c.pop("rms_norm_eps"))
    expect(good, ConfigError, "missing required key 'rms_norm_eps'", "1e-05")


def test_wrong_value_type(good: Path):
    _rewrite_config(good, lambda c: c.update(hidden_size="big"))
    expect(good, ConfigError, "key 'hidden_size'", '"big"')


def test_inconsistent_heads(good: Path):
    _rewrite_config(good, lambda c: c.update(num_key_value_heads=3))
    expect(good, ConfigError, "num_attention_heads 4 is not a multiple of num_key_value_heads 3")


def test_config_not_json_and_config_missing(good: Path, tmp_path: Path):
    (good / "config.json").write_text("{not json")
    expect(good, ConfigError, "is not valid JSON")
    empty = tmp_path / "empty"
    empty.mkdir()
    expect(empty, ConfigError, "has no config.json")


def test_unknown_keys_are_kept(good: Path):
    _rewrite_config(good, lambda c: c.update(my_training_note="kept", moe_capacity=[1, 2]))
    cfg = load_model(str(good)).metadata["config"]
    assert cfg["my_training_note"] == "kept" and cfg["moe_capacity"] == [1, 2]


# -- tensors ---------------------------------------------------------------------------------------


def test_shape_mismatch_names_tensor_and_both_shapes(good: Path, capsys):
    _rewrite_config(good, lambda c: c.update(intermediate_size=40))
    msg = expect(good, CheckpointError, "ernie.layers.0.mlp.up_gate_proj.weight",
                 "the config needs shape [32, 80], the checkpoint has [32, 96]", "(and 3 more)")
    assert "intermediate_size" not in msg or "check" in msg
    assert "up_gate_proj.weight" in cli_error(capsys, str(good))


def test_missing_tensors_are_listed(good: Path):
    def drop(t: dict) -> None:
        for k in ("ernie.layers.1.self_attn.o_proj.weight", "ernie.norm.weight", "lm_head.weight"):
            del t[k]

    _rewrite_tensors(good, drop)
    expect(good, CheckpointError, "3 tensor(s) the config needs are missing",
           "ernie.layers.1.self_attn.o_proj.weight, ernie.norm.weight, lm_head.weight")


def test_many_missing_tensors_name_the_first_few(good: Path):
    _rewrite_tensors(good, lambda t: [t.pop(k) for k in list(t)
                                      if ".layers." in k and "qkv_proj" not in k])
    msg = expect(good, CheckpointError, "tensor(s) the config needs are missing", "ernie.layers.0.")
    assert "more)" in msg


def test_a_config_claiming_more_layers_is_refused_before_the_build(good: Path, monkeypatch):
    from ernie_ir.frontends import loader

    def no_build(*a, **k):  # the check comes before a node or param per layer is made
        raise AssertionError("built the graph")

    monkeypatch.setattr(loader, "build_graph", no_build)
    _rewrite_config(good, lambda c: c.update(num_hidden_layers=1000))
    expect(good, CheckpointError, "num_hidden_layers 1000", "layers 0..1 only")


def test_extra_tensors_are_refused(good: Path):
    _rewrite_config(good, lambda c: c.update(num_hidden_layers=1))
    expect(good, CheckpointError, "not part of the model the config describes", "ernie.layers.1.",
           "num_hidden_layers")


def test_truncated_safetensors(good: Path, capsys):
    path = good / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    expect(good, CheckpointError, "model.safetensors", "truncated")
    assert "truncated" in cli_error(capsys, str(good))


def test_truncated_header(good: Path):
    (good / "model.safetensors").write_bytes(b"\x10\x00\x00")
    expect(good, CheckpointError, "not a safetensors file")


def test_mixed_layouts(good: Path, capsys):
    def split_one(t: dict) -> None:
        fused = t.pop("ernie.layers.1.self_attn.qkv_proj.weight")
        q, k, v = np.split(fused, [32, 48], axis=1)
        t["ernie.layers.1.self_attn.q_proj.weight"] = q.T.copy()
        t["ernie.layers.1.self_attn.k_proj.weight"] = k.T.copy()
        t["ernie.layers.1.self_attn.v_proj.weight"] = v.T.copy()

    _rewrite_tensors(good, split_one)
    expect(good, CheckpointError, "mixes both weight layouts", "layers.0.self_attn.qkv_proj",
           "layers.1.self_attn.q_proj")
    assert "mixes both weight layouts" in cli_error(capsys, str(good))


def test_mixed_prefixes(good: Path):
    def rename(t: dict) -> None:
        t["model.norm.weight"] = t.pop("ernie.norm.weight")

    _rewrite_tensors(good, rename)
    expect(good, CheckpointError, "mixes prefixes 'ernie.'", "'model.'")


def test_quantized_tensor_is_refused(good: Path):
    def quantize(t: dict) -> None:
        t["ernie.layers.0.mlp.down_proj.weight"] = np.zeros((48, 32), np.int8)

    _rewrite_tensors(good, quantize)
    expect(good, CheckpointError, "ernie.layers.0.mlp.down_proj.weight (i8)", "not floating point")


def test_sharded_index_missing_shard(tmp_path: Path):
    tensors = hf_to_paddle(random_hf_ernie(CFG, seed=0), CFG)
    folder = write_checkpoint(tmp_path / "m", CFG, tensors, shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    expect(folder, CheckpointError, "model-00002-of-00002.safetensors", "copy every shard")


def test_no_weights(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    expect(tmp_path, CheckpointError, "no weights in", "model.safetensors")


# -- pickle ----------------------------------------------------------------------------------------


def test_pickle_without_trust_is_refused(tmp_path: Path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    _pdparams(tmp_path, {"ernie.norm.weight": np.ones(32, np.float32)})
    expect(tmp_path, UntrustedPickleError, "model_state.pdparams is a pickle", "--trust-pickle")
    assert "--trust-pickle" in cli_error(capsys, str(tmp_path))


def test_trusted_pickle_still_refuses_code(tmp_path: Path):
    """Even trusted, the reader resolves only what a numpy state dict needs."""
    (tmp_path / "config.json").write_text(json.dumps(CFG))

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    _pdparams(tmp_path, {"ernie.norm.weight": Evil()})
    msg = expect(tmp_path, CheckpointError, "refusing to load builtins.print", "do not load it",
                 trust_pickle=True)
    assert "re-download" not in msg


def test_truncated_pdparams(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    _pdparams(tmp_path, {"ernie.norm.weight": np.ones(4096, np.float32)})
    path = tmp_path / "model_state.pdparams"
    path.write_bytes(path.read_bytes()[:-5000])
    expect(tmp_path, CheckpointError, "model_state.pdparams", "truncated", trust_pickle=True)


# -- names -----------------------------------------------------------------------------------------


def test_unknown_model_name(capsys):
    expect("ernie-5", UnknownModelError, "'ernie-5' is neither a model folder nor a built-in model",
           "gpt-345m")
    assert "neither a model folder" in cli_error(capsys, "ernie-5")


def test_a_file_is_not_a_model_folder(good: Path):
    expect(good / "model.safetensors", UnknownModelError, "is a file")


def test_errors_change_nothing_on_disk(good: Path):
    _rewrite_config(good, lambda c: c.update(intermediate_size=40))
    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in good.iterdir())
    with pytest.raises(CheckpointError):
        load_model(str(good))
    assert sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in good.iterdir()) == before
