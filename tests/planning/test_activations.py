"""Activation and KV-cache figures against hand computations on small shapes.

Each expected figure is written out term by term from the model in docs/planning.md section 3
(which op keeps which tensor), so a change to the model shows up as a change to these sums.
"""

from __future__ import annotations

from ernie_ir.ir import GraphBuilder, bf16, i64, tensor
from ernie_ir.ir.weights import GeneratedSource
from ernie_ir.load import load_input
from ernie_ir.passes.infra.manager import run_pipeline_ranks
from ernie_ir.planning import PlanRequest, plan_memory
from ernie_ir.planning.graph_memory import (
    GraphFacts,
    inference_peak,
    kv_cache_bytes,
    saved_for_backward,
    training_activations,
)
from ernie_ir.targets import CompileOptions

BF16, F32 = 2, 4


def lora_graph(pipeline: str = "lora{rank=4}") -> object:
    g = load_input("ernie-4.5-0.3b@tiny")  # H 64, 8 heads x 16, 1 KV head, I 192, 2 layers, V 1024
    return run_pipeline_ranks(g, pipeline).ranks[0]


T, H, Q, KV, INTER, R, V = 16, 64, 8 * 16, 16, 192, 4, 1024  # B=2 x S=8 tokens; the model's dims


def hand_terms() -> dict[str, int]:
    """What each part of 0.3B@tiny with LoRA keeps for backward (docs/planning.md section 3)."""
    xa = T * R * BF16                                               # each LoRA keeps x @ A
    attention = (T * Q + T * KV + T * KV + T * Q) * BF16 + T * 8 * F32  # q, k, v, out, logsumexp
    norm = T * H * BF16 + T * F32                                   # input + 1/rms per row
    mlp = T * H * BF16 + xa + 3 * T * INTER * BF16 + T * INTER * BF16 + xa
    #     up_gate LoRA x, x@A; silu input, silu out, up (mul); down LoRA x (= mul out), x@A
    # layer 0's input norm runs no backward (nothing upstream trains); its output is LoRA's x;
    # o_proj's LoRA x is the attention output (through a reshape: the same tensor)
    layer0 = T * H * BF16 + xa + attention + xa + norm + mlp
    return {"layer0": layer0, "layer1": norm + layer0, "final_norm": norm, "logits": T * V * F32}


def test_lora_training_saved_set_by_hand() -> None:
    """ERNIE 4.5 0.3B@tiny, LoRA r=4 on qkv/o/up_gate/down (frozen bf16 base), B=2, S=8, no recompute."""
    g = lora_graph()
    trainable = {p.name for p in g.params.values() if p.trainable}
    acts = training_activations(g, GraphFacts(g, trainable), {"B": 2, "S": 8}, recompute=False)
    assert acts.saved_bytes == sum(hand_terms().values())
    # the peak is at lm_head's backward: everything still kept + the gradient of its input
    assert acts.peak_bytes == acts.saved_bytes + T * H * BF16
    assert acts.layers == 2


def test_recompute_keeps_layer_inputs_and_rebuilds_one_layer() -> None:
    g = lora_graph()
    trainable = {p.name for p in g.params.values() if p.trainable}
    facts = GraphFacts(g, trainable)
    rc = training_activations(g, facts, {"B": 2, "S": 8}, recompute=True)
    terms = hand_terms()
    # kept: the two layer inputs (embedding output, layer 0's output), the final norm's keep, logits
    assert rc.saved_bytes == 2 * T * H * BF16 + terms["final_norm"] + terms["logits"]
    # each layer rebuilds what it kept without recompute, less its input (kept already)
    assert rc.recomputed_bytes == max(terms["layer0"], terms["layer1"] - T * H * BF16)
    full = training_activations(g, facts, {"B": 2, "S": 8}, recompute=False)
    assert rc.peak_bytes < full.peak_bytes


def test_frozen_model_keeps_nothing_and_full_training_keeps_linear_inputs() -> None:
    b = GraphBuilder("mlp")
    ids = b.input("input_ids", tensor(i64, "B", "S"))
    table = b.param("embed.weight", source=GeneratedSource(bf16, (32, 8), seed=0))
    w = b.param("proj.weight", source=GeneratedSource(bf16, (8, 16), seed=1))
    with b.scope("embed"):
        x = b.embedding(ids, table)
    with b.scope("proj"):
        y = b.linear(x, w)
    b.output(b.silu(y), name="y")
    g = b.graph
    env = {"B": 1, "S": 10}
    nodes = list(g)
    frozen = GraphFacts(g, set())
    assert all(not saved_for_backward(n, frozen, env).values for n in nodes)
    full = GraphFacts(g, {"embed.weight", "proj.weight"})
    kept = [[v.name for v in saved_for_backward(n, full, env).values] for n in nodes]
    assert kept == [["input_ids"], [x.name], [y.name]]  # ids (embedding grad), x (dW), silu input


