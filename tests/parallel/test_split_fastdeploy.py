"""Shards agree with the engines: our rank params are FastDeploy's / ERNIEKit's shards, bit for bit.

A small checkpoint in the published Paddle layout is cut here by an
independent numpy implementation of the engines' split rules (REFERENCE 5,
written from the facts only, calling no ernie_ir code):

- `qkv_proj` [H, (nh + 2 nkv) hd] = [Q | K | V] (FastDeploy `gqa_qkv_split_func`):
  Q, K and V each cut into tp column blocks, rank r holds concat(Q_r, K_r, V_r);
  when nkv < tp (tp % nkv == 0) K and V are cut into nkv blocks and rank r takes
  block r // (tp / nkv);
- `up_gate_proj` [H, 2I] = [gate | up] ("naive 2-fuse"): 2 tp column blocks, rank r
  takes blocks r and r + tp (dense MLP, shared experts, and each routed expert
  under TP);
- `o_proj`, `down_proj` [in, out]: rows cut (axis 0);
- `embed_tokens` [V, H]: vocabulary rows cut; untied `lm_head` [H, V]: columns cut;
- norms, router `mlp.gate.weight` and the correction bias: whole;
- expert parallelism: rank group g holds whole experts [g E/ep, (g+1) E/ep).

The frontend loads the folder (`load_input`), the split cuts it, and every
param of every rank graph is compared with the engines' slice of the
checkpoint tensor it comes from (raw bytes, so bf16 compares exactly).
Our MoE graph stacks the experts of a layer into one [E, ...] param: its rank
slice is compared with the stack of the engines' per-expert slices.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from _parallel_testkit import IDS, rel_err, write_paddle_checkpoint

from ernie_ir.load import load_input
from ernie_ir.passes.parallel.split import mapping_for, split_graph
from ernie_ir.runtime.interpreter import run_graph
from ernie_ir.runtime.spmd import run_spmd

BASE = {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "use_bias": False}
DENSE_NKV_GE_TP = {  # nkv = 4 >= tp for tp 2 and 4; untied lm_head [H, V]
    **BASE, "architectures": ["Ernie4_5_ForCausalLM"], "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
    "vocab_size": 64, "tie_word_embeddings": False,
}
DENSE_NKV_LT_TP = {  # nkv = 2: at tp 4 KV is replicated in pairs (FastDeploy); tied head
    **DENSE_NKV_GE_TP, "num_key_value_heads": 2, "head_dim": 12, "tie_word_embeddings": True,
}
MOE = {  # 8 routed experts top-2 + 1 shared, layer 0 dense
    **BASE, "architectures": ["Ernie4_5_MoeForCausalLM"], "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "vocab_size": 64, "tie_word_embeddings": False, "moe_num_experts": 8, "moe_k": 2,
    "moe_intermediate_size": 16, "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
    "num_nextn_predict_layers": 0,
}
CONFIGS = {"dense-nkv4": DENSE_NKV_GE_TP, "dense-nkv2": DENSE_NKV_LT_TP, "moe-e8": MOE}
FEED = {"input_ids": IDS % 64}


# -- the engines' split rules, in numpy ---------------------------------------------------------------


def gqa_qkv_split(w: np.ndarray, tp: int, r: int, nh: int, nkv: int, hd: int) -> np.ndarray:
    q, k, v = w[..., : nh * hd], w[..., nh * hd: (nh + nkv) * hd], w[..., (nh + nkv) * hd:]
    assert v.shape[-1] == nkv * hd
    q_r = np.split(q, tp, axis=-1)[r]
    if nkv >= tp:
        k_r, v_r = np.split(k, tp, axis=-1)[r], np.split(v, tp, axis=-1)[r]
    else:
        assert tp % nkv == 0
        block = r // (tp // nkv)
        k_r, v_r = np.split(k, nkv, axis=-1)[block], np.split(v, nkv, axis=-1)[block]
    return np.concatenate([q_r, k_r, v_r], axis=-1)


def naive_2_fuse(w: np.ndarray, tp: int, r: int) -> np.ndarray:
    blocks = np.split(w, 2 * tp, axis=-1)
    return np.concatenate([blocks[r], blocks[r + tp]], axis=-1)


def row_split(w: np.ndarray, tp: int, r: int) -> np.ndarray:
    return np.split(w, tp, axis=0)[r]


def column_split(w: np.ndarray, tp: int, r: int) -> np.ndarray:
    return np.split(w, tp, axis=-1)[r]


def engine_shard(key: str, t: np.ndarray, cfg: dict, tp: int, r: int) -> np.ndarray:
    """The engines' tensor-parallel slice of checkpoint tensor `key` for rank r of tp."""
    if tp == 1:
        return t
    if key.endswith("self_attn.qkv_proj.weight"):
        nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        return gqa_qkv_split(t, tp, r, nh, nkv, hd)
    if key.endswith("up_gate_proj.weight"):
        return naive_2_fuse(t, tp, r)
    if key.endswith(("o_proj.weight", "down_proj.weight")):
        return row_split(t, tp, r)
    if key == "ernie.embed_tokens.weight":
        return row_split(t, tp, r)
    if key == "lm_head.weight":
        return column_split(t, tp, r)
    assert key.endswith(("norm.weight", "mlp.gate.weight", "e_score_correction_bias")), key
    return t


