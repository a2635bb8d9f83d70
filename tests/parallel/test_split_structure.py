"""What the rank graphs look like: collectives where slices meet, local shapes, shard annotations.

Collectives are identified by what they reduce (the op and scope producing
their input), so that e.g. the vocab-parallel embedding's all_reduce (placed
before its first reader, the first layer norm) is told apart from the
attention's.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _parallel_testkit import FAMILIES, IDS, build, layer_of, rel_err, tiny, tp_fits

from ernie_ir.ir import Graph, Node
from ernie_ir.ir.equality import structural_diff
from ernie_ir.load import load_input
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.parallel.split import SHARD, SplitError, mapping_for, split_graph
from ernie_ir.runtime.interpreter import run_graph
from ernie_ir.runtime.spmd import run_spmd
from ernie_ir.testing import GoldenCase


def reduces(graph: Graph) -> list[tuple[str, str]]:
    """(producer op, producer scope) of every all_reduce's input, in graph order."""
    out = []
    for n in graph.nodes_by_op("all_reduce"):
        p = n.inputs[0].producer
        assert p is not None
        out.append((p.op, p.scope))
    return out


def same_graph(a: Graph, b: Graph) -> str | None:
    """structural_diff, ignoring the pass manager's `properties` metadata."""
    a_meta, b_meta = dict(a.metadata), dict(b.metadata)
    a_meta.pop("properties", None)
    b_meta.pop("properties", None)
    if a_meta != b_meta:
        keys = sorted(k for k in a_meta.keys() | b_meta.keys() if a_meta.get(k) != b_meta.get(k))
        return f"metadata differs: {keys}"
    saved = a.metadata
    a.metadata = b.metadata
    try:
        return structural_diff(a, b)
    finally:
        a.metadata = saved


def gathers(graph: Graph) -> list[Node]:
    return graph.nodes_by_op("all_gather")


def shard(graph: Graph, name: str) -> dict | None:
    return graph.params[name].annotations.get(SHARD)


def ranges(graph: Graph, name: str) -> list[tuple[int, list[list[int]]]]:
    ann = shard(graph, name)
    assert ann is not None, f"{name} has no shard annotation"
    return [(c["axis"], c["ranges"]) for c in ann["cuts"]]


# -- collectives ---------------------------------------------------------------------------------


@pytest.mark.parametrize("pipeline", ["", "wint8mix,lora{rank=4}"])
def test_ernie_dense_tp2_collectives(pipeline: str):
    graph = tiny("ernie-4.5-0.3b", pipeline)
    for rank in split_graph(graph, mapping_for(graph, 2)):
        row = "lora" if pipeline else "linear"  # the adapter's sum joins its base's all_reduce
        expected = [("vocab_parallel_embedding", "ernie.embed_tokens")]
        for i in range(2):
            expected += [(row, f"ernie.layers.{i}.self_attn.o_proj"),
                         (row, f"ernie.layers.{i}.mlp.down_proj")]
        assert reduces(rank) == expected
        (g,) = gathers(rank)
        assert g.inputs[0].producer.op == "lm_head"
        assert (g.attrs.axis, g.attrs.world_size) == (-1, 2)
        assert rank.outputs == [g.outputs[0]]
        assert {n.attrs.world_size for n in rank.nodes_by_op("all_reduce")} == {2}


def test_ernie_se_parallel_layers_reduce_once():
    graph = load_input("ernie-3.5-se-3b@tiny")
    parallel = {layer_of(n) for n in graph.params if ".self_attn_mlp." in n}
    assert parallel == {1, 2}  # the tiny model: attention, 2 parallel layers, mlp
    (rank0, rank1) = split_graph(graph, mapping_for(graph, 2))
    for rank in (rank0, rank1):
        red = reduces(rank)
        assert red[0] == ("vocab_parallel_embedding", "ernie.embed_tokens")
        per_layer = Counter(layer_of(scope) for _, scope in red[1:])
        assert per_layer == {0: 1, 1: 1, 2: 1, 3: 1}
        for i in parallel:
            (scope,) = [s for _, s in red if layer_of(s) == i]
            assert scope == f"ernie.layers.{i}.self_attn_mlp.o_proj"
        assert len(gathers(rank)) == 1  # untied lm_head [H, V] column-split


