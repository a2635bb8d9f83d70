"""ERNIE 4.5 weight layouts: whichever layout (and file arrangement) came in, the IR is the same.

The HF-layout tensors are random; the Paddle layout is derived from them by the
test kit's own converter (REFERENCE 1.2). Equal graphs must print the same
text (metadata aside) and give bit-identical logits.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from _fe_testkit import hf_to_paddle, random_hf_ernie, write_checkpoint

from ernie_ir.frontends import load_model, open_checkpoint
from ernie_ir.ir import DType, Graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.verifier import verify
from ernie_ir.runtime.interpreter import run_graph

BF16 = ml_dtypes.bfloat16

DENSE_GQA = {
    "architectures": ["Ernie4_5_ForCausalLM"], "hidden_size": 48, "intermediate_size": 80,
    "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12,
    "vocab_size": 96, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
}
DENSE_MHA_TIED = {**DENSE_GQA, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
                  "tie_word_embeddings": True}
MOE = {
    "architectures": ["Ernie4_5_MoeForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 80,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "moe_num_experts": 6, "moe_k": 2, "moe_intermediate_size": 16, "moe_num_shared_experts": 1,
    "moe_layer_start_index": 1,
}
DENSE_BIAS = {**DENSE_GQA, "use_bias": True}
CONFIGS = {"dense-gqa": DENSE_GQA, "dense-mha-tied": DENSE_MHA_TIED, "dense-bias": DENSE_BIAS, "moe": MOE}
IDS = {"input_ids": np.array([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]])}


def body(graph: Graph) -> str:
    """The IR text without the name and metadata (folder, source and layout legitimately differ)."""
    lines = print_graph(graph).splitlines()
    lines[0] = lines[0].replace(f"@{graph.name}(", "@model(", 1)
    return "\n".join(line for line in lines if not line.startswith("  meta "))


def logits(graph: Graph) -> np.ndarray:
    return run_graph(graph, IDS)["logits"]


@pytest.fixture(params=sorted(CONFIGS))
def case(request, tmp_path: Path) -> tuple[dict, dict, Path]:
    cfg = CONFIGS[request.param]
    hf = random_hf_ernie(cfg, seed=1, dtype=BF16)
    return cfg, hf, tmp_path


def test_hf_and_paddle_layouts_give_the_same_graph(case):
    cfg, hf, tmp = case
    g_hf = load_model(str(write_checkpoint(tmp / "hf", cfg, hf)))
    g_pd = load_model(str(write_checkpoint(tmp / "pd", cfg, hf_to_paddle(hf, cfg))))
    verify(g_hf)
    assert (g_hf.metadata["layout"], g_pd.metadata["layout"]) == ("hf", "paddle")
    assert body(g_hf) == body(g_pd)
    np.testing.assert_array_equal(logits(g_hf), logits(g_pd))


def test_paddle_layout_with_model_prefix_and_shards(case):
    cfg, hf, tmp = case
    g_pd = load_model(str(write_checkpoint(tmp / "pd", cfg, hf_to_paddle(hf, cfg))))
    g_model = load_model(str(write_checkpoint(tmp / "pm", cfg, hf_to_paddle(hf, cfg, prefix="model."),
                                              shards=3)))
    assert body(g_model) == body(g_pd)
    np.testing.assert_array_equal(logits(g_model), logits(g_pd))


def test_hf_sharded_with_index(case):
    cfg, hf, tmp = case
    one = load_model(str(write_checkpoint(tmp / "one", cfg, hf)))
    many = load_model(str(write_checkpoint(tmp / "many", cfg, hf, shards=4)))
    assert body(one) == body(many)
    assert len(open_checkpoint(tmp / "many").file_names()) == 4


def test_param_names_are_the_paddle_keys(case):
    cfg, hf, tmp = case
    paddle = hf_to_paddle(hf, cfg)
    g = load_model(str(write_checkpoint(tmp / "hf", cfg, hf)))
    stacked = {k for k in g.params if ".experts." in k}
    assert set(g.params) - stacked == {k for k in paddle if ".experts." not in k}
    for name in stacked:  # experts.up_gate_proj.weight <- experts.{e}.up_gate_proj.weight
        module, leaf = name.rsplit(".experts.", 1)
        assert g.params[name].type.shape[0] == cfg["moe_num_experts"]
        assert f"{module}.experts.0.{leaf}" in paddle


@pytest.mark.parametrize("dtype, name", [(np.float32, "f32"), (np.float16, "f16"), (BF16, "bf16")])
def test_weight_dtypes_are_kept(tmp_path: Path, dtype, name: str):
    hf = random_hf_ernie(DENSE_GQA, seed=2, dtype=dtype)
    g = load_model(str(write_checkpoint(tmp_path, DENSE_GQA, hf_to_paddle(hf, DENSE_GQA))))
    assert g.params["ernie.layers.0.self_attn.qkv_proj.weight"].type.dtype == DType.parse(name)
    assert g.metadata["activation_dtype"] == name
    out = run_graph(g, IDS)["logits"]
    assert out.dtype == np.float32 and np.all(np.isfinite(out))


def test_lm_head_in_paddleformers_memory_orientation(tmp_path: Path):
    """paddleformers keeps an untied lm_head as [V, H] in memory; the published files have [H, V]."""
    hf = random_hf_ernie(DENSE_GQA, seed=3)
    paddle = hf_to_paddle(hf, DENSE_GQA)
    ref = load_model(str(write_checkpoint(tmp_path / "a", DENSE_GQA, paddle)))
    paddle["lm_head.weight"] = paddle["lm_head.weight"].T.copy()
    g = load_model(str(write_checkpoint(tmp_path / "b", DENSE_GQA, paddle)))
    np.testing.assert_array_equal(logits(g), logits(ref))


def test_transformers_stacked_experts(tmp_path: Path):
    """transformers keeps experts stacked ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) in memory."""
    hf = random_hf_ernie(MOE, seed=4)
    ref = load_model(str(write_checkpoint(tmp_path / "a", MOE, hf)))
    stacked = dict(hf)
    for i in (1, 2):
        pre = f"model.layers.{i}.mlp.experts."
        e = range(MOE["moe_num_experts"])
        stacked[pre + "gate_up_proj"] = np.stack(
            [np.concatenate([hf[f"{pre}{j}.gate_proj.weight"], hf[f"{pre}{j}.up_proj.weight"]]) for j in e])
        stacked[pre + "down_proj"] = np.stack([hf[f"{pre}{j}.down_proj.weight"] for j in e])
        for j in e:
            for p in ("gate", "up", "down"):
                del stacked[f"{pre}{j}.{p}_proj.weight"]
    g = load_model(str(write_checkpoint(tmp_path / "b", MOE, stacked)))
    assert body(g) == body(ref)
    np.testing.assert_array_equal(logits(g), logits(ref))


def test_mtp_weights_stay_addressable(tmp_path: Path):
    hf = random_hf_ernie(MOE, seed=5)
    paddle = hf_to_paddle(hf, MOE)
    ref = load_model(str(write_checkpoint(tmp_path / "a", MOE, paddle)))
    mtp = {
        "ernie.mtp_emb_norm.0.weight": np.ones(32, np.float32),
        "ernie.mtp_hidden_norm.0.weight": np.ones(32, np.float32),
        "ernie.mtp_linear_proj.0.weight": np.zeros((64, 32), np.float32),
        "ernie.mtp_block.0.self_attn.qkv_proj.weight": np.zeros((32, 64), np.float32),
        "ernie.mtp_block.0.mlp.experts.3.up_gate_proj.weight": np.zeros((32, 32), np.float32),
    }
    folder = write_checkpoint(tmp_path / "b", {**MOE, "num_nextn_predict_layers": 1}, {**paddle, **mtp})
    g = load_model(str(folder))
    assert body(g) == body(ref)  # the graph computes next-token logits only
    (entry,) = g.metadata["ignored_weights"]
    assert entry["tensors"] == 5 and "multi-token prediction" in entry["reason"]
    assert entry["modules"] == ["ernie.mtp_block.0", "ernie.mtp_emb_norm.0", "ernie.mtp_hidden_norm.0",
                                "ernie.mtp_linear_proj.0"]
    store = open_checkpoint(folder)
    assert store.source("ernie.mtp_linear_proj.0.weight").shape == (64, 32)


def test_building_reads_no_weight_bytes(case, monkeypatch: pytest.MonkeyPatch):
    cfg, hf, tmp = case
    folders = [write_checkpoint(tmp / "hf", cfg, hf, shards=2),
               write_checkpoint(tmp / "pd", cfg, hf_to_paddle(hf, cfg))]

    def forbidden(*args, **kwargs):
        raise AssertionError("building the graph read weight bytes")

    from ernie_ir.ir import weights as weights_module

    monkeypatch.setattr(weights_module.SafetensorsFile, "read", forbidden)
    monkeypatch.setattr(np, "memmap", forbidden)
    for folder in folders:
        verify(load_model(str(folder)))


def test_tied_config_with_a_stored_head_ignores_it_visibly(tmp_path: Path):
    hf = random_hf_ernie(DENSE_MHA_TIED, seed=6)
    ref = load_model(str(write_checkpoint(tmp_path / "a", DENSE_MHA_TIED, hf)))
    extra = {**hf, "lm_head.weight": np.zeros((96, 48), BF16)}
    g = load_model(str(write_checkpoint(tmp_path / "b", DENSE_MHA_TIED, extra)))
    assert body(g) == body(ref)
    (entry,) = g.metadata["ignored_weights"]
    assert entry["modules"] == ["lm_head.weight"] and "tie_word_embeddings" in entry["reason"]