def test_moe_slots_follow_the_rank_experts() -> None:
    """21B-A3B@tiny: 16 experts, top-6, H 80, expert I 32; ep=2 halves each rank's slots."""
    for ep, share in ((1, 1.0), (2, 0.5)):
        g = load_input("ernie-4.5-21b-a3b@tiny")
        ranks = run_pipeline_ranks(g, f"lora{{rank=4}},split{{tp={ep},ep={ep}}}").ranks
        rank = ranks[0]
        trainable = {p.name for p in rank.params.values() if p.trainable}
        facts = GraphFacts(rank, trainable)
        env = {"B": 1, "S": 10}
        node = next(n for n in rank if n.op == "moe_experts_lora")
        saved = dict(saved_for_backward(node, facts, env).internal)
        slots = int(10 * 6 * share)
        inter = 32 // 1  # with ep = tp every rank holds whole experts
        assert saved[f"{node.scope} dispatched x"] == slots * 80 * BF16
        assert saved[f"{node.scope} up_gate out"] == slots * 2 * inter * BF16
        assert saved[f"{node.scope} swiglu out"] == slots * inter * BF16
        assert saved[f"{node.scope} expert outputs"] == slots * 80 * BF16
        assert saved[f"{node.scope} x@A (up_gate)"] == slots * 4 * BF16


def test_inference_peak_by_hand() -> None:
    """ids -> embedding -> linear -> silu -> lm_head: the live set at each op, prefill P, batch b."""
    b = GraphBuilder("tiny")
    ids = b.input("input_ids", tensor(i64, "B", "S"))
    table = b.param("embed.weight", source=GeneratedSource(bf16, (32, 8), seed=0))
    w = b.param("proj.weight", source=GeneratedSource(bf16, (8, 16), seed=1))
    head = b.param("head.weight", source=GeneratedSource(bf16, (16, 32), seed=2))
    x = b.embedding(ids, table)
    z = b.silu(b.linear(x, w))
    b.output(b.lm_head(z, head), name="logits")
    g = b.graph
    facts = GraphFacts(g, set())
    p, batch = 10, 2
    # embedding: ids 8P + x 16P; linear: x 16P + y 32P; silu: y 32P + z 32P; lm_head: z 32P +
    # logits of the last position of each sequence, f32 [b, 1, 32]
    assert inference_peak(g, facts, p, batch) == max(24 * p, 48 * p, 64 * p, 32 * p + batch * 32 * F32)
    assert inference_peak(g, facts, 1, 8) == 32 + 8 * 32 * F32


def test_kv_cache_by_hand() -> None:
    g = load_input("ernie-4.5-0.3b@tiny")  # 2 layers, 1 KV head of 16
    assert kv_cache_bytes(g, seq_len=100, batch=3) == 2 * 2 * 3 * 100 * 1 * 16 * BF16
    from ernie_ir.ir import DType

    assert kv_cache_bytes(g, seq_len=100, batch=3, dtype=DType.F8E4M3) == 2 * 2 * 3 * 100 * 16
    # 21B-A3B@tiny: 3 layers, 2 KV heads of 8; tp 2 leaves one KV head per rank
    plan = plan_memory("ernie-4.5-21b-a3b@tiny", "cuda", CompileOptions(tp=2),
                       PlanRequest(seq_len=64, batch=5, engine="none"))
    for r in plan.per_rank:
        assert r.by_category["kv_cache"] == 3 * 2 * 5 * 64 * 1 * 8 * BF16
    # FastDeploy (the default): blocks of 64 tokens, 5 sequences of one block each + 2 blocks
    plan = plan_memory("ernie-4.5-21b-a3b@tiny", "cuda", CompileOptions(tp=2),
                       PlanRequest(seq_len=64, batch=5))
    for r in plan.per_rank:
        assert r.kv_detail["block_bytes"] == 3 * 2 * 64 * 1 * 8 * BF16
        assert r.by_category["kv_cache"] == (5 * 1 + 2) * 3 * 2 * 64 * 1 * 8 * BF16
    # tp 4 > 2 KV heads: each rank holds a replica of one KV head (FastDeploy), not half of one
    g = load_input("ernie-4.5-300b-a47b@tiny")
    heads = next(n for n in g if n.op == "attention").inputs[1].shape[2]
    plan = plan_memory("ernie-4.5-300b-a47b@tiny", "cuda", CompileOptions(tp=2 * heads),
                       PlanRequest(seq_len=8, batch=1, engine="none"))
    layers = sum(1 for n in g if n.op == "attention")
    hd = next(n for n in g if n.op == "attention").inputs[1].shape[3]
    assert plan.per_rank[0].by_category["kv_cache"] == layers * 2 * 8 * 1 * hd * BF16


def test_tp2_training_keeps_the_vocabulary_shard_of_the_logits() -> None:
    """At tp 2 the loss reads, keeps and differentiates each rank's [T, V/2] shard (the
    vocabulary-parallel loss, training/vocab_parallel.py): the saved logits term halves, and
    lm_head's backward no longer holds a [T, V/2] gradient of its own (it is the loss's buffer)."""
    g = lora_graph("lora{rank=4},split{tp=2}")
    trainable = {p.name for p in g.params.values() if p.trainable}
    facts = GraphFacts(g, trainable)
    env = {"B": 2, "S": 8}
    sharded = training_activations(g, facts, env, recompute=True)
    gathered = training_activations(g, facts, env, recompute=True, vocab_parallel=False)
    assert gathered.saved_bytes - sharded.saved_bytes == T * V * F32 - T * V // 2 * F32
    assert gathered.transient_bytes == T * V // 2 * F32 + T * H * BF16  # lm_head's backward
    assert sharded.transient_bytes < T * V // 2 * F32
    assert sharded.peak_bytes < gathered.peak_bytes
    assert [n.op for n in g if n.op == "all_gather"]  # planned as is: the graph is not changed