def test_moe_tp2_routed_and_shared_share_one_all_reduce():
    graph = build("ernie-4.5-21b-a3b", num_attention_heads=4)  # 2 shared experts, MoE layers 1, 2
    rank = split_graph(graph, mapping_for(graph, 2))[0]
    red = rank.nodes_by_op("all_reduce")
    moe = [n for n in red if n.inputs[0].producer.scope.endswith(".mlp")]
    assert [layer_of(n.scope) for n in moe] == [1, 2]
    for n in moe:
        add = n.inputs[0].producer
        assert add.op == "add"  # the partial sums are added first, then reduced once
        sources = sorted(v.producer.op for v in add.inputs)
        assert sources == ["linear", "moe_experts"]  # the shared experts' down_proj and the routed sum
        (shared,) = [v.producer for v in add.inputs if v.producer.op == "linear"]
        assert shared.scope.endswith("mlp.shared_experts.down_proj")
    per_layer = Counter(layer_of(n.scope) for n in red)
    assert per_layer == {0: 3, 1: 2, 2: 2}  # layer 0: embedding (before its norm), attention, dense MLP
    assert not rank.nodes_by_op("moe_local_experts")  # TP only: every rank holds every expert


@pytest.mark.parametrize("name, moe_layers", [("ernie-4.5-21b-a3b", [1, 2]), ("ernie-4.5-300b-a47b", [3, 4])])
def test_ep_without_tp_reduces_once_per_moe_layer(name: str, moe_layers: list[int]):
    graph = tiny(name, "wint8mix")
    for rank in split_graph(graph, mapping_for(graph, 1, 2)):
        red = reduces(rank)
        assert [op for op, _ in red] == ["moe_experts"] * len(moe_layers)
        assert [layer_of(s) for _, s in red] == moe_layers
        assert not gathers(rank)
        assert not rank.nodes_by_op("vocab_parallel_embedding")
        attention = [p for n, p in rank.params.items() if ".self_attn." in n]
        assert attention and not [p.name for p in attention if SHARD in p.annotations]  # replicated


@pytest.mark.parametrize("name", FAMILIES)
def test_split_lm_head_is_all_gathered(name: str):
    graph = load_input(f"{name}@tiny")
    tp = 2 if tp_fits(name, 2) else 1  # 21B-A3B@tiny with 5 heads: ep only
    ep = 2 if tp == 1 else 1
    for rank in split_graph(graph, mapping_for(graph, tp, ep)):
        if tp == 1:
            assert not gathers(rank)
            continue
        (g,) = gathers(rank)
        head = g.inputs[0].producer
        if head.op == "add":  # ERNIE-3.5-SE's lm_head bias, cut with the columns
            head, bias = head.inputs[0].producer, head.inputs[1]
            assert bias.type.shape == (512,) and shard(rank, bias.name) is not None
        assert head.op == "lm_head"
        assert head.outputs[0].type.shape[-1] == 512 and g.outputs[0].type.shape[-1] == 1024
        assert rank.outputs == [g.outputs[0]]


@pytest.mark.parametrize("name, tied", [("ernie-4.5-0.3b", True), ("gpt-345m", True),
                                         ("ernie-3.5-se-3b", False)])
def test_replicated_lm_head_has_no_collective(name: str, tied: bool):
    graph = load_input(f"{name}@tiny")
    ref = run_graph(graph, {"input_ids": IDS})["logits"]
    pass_rank0 = load_input(f"{name}@tiny")
    run_pipeline(pass_rank0, "split{tp=2,lm_head=replicate}")
    ranks = split_graph(graph, mapping_for(graph, 2), lm_head="replicate")
    assert same_graph(pass_rank0, ranks[0]) is None
    for rank in ranks:
        assert not gathers(rank)
        (head,) = rank.nodes_by_op("lm_head")
        w = head.inputs[1]
        assert SHARD not in w.annotations and w.type.shape == graph.params[w.name].type.shape
        order = list(rank)
        final_norm = order.index(head.inputs[0].producer)
        assert not [n for n in order[final_norm:] if n.op in ("all_reduce", "all_gather")]
        # A tied head needs the whole table, so the embedding is not vocab-parallel either.
        assert bool(rank.nodes_by_op("vocab_parallel_embedding")) is (not tied)
    out = run_spmd(ranks, {"input_ids": IDS})
    assert rel_err(out[0]["logits"], ref) <= 1e-5