def layout(tp: int, ep: int) -> list[tuple[int, int, int]]:
    """(tp rank, ep rank, tp rank inside the expert group) of every rank (REFERENCE 5 / Mapping)."""
    world = max(tp, ep)
    moe_tp = world // ep
    return [(r % tp, r // moe_tp, r % moe_tp) for r in range(world)]


def expected_params(ckpt: dict[str, np.ndarray], cfg: dict, tp: int, ep: int, rank: int) -> dict:
    """Every param a rank graph should hold, by our (global) param name."""
    tp_rank, ep_rank, moe_tp_rank = layout(tp, ep)[rank]
    moe_tp = max(tp, ep) // ep
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for key, t in ckpt.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(.*)", key)
        if m is None:
            out[key] = engine_shard(key, t, cfg, tp, tp_rank)
            continue
        e = int(m.group(2))
        per = cfg["moe_num_experts"] // ep
        if ep_rank * per <= e < (ep_rank + 1) * per:  # expert parallelism: whole experts by group
            # inside a group, each expert is cut moe_tp ways like a dense MLP (FastDeploy's TP-only
            # scheme when ep = 1)
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[e] = engine_shard(key, t, cfg, moe_tp,
                                                                                     moe_tp_rank)
    for name, held in experts.items():
        out[name] = np.stack([held[e] for e in sorted(held)], axis=0)
    return out


def raw(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint8)


# -- the tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, dict, Path]]:
    root = tmp_path_factory.mktemp("paddle-layout")
    out = {}
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        folder = root / name
        out[name] = (cfg, write_paddle_checkpoint(folder, cfg, seed=10 + i), folder)
    return out


CASES = [("dense-nkv4", 2, 1), ("dense-nkv4", 4, 1), ("dense-nkv2", 2, 1), ("dense-nkv2", 4, 1),
         ("moe-e8", 2, 1), ("moe-e8", 4, 1), ("moe-e8", 1, 2), ("moe-e8", 2, 2), ("moe-e8", 4, 2),
         ("moe-e8", 1, 4)]


@pytest.mark.parametrize("config, tp, ep", CASES, ids=[f"{c}-tp{t}-ep{e}" for c, t, e in CASES])
def test_rank_params_are_the_engines_shards(checkpoints, config: str, tp: int, ep: int):
    cfg, ckpt, folder = checkpoints[config]
    graph = load_input(str(folder))
    assert graph.metadata["layout"] == "paddle"
    ranks = split_graph(graph, mapping_for(graph, tp, ep))
    assert len(ranks) == max(tp, ep)
    for r, rank in enumerate(ranks):
        want = expected_params(ckpt, cfg, tp, ep, r)
        assert set(rank.params) == set(want), (set(rank.params) ^ set(want))
        for name, expect in want.items():
            got = rank.params[name].read()
            assert got.shape == expect.shape, (r, name, got.shape, expect.shape)
            assert got.dtype == expect.dtype, (r, name)
            assert np.array_equal(raw(got), raw(expect)), f"rank {r}: {name} is not the engines' shard"


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_engine_shards_compute_the_model(checkpoints, config: str):
    """The same checkpoint, split at the widest layout, still computes the unsplit logits."""
    _, _, folder = checkpoints[config]
    graph = load_input(str(folder))
    ref = run_graph(graph, FEED)["logits"]
    tp, ep = (4, 2) if "moe" in config else (4, 1)
    outs = run_spmd(split_graph(graph, mapping_for(graph, tp, ep)), FEED)
    assert rel_err(outs[0]["logits"], ref) <= 1e-5


def test_the_reference_rules_are_not_the_identity(checkpoints):
    """Guard the independent implementation itself: at nkv < tp ranks share KV, at nkv >= tp not;
    the naive 2-fuse slice is not a plain column block."""
    _, ckpt, _ = checkpoints["dense-nkv2"]
    w = ckpt["ernie.layers.0.self_attn.qkv_proj.weight"]
    nh, nkv, hd = 8, 2, 12
    s = [gqa_qkv_split(w, 4, r, nh, nkv, hd) for r in range(4)]
    kv = slice(nh // 4 * hd, None)
    assert np.array_equal(raw(s[0][:, kv]), raw(s[1][:, kv]))
    assert not np.array_equal(raw(s[1][:, kv]), raw(s[2][:, kv]))
    assert s[0].shape == (32, 2 * hd + 2 * hd)
    _, ckpt4, _ = checkpoints["dense-nkv4"]
    w4 = ckpt4["ernie.layers.0.self_attn.qkv_proj.weight"]
    s4 = [gqa_qkv_split(w4, 4, r, 8, 4, 8) for r in range(4)]
    assert not np.array_equal(raw(s4[0][:, 16:]), raw(s4[1][:, 16:]))
    ug = ckpt4["ernie.layers.0.mlp.up_gate_proj.weight"]  # [32, 96] = [gate 48 | up 48]
    fused = naive_2_fuse(ug, 2, 1)
    assert np.array_equal(raw(fused), raw(np.concatenate([ug[:, 24:48], ug[:, 72:96]], axis=1)))
    assert not np.array_equal(raw(fused), raw(column_split(ug, 2, 1)))
