"""ERNIE 4.5 logits against the reference libraries, from both weight layouts.

- Dense: paddleformers `Ernie4_5ForCausalLM`, float32 on CPU (`fuse_rms_norm=False`),
  GQA and MHA, tied and untied, head_dim != hidden/heads; and once more against
  transformers' `Ernie4_5ForCausalLM`.
- MoE: transformers `Ernie4_5_MoeForCausalLM` (torch CPU, float32), shared experts
  0/1/2, start index > 0, interval 2, non-zero score-correction bias.

Each reference (tests/reference/*.py, run in its own environment) builds a random
model, saves it with `save_pretrained` (HF layout) and writes its logits. The
graph is loaded from that folder as saved, and from the same tensors rewritten
in the published Paddle layout (`ernie.` prefix, fused, [in, out]). For MHA the
paddleformers in-memory state dict (`model.` prefix, fused per head) is a third
source. Tolerance: 1e-4 of the largest logit (REFERENCE 1.2: import mistakes
are of order 1e-3 to 1, library noise below 1e-5).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from _fe_testkit import hf_to_paddle, read_tensors, report, run_reference, write_checkpoint

from ernie_ir.frontends import load_model
from ernie_ir.ir.weights import SafetensorsFile
from ernie_ir.runtime.interpreter import run_graph

pytestmark = [pytest.mark.reference, pytest.mark.slow]

REL_TOL = 1e-4

DENSE = {
    "gqa-untied-hd24": {},  # hidden 64, 4 heads : 2 kv heads, head_dim 24 (4 x 24 != 64)
    "mha-tied": {"num_key_value_heads": 4, "head_dim": 16, "tie_word_embeddings": True},
    "gqa-kv1-tied-3layers": {"hidden_size": 48, "num_attention_heads": 8, "num_key_value_heads": 1,
                             "head_dim": 12, "num_hidden_layers": 3, "tie_word_embeddings": True,
                             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "seed": 3},
    "mha-untied-hd20": {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
                        "head_dim": 20, "seed": 4},
}
HF_DENSE = {  # the same model family through a second, independent implementation
    "transformers-gqa3-tied": {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2,
                               "head_dim": 16, "tie_word_embeddings": True, "seed": 8},
}
MOE = {
    "shared1-start1": {},  # 3 layers, MoE from layer 1, 8 experts top-2, 1 shared expert
    "shared0-interval2-tied": {"num_hidden_layers": 5, "moe_layer_start_index": 1, "moe_layer_interval": 2,
                               "moe_num_shared_experts": 0, "tie_word_embeddings": True, "seed": 5},
    "shared2-start2-gqa4": {"num_hidden_layers": 4, "moe_layer_start_index": 2, "moe_num_shared_experts": 2,
                            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
                            "moe_num_experts": 16, "moe_k": 4, "seed": 6},
}


@pytest.fixture(scope="module")
def dense_refs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pf_dense")
    return {name: run_reference("pf", "pf_ernie_dense.py", spec, root / name) for name, spec in DENSE.items()}


@pytest.fixture(scope="module")
def hf_dense_refs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_dense")
    return {name: run_reference("hf", "hf_ernie_dense.py", spec, root / name)
            for name, spec in HF_DENSE.items()}


@pytest.fixture(scope="module")
def moe_refs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    return {name: run_reference("hf", "hf_ernie_moe.py", spec, root / name) for name, spec in MOE.items()}


def _config(ckpt: Path) -> dict:
    import json

    return json.loads((ckpt / "config.json").read_text())


def _paddle_copy(ref: Path, dest: Path) -> Path:
    """The reference's saved tensors, rewritten in the published Paddle layout."""
    cfg = _config(ref / "ckpt")
    return write_checkpoint(dest, cfg, hf_to_paddle(read_tensors(ref / "ckpt"), cfg))


def _check(label: str, folder: Path, ref: Path) -> float:
    ids = np.load(ref / "input_ids.npy")
    expected = np.load(ref / "logits.npy")
    out = run_graph(load_model(str(folder)), {"input_ids": ids})["logits"]
    _, rel = report(label, out, expected)
    assert rel < REL_TOL, f"{label}: relative error {rel:.3g}"
    return rel


@pytest.mark.parametrize("name", sorted(DENSE))
def test_dense_matches_paddleformers(name: str, dense_refs: dict[str, Path], tmp_path: Path):
    ref = dense_refs[name]
    assert load_model(str(ref / "ckpt")).metadata["layout"] == "hf"
    _check(f"ernie4.5 dense {name} (paddleformers save_pretrained, HF layout)", ref / "ckpt", ref)
    folder = _paddle_copy(ref, tmp_path / "paddle")
    assert load_model(str(folder)).metadata["layout"] == "paddle"
    _check(f"ernie4.5 dense {name} (Paddle fused layout, ernie. prefix)", folder, ref)


@pytest.mark.parametrize("name", sorted(HF_DENSE))
def test_dense_matches_transformers(name: str, hf_dense_refs: dict[str, Path], tmp_path: Path):
    ref = hf_dense_refs[name]
    _check(f"ernie4.5 dense {name} (transformers save_pretrained, HF layout)", ref / "ckpt", ref)
    folder = _paddle_copy(ref, tmp_path / "pd")
    _check(f"ernie4.5 dense {name} (Paddle fused layout, ernie. prefix)", folder, ref)


@pytest.mark.parametrize("name", [n for n in sorted(DENSE) if n.startswith("mha")])
def test_dense_mha_from_paddleformers_memory_state(name: str, dense_refs: dict[str, Path], tmp_path: Path):
    """For MHA, paddleformers' in-memory fusion (per kv group = per head) is the Paddle layout."""
    ref = dense_refs[name]
    folder = tmp_path / "memory"
    folder.mkdir()
    shutil.copy(ref / "ckpt" / "config.json", folder / "config.json")
    memory = SafetensorsFile(ref / "memory_state.safetensors")
    write_checkpoint(folder, _config(ref / "ckpt"), {k: np.array(memory.read(k)) for k in memory.entries})
    _check(f"ernie4.5 dense {name} (paddleformers in-memory state, model. prefix)", folder, ref)


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_matches_transformers(name: str, moe_refs: dict[str, Path], tmp_path: Path):
    ref = moe_refs[name]
    rel_hf = _check(f"ernie4.5 moe {name} (transformers save_pretrained, HF layout)", ref / "ckpt", ref)
    rel_pd = _check(f"ernie4.5 moe {name} (Paddle fused layout, ernie. prefix)",
                    _paddle_copy(ref, tmp_path / "paddle"), ref)
    # The correction bias changes the routing here: ignoring it would be far outside the tolerance.
    expected = np.load(ref / "logits.npy")
    nobias = np.load(ref / "nobias_logits.npy")
    bias_effect = float(np.max(np.abs(nobias - expected)) / np.max(np.abs(expected)))
    assert bias_effect > 100 * max(rel_hf, rel_pd, 1e-7)


def test_moe_layer_placement_matches_transformers(moe_refs: dict[str, Path]):
    import json

    for name, ref in moe_refs.items():
        meta = json.loads((ref / "meta.json").read_text())
        graph = load_model(str(ref / "ckpt"))
        layers = sorted(int(n.scope.split(".")[2]) for n in graph.nodes_by_op("moe_experts"))
        assert layers == meta["moe_layers"], name