def test_o1_after_split_keeps_the_collectives():
    a = load_input("ernie-4.5-300b-a47b@tiny")
    run_pipeline(a, "wint8mix,split{tp=4,ep=2}")
    b = load_input("ernie-4.5-300b-a47b@tiny")
    run_pipeline(b, "wint8mix,split{tp=4,ep=2},O1")
    assert reduces(a) == reduces(b) and len(gathers(b)) == 1


# -- the pass -----------------------------------------------------------------------------------


def test_pass_keeps_the_asked_rank():
    graph = tiny("ernie-4.5-300b-a47b", "wint8mix")
    ranks = split_graph(graph, mapping_for(graph, 4, 2))
    for r in range(4):
        g = tiny("ernie-4.5-300b-a47b", "wint8mix")
        run_pipeline(g, f"split{{tp=4,ep=2,rank={r}}}")
        assert same_graph(g, ranks[r]) is None, r
        par = g.metadata["parallel"]
        assert (par["rank"], par["tp"], par["ep"], par["world_size"], par["moe_tp"]) == (r, 4, 2, 4, 2)
    with pytest.raises(SplitError, match="rank 4 is outside the world of 4"):
        run_pipeline(tiny("ernie-4.5-300b-a47b"), "split{tp=4,ep=2,rank=4}")


def test_trivial_split_changes_nothing():
    graph = load_input("ernie-4.5-0.3b@tiny")
    before = load_input("ernie-4.5-0.3b@tiny")
    run_pipeline(graph, "split{tp=1,ep=1}")
    assert same_graph(graph, before) is None
    assert "parallel" not in graph.metadata


# -- local shapes and annotations -----------------------------------------------------------------


