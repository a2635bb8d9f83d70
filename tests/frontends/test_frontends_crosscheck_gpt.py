"""GPT logits against PaddleNLP `GPTForCausalLM` (float32, CPU), from .pdparams and from safetensors.

The reference (tests/reference/nlp_gpt.py, in its own environment because its
pins conflict with paddleformers') builds a random model with split or fused
qkv and saves it twice: `model_state.pdparams` (pickle: loaded only with
trust_pickle=True) and `model.safetensors` (no flag needed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _fe_testkit import report, run_reference

from ernie_ir.frontends import UntrustedPickleError, load_model
from ernie_ir.runtime.interpreter import run_graph

pytestmark = [pytest.mark.reference, pytest.mark.slow]

REL_TOL = 1e-4
CASES = {
    "split-qkv": {},  # hidden 64, 4 heads, 2 layers, FFN 256, 64 positions
    "fused-qkv": {"fuse_attention_qkv": True, "hidden_size": 48, "num_attention_heads": 6,
                  "num_hidden_layers": 3, "intermediate_size": 96, "max_position_embeddings": 32,
                  "seed": 7, "input_ids": [[1, 5, 9, 2, 7, 3, 3, 0, 127, 64, 8, 8, 31, 4, 2, 6, 1, 0, 5, 5,
                                            9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]},
}


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nlp_gpt")
    return {name: run_reference("nlp", "nlp_gpt.py", spec, root / name) for name, spec in CASES.items()}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("folder", ["ckpt", "ckpt_safetensors"])
def test_gpt_matches_paddlenlp(name: str, folder: str, refs: dict[str, Path]):
    ref = refs[name]
    graph = load_model(str(ref / folder), trust_pickle=folder == "ckpt")
    assert graph.metadata["format"] == ("pdparams" if folder == "ckpt" else "safetensors")
    fused = bool(graph.nodes_by_op("split"))
    assert fused == (name == "fused-qkv")
    ids = np.load(ref / "input_ids.npy")
    out = run_graph(graph, {"input_ids": ids})["logits"]
    _, rel = report(f"gpt {name} ({folder}) vs PaddleNLP", out, np.load(ref / "logits.npy"))
    assert rel < REL_TOL
    (ignored,) = graph.metadata["ignored_weights"]
    assert ignored["modules"] == ["lm_head.weight"]


def test_gpt_pdparams_needs_trust(refs: dict[str, Path]):
    with pytest.raises(UntrustedPickleError, match="--trust-pickle"):
        load_model(str(refs["split-qkv"] / "ckpt"))


def test_gpt_positions_beyond_the_table_are_refused(refs: dict[str, Path]):
    from ernie_ir.ir import ErnieIRError

    graph = load_model(str(refs["fused-qkv"] / "ckpt_safetensors"))
    with pytest.raises(ErnieIRError, match="beyond the model's 32 positions"):
        run_graph(graph, {"input_ids": np.zeros((1, 33), np.int64)})