def test_ernie_03b_qkv_heads_halved_kv_replicated():
    graph = load_input("ernie-4.5-0.3b@tiny")  # 8 heads, 1 KV head, head_dim 16, hidden 64
    name = "ernie.layers.0.self_attn.qkv_proj.weight"
    assert graph.params[name].type.shape == (64, (8 + 2) * 16)
    for tp in (2, 4):
        q = 8 // tp * 16
        for r, rank in enumerate(split_graph(graph, mapping_for(graph, tp))):
            assert rank.params[name].type.shape == (64, q + 16 + 16)
            # K and V (one head each, replicated) are adjacent, and so is the last Q chunk: merged
            expect = [[r * q, (r + 1) * q], [128, 160]]
            if expect[0][1] == 128:
                expect = [[r * q, 160]]
            assert ranges(rank, name) == [(1, expect)]
            (split,) = [n for n in rank.nodes_by_op("split") if n.scope == "ernie.layers.0.self_attn"]
            assert list(split.attrs.sizes) == [q, 16, 16]
            (att,) = [n for n in rank.nodes_by_op("attention") if n.scope == "ernie.layers.0.self_attn"]
            assert [v.type.shape[2] for v in att.inputs[:3]] == [8 // tp, 1, 1]
            o = "ernie.layers.0.self_attn.o_proj.weight"
            assert rank.params[o].type.shape == (q, 64)
            assert ranges(rank, o) == [(0, [[r * q, (r + 1) * q]])]


def test_dense_mlp_naive_two_fuse_cut():
    graph = load_input("ernie-4.5-0.3b@tiny")  # intermediate 192: up_gate [64, 384] = [gate | up]
    name = "ernie.layers.1.mlp.up_gate_proj.weight"
    for tp in (2, 4):
        n = 192 // tp
        for r, rank in enumerate(split_graph(graph, mapping_for(graph, tp))):
            assert ranges(rank, name) == [(1, [[r * n, (r + 1) * n], [192 + r * n, 192 + (r + 1) * n]])]
            assert ranges(rank, "ernie.layers.1.mlp.down_proj.weight") == [(0, [[r * n, (r + 1) * n]])]


@pytest.mark.parametrize("tp, ep, expected", [
    (1, 2, [(0, 8), (8, 8)]),
    (1, 4, [(0, 4), (4, 4), (8, 4), (12, 4)]),
    (2, 2, [(0, 8), (8, 8)]),
    (4, 2, [(0, 8), (0, 8), (8, 8), (8, 8)]),
    (4, 4, [(0, 4), (4, 4), (8, 4), (12, 4)]),
])
def test_moe_local_experts_per_rank(tp: int, ep: int, expected: list[tuple[int, int]]):
    graph = load_input("ernie-4.5-300b-a47b@tiny")  # 16 experts, expert intermediate 32, MoE layers 3, 4
    ranks = split_graph(graph, mapping_for(graph, tp, ep))
    moe_tp = max(tp, ep) // ep
    for r, rank in enumerate(ranks):
        nodes = rank.nodes_by_op("moe_local_experts")
        assert [layer_of(n.scope) for n in nodes] == [3, 4]
        first, count = expected[r]
        assert {(n.attrs.first, n.attrs.count) for n in nodes} == {(first, count)}
        ug = rank.params["ernie.layers.3.mlp.experts.up_gate_proj.weight"]
        dn = rank.params["ernie.layers.3.mlp.experts.down_proj.weight"]
        inter = 32 // moe_tp
        assert ug.type.shape == (count, 64, 2 * inter) and dn.type.shape == (count, inter, 64)
        assert ranges(rank, dn.name)[0] == (0, [[first, first + count]])
        j = r % moe_tp
        if moe_tp > 1:
            assert ranges(rank, ug.name)[1] == (2, [[j * inter, (j + 1) * inter],
                                                    [32 + j * inter, 32 + (j + 1) * inter]])
            assert ranges(rank, dn.name)[1] == (1, [[j * inter, (j + 1) * inter]])
        # the router sees every expert on every rank
        gate = rank.params["ernie.layers.3.mlp.gate.weight"]
        assert gate.type.shape == (64, 16) and SHARD not in gate.annotations


def test_tp_only_moe_holds_every_expert():
    graph = load_input("ernie-4.5-300b-a47b@tiny")
    for r, rank in enumerate(split_graph(graph, mapping_for(graph, 2))):
        assert not rank.nodes_by_op("moe_local_experts")
        ug = "ernie.layers.3.mlp.experts.up_gate_proj.weight"
        assert rank.params[ug].type.shape == (16, 64, 32)
        assert ranges(rank, ug) == [(2, [[r * 16, (r + 1) * 16], [32 + r * 16, 32 + (r + 1) * 16]])]


REPLICATED = ("layernorm.weight", "norm.weight", "norm.bias", "layernorm.bias", "mlp.gate.weight",
              "e_score_correction_bias", "position_embeddings.weight")


@pytest.mark.parametrize("name", FAMILIES)
def test_shard_annotations_match_the_reads(name: str):
    """Every rank param: annotated iff cut; its read() is exactly the annotated slice of the global
    param; and the ranks together hold every element of every cut param."""
    graph = tiny(name, "wint8mix,lora{rank=4}")
    moe = name in ("ernie-4.5-21b-a3b", "ernie-4.5-300b-a47b")
    tp, ep = (4, 1) if not moe else (4, 2) if tp_fits(name, 4) else (2, 2) if tp_fits(name, 2) else (1, 4)
    ranks = split_graph(graph, mapping_for(graph, tp, ep))
    covered: dict[tuple[str, int], set[int]] = {}
    cut_names = set()
    for rank in ranks:
        assert set(rank.params) <= set(graph.params)
        for pname, p in rank.params.items():
            g = graph.params[pname]
            ann = p.annotations.get(SHARD)
            rest = {k: v for k, v in p.annotations.items() if k != SHARD}
            assert rest == g.annotations  # quant and other annotations are kept
            assert p.type.dtype == g.type.dtype and p.trainable == g.trainable
            if pname.endswith(REPLICATED):
                assert ann is None, pname
            if ann is None:
                assert p.type.shape == g.type.shape, pname
                assert np.array_equal(p.read(), g.read()), pname
                continue
            cut_names.add(pname)
            assert ann["global_shape"] == list(g.type.shape)
            expect = g.read()
            for cut in ann["cuts"]:
                axis = cut["axis"]
                idx = np.concatenate([np.arange(a, b) for a, b in cut["ranges"]])
                expect = np.take(expect, idx, axis=axis)
                covered.setdefault((pname, axis), set()).update(idx.tolist())
            assert p.type.shape == expect.shape, pname
            got = p.read()
            assert got.shape == expect.shape and got.dtype == expect.dtype
            assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(expect).view(np.uint8)), pname
    assert cut_names, "nothing was cut"
    for (pname, axis), idx in covered.items():
        assert idx == set(range(graph.params[pname].type.shape[axis])), f"{pname} axis {axis} not covered"


# regressed once: at moe_tp=1 the [gate | up] cut covered the whole axis in two ranges
def test_no_annotation_claims_a_whole_axis_cut():
    graph = tiny("ernie-4.5-300b-a47b", "wint8mix,lora{rank=4}")
    for rank in split_graph(graph, mapping_for(graph, 2, 2)):
        for pname, p in rank.params.items():
            ann = p.annotations.get(SHARD)
            for cut in (ann or {}).get("cuts", []):
                held = sum(b - a for a, b in cut["ranges"])
                assert held < ann["global_shape"][cut["axis"]], (pname, cut)


def test_meta_300b_splits_at_full_size_without_data():
    """The published ERNIE-4.5-300B-A47B shapes (REFERENCE 1.2) at tp=8, ep=8: no bytes are needed."""
    graph = load_input("ernie-4.5-300b-a47b@meta")
    rank = split_graph(graph, mapping_for(graph, 8, 8))[3]
    p = rank.params
    assert p["ernie.layers.16.self_attn.qkv_proj.weight"].type.shape == (8192, 1024 + 128 + 128)
    assert ranges(rank, "ernie.layers.16.self_attn.qkv_proj.weight") == [
        (1, [[3 * 1024, 4 * 1024], [8192 + 3 * 128, 8192 + 4 * 128], [9216 + 3 * 128, 9216 + 4 * 128]])]
    assert p["ernie.layers.40.self_attn.o_proj.weight"].type.shape == (1024, 8192)
    assert p["ernie.embed_tokens.weight"].type.shape == (103424 // 8, 8192)
    assert p["ernie.layers.16.mlp.experts.up_gate_proj.weight"].type.shape == (8, 8192, 7168)
    assert p["ernie.layers.16.mlp.experts.down_proj.weight"].type.shape == (8, 3584, 8192)
    assert ranges(rank, "ernie.layers.16.mlp.experts.down_proj.weight") == [(0, [[24, 32]])]
    nodes = rank.nodes_by_op("moe_local_experts")
    assert len(nodes) == 51 and {(n.attrs.first, n.attrs.count) for n in nodes} == {(24, 8)}


GOLDENS = Path(__file__).resolve().parents[1] / "golden" / "parallel"


def test_goldens_show_the_collectives():
    """tests/golden/parallel holds a rank-0 graph per family; tests/golden checks them structurally,
    this checks that each shows what the split did."""
    cases = {GoldenCase.read(p).input.split("@")[0]: GoldenCase.read(p) for p in sorted(GOLDENS.glob("*.ir"))}
    assert set(FAMILIES) <= set(cases)
    for path in sorted(GOLDENS.glob("*.ir")):
        case = GoldenCase.read(path)
        text = case.expected
        opts = dict(kv.split("=") for kv in case.pipeline[len("split{"):-1].split(","))
        tp, ep = int(opts.get("tp", 1)), int(opts.get("ep", 1))
        assert case.pipeline.startswith("split{") and text.count("all_reduce(") >= 1, path.name
        assert f"world_size = {max(tp, ep)}" in text, path.name
        assert ("all_gather(" in text) is (tp > 1), path.name
        assert ("vocab_parallel_embedding(" in text) is (tp > 1), path.name
        assert ("moe_local_experts(" in text) is (ep > 1), path.name
        assert "shard = {cuts" in text, path.name
