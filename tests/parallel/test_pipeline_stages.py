"""Pipeline parallelism's cut (passes/parallel/pipeline_stages.py) and its layout (ir/mapping.py).

- Cutting a whole @tiny graph (dense, MoE, GPT) into stages: the stage graphs, chained in the
  reference interpreter (stage s's outputs fed as stage s+1's inputs), give exactly the whole
  graph's logits; each verifies; stage s's outputs are stage s+1's inputs by name; every param
  is held by some stage and only a tied embedding by two; the stage metadata is right.
- Cutting tensor-parallel rank graphs (tp 2, with and without sp): `run_pipeline_spmd` over the
  stage graphs gives exactly `run_spmd`'s logits over the uncut rank graphs; with sp the second
  stage records its token-shard input as rank-varying.
- `min_max_partition` against a brute force over every contiguous partition.
- `stage_bounds` on the 300B @meta graph matches ERNIEKit's published segments.
- A trainable tied embedding: held by the first and last stage, both record it (`tied`: the
  runtime sums its gradients); a trainable param read by other stages is refused.
- Refusals (StageError naming the fix) and the pipelined `Mapping` (counts, dump, validation).
"""

from __future__ import annotations

import itertools
import random
import re

import numpy as np
import pytest

from ernie_ir.ir import Graph
from ernie_ir.ir.mapping import PIPELINE_STAGE, Mapping, stage_info
from ernie_ir.ir.storage import clone_graph
from ernie_ir.ir.verifier import verify
from ernie_ir.load import load_input
from ernie_ir.passes.parallel.pipeline_stages import (
    StageError,
    check_pipeline,
    cut_stages,
    decoder_layer,
    layer_count,
    min_max_partition,
    pipeline_ranks,
    stage_bounds,
)
from ernie_ir.passes.parallel.rank_varying import rank_varying
from ernie_ir.passes.parallel.split import mapping_for, split_graph
from ernie_ir.runtime import Interpreter
from ernie_ir.runtime.spmd import run_pipeline_spmd, run_spmd

IDS = np.array([[1, 5, 900, 77, 3, 1000], [7, 8, 9, 10, 511, 512]], dtype=np.int64)  # 12 tokens
FAMILIES = ("ernie-4.5-0.3b", "ernie-4.5-21b-a3b", "gpt-345m")


def _tied(graph: Graph) -> set[str]:
    """Params read both by an embedding lookup and by the lm_head (a tied embedding)."""
    by_op: dict[str, set[str]] = {}
    for node in graph:
        for v in node.inputs:
            if v is not None and v.name in graph.params and graph.params[v.name] is v:
                by_op.setdefault(node.op, set()).add(v.name)
    emb = by_op.get("embedding", set()) | by_op.get("vocab_parallel_embedding", set())
    return emb & by_op.get("lm_head", set())


def _chain(stages: list[Graph], feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    outs: dict[str, np.ndarray] = dict(feed)
    for g in stages:
        outs = Interpreter(g).run(outs)
    return outs


def _check_cut(graph: Graph, pp: int) -> None:
    n = layer_count(graph)
    bounds = stage_bounds(graph, pp)
    assert len(bounds) == pp
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b for a, b in bounds)
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(pp - 1))
    stages = cut_stages(graph, bounds)
    assert len(stages) == pp

    ref = Interpreter(graph).run({"input_ids": IDS})["logits"]
    got = _chain(stages, {"input_ids": IDS})
    assert list(got) == list(graph.output_names)
    assert got["logits"].shape == ref.shape and got["logits"].dtype == ref.dtype
    assert np.array_equal(got["logits"], ref)

    for g in stages:
        verify(g)
    assert [v.name for v in stages[0].inputs] == [v.name for v in graph.inputs]
    for s in range(pp - 1):
        assert stages[s].output_names, f"stage {s} sends nothing"
        assert list(stages[s].output_names) == [v.name for v in stages[s + 1].inputs]
    assert list(stages[-1].output_names) == list(graph.output_names)

    # no node duplicated or lost, and each in its stage's layers
    assert sum(len(list(g)) for g in stages) == len(list(graph))
    for s, g in enumerate(stages):
        layers = {decoder_layer(node) for node in g} - {None}
        assert layers == set(range(*bounds[s])), (s, layers)

    holders = {name: [s for s, g in enumerate(stages) if name in g.params] for name in graph.params}
    assert all(holders[name] for name in graph.params), [k for k, v in holders.items() if not v]
    assert set().union(*(g.params for g in stages)) == set(graph.params)
    twice = {name for name, h in holders.items() if len(h) > 1}
    assert twice == _tied(graph)
    for name in twice:
        assert holders[name] == [0, pp - 1]
        assert not graph.params[name].trainable
    for g in stages:  # shared, not copied
        for name, p in g.params.items():
            assert p.source is graph.params[name].source
            assert p.type == graph.params[name].type

    for s, g in enumerate(stages):
        info = stage_info(g.metadata)
        assert info is not None and g.metadata[PIPELINE_STAGE] is info
        assert info["stage"] == s and info["pp"] == pp
        assert info["layers"] == list(bounds[s])
        assert info["stages"] == [list(b) for b in bounds]
        assert len(info["grad_edges"]) == pp - 1
        assert info["rank_varying_inputs"] == []
        assert info["tied"] == []  # frozen
    assert stage_info(graph.metadata) is None  # the whole graph is left as it was


@pytest.mark.parametrize("name", FAMILIES)
def test_two_stages_equal_the_whole_graph(name: str) -> None:
    graph = load_input(f"{name}@tiny")
    _check_cut(graph, 2)


def test_three_stages_of_the_moe_model() -> None:
    graph = load_input("ernie-4.5-21b-a3b@tiny")
    assert layer_count(graph) == 3
    assert stage_bounds(graph, 3) == ((0, 1), (1, 2), (2, 3))
    _check_cut(graph, 3)


def test_one_stage_is_the_whole_graph() -> None:
    graph = load_input("ernie-4.5-0.3b@tiny")
    (stage,) = cut_stages(graph, stage_bounds(graph, 1))
    assert np.array_equal(Interpreter(stage).run({"input_ids": IDS})["logits"],
                          Interpreter(graph).run({"input_ids": IDS})["logits"])
    assert set(stage.params) == set(graph.params)
    assert stage_info(stage.metadata)["layers"] == [0, layer_count(graph)]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("sp", [True, False])
def test_tensor_parallel_ranks_cut_into_stages(name: str, sp: bool) -> None:
    graph = load_input(f"{name}@tiny")
    ranks = split_graph(graph, mapping_for(graph, 2, 1), sp=sp)
    ref = run_spmd(ranks, {"input_ids": IDS})
    stages, bounds = pipeline_ranks(ranks, 2)
    assert bounds == stage_bounds(ranks[0], 2)
    assert len(stages) == 2 * len(ranks)
    for g in stages:
        verify(g)
    for g_index, g in enumerate(stages):  # graph g: stage g // world of rank g % world
        info = stage_info(g.metadata)
        assert info is not None and info["stage"] == g_index // 2 and info["pp"] == 2
    out = run_pipeline_spmd(stages, 2, {"input_ids": IDS})
    assert len(out) == len(ref) == 2
    for o, r in zip(out, ref, strict=True):
        # measured: exactly equal (same kernels, same order; the cut only moves values across)
        assert np.array_equal(o["logits"], r["logits"])
    for r in range(2):
        assert list(stages[r].output_names) == [v.name for v in stages[2 + r].inputs]
    for g in stages[:2]:
        assert stage_info(g.metadata)["rank_varying_inputs"] == []
    for g in stages[2:]:
        varying = stage_info(g.metadata)["rank_varying_inputs"]
        if sp:
            # the residual stream crosses as rank r's shard of the tokens
            assert varying, "the token shard is not recorded as rank-varying"
            for v in g.inputs:
                if v.name in varying:
                    assert v.type.shape[0] == "Tsp", (v.name, v.type)
            assert all(v.name in varying for v in g.inputs if v.type.shape and v.type.shape[0] == "Tsp")
            assert {id(v) for v in g.inputs if v.name in varying} <= rank_varying(g)
        else:
            assert varying == []


def _brute_force(costs: list[int], parts: int) -> int:
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        edges = (0, *cuts, n)
        worst = max(sum(costs[edges[k]:edges[k + 1]]) for k in range(parts))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(8))
def test_min_max_partition_is_optimal(seed: int) -> None:
    rng = random.Random(seed)
    for parts in range(1, 5):
        for n in range(parts, parts + 6):
            items = [rng.randint(0, 50) for _ in range(n)]

            def cost(st: int, i: int, j: int, items: list[int] = items) -> int:
                return sum(items[i:j])

            got = min_max_partition(n, parts, cost)
            assert len(got) == parts
            assert got[0][0] == 0 and got[-1][1] == n
            assert all(a < b for a, b in got), (items, parts, got)
            assert all(got[k][1] == got[k + 1][0] for k in range(parts - 1))
            assert max(cost(k, a, b) for k, (a, b) in enumerate(got)) == _brute_force(items, parts), (
                items, parts, got)


def test_min_max_partition_uses_the_stage_dependent_cost() -> None:
    # the first part also pays 100 (an embedding): the best split gives it fewer layers
    items = [10] * 10

    def cost(st: int, i: int, j: int) -> int:
        return sum(items[i:j]) + (100 if st == 0 else 0)

    assert min_max_partition(10, 2, cost) == [(0, 1), (1, 10)]
    assert min_max_partition(10, 1, cost) == [(0, 10)]


def test_300b_meta_stage_bounds_match_erniekit() -> None:
    graph = load_input("ernie-4.5-300b-a47b@meta")
    assert layer_count(graph) == 54
    # ERNIEKit's published segments [0, 29, 57] count the embedding as a layer (and the head)
    assert stage_bounds(graph, 2) == ((0, 28), (28, 54))


def test_check_pipeline_refuses_more_stages_than_layers() -> None:
    with pytest.raises(StageError, match=re.escape("give --pp 2 or less")) as err:
        check_pipeline(3, 2, "tiny-model")
    assert "tiny-model has 2 decoder layer(s)" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(StageError, match=re.escape("must be an integer >= 1")):
        check_pipeline(0, 2)
    check_pipeline(2, 2)  # as many stages as layers is fine
    graph = load_input("ernie-4.5-0.3b@tiny")
    with pytest.raises(StageError, match=re.escape("give --pp 2 or less")):
        stage_bounds(graph, 3)
    with pytest.raises(StageError, match=re.escape(">= 1")):
        stage_bounds(graph, 0)


def test_cut_records_a_trainable_tied_embedding_on_both_ends() -> None:
    graph = load_input("ernie-4.5-21b-a3b@tiny")  # 3 layers
    (name,) = _tied(graph)
    copy = clone_graph(graph)
    copy.params[name].trainable = True
    for pp in (2, 3):
        stages = cut_stages(copy, stage_bounds(copy, pp))
        assert [stage_info(g.metadata)["tied"] for g in stages] == [[name], *[[]] * (pp - 2), [name]]
        assert [name in g.params and g.params[name].trainable for g in stages] == [True, *[False] * (pp - 2),
                                                                                   True]
    assert not graph.params[name].trainable


def test_cut_refuses_a_trainable_param_read_by_other_stages() -> None:
    graph = clone_graph(load_input("ernie-4.5-21b-a3b@tiny"))
    shared = "ernie.layers.0.input_layernorm.weight"
    node = next(n for n in graph if decoder_layer(n) == 1 and n.scope.endswith("input_layernorm"))
    i = next(i for i, v in enumerate(node.inputs) if v is not None and v.name in graph.params)
    node.set_input(i, graph.params[shared])  # layer 1 reads layer 0's norm: stages 0 and 1 of 3
    graph.params[shared].trainable = True
    with pytest.raises(StageError, match=re.escape(shared)) as err:
        cut_stages(graph, stage_bounds(graph, 3))
    msg = str(err.value)
    assert "stages [0, 1]" in msg and "--pp 1" in msg and "frozen" in msg and "\n" not in msg


def test_mapping_with_pipeline() -> None:
    m = Mapping.create(tp=2).with_pipeline(((0, 1), (1, 2)), 4)
    assert (m.pp, m.stages, m.micro_batches) == (2, ((0, 1), (1, 2)), 4)
    assert m.rank_graphs == 4 and m.processes == 4
    assert [m.stage_of(g) for g in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert m.stage_of(3) == (1, 1)
    assert m.process(3) == (0, 3)
    dump = m.model_dump()
    assert dump["pp"] == 2 and dump["micro_batches"] == 4
    assert [tuple(s) for s in dump["stages"]] == [(0, 1), (1, 2)]
    assert Mapping.model_validate(dump) == m
    assert Mapping.model_validate_json(m.model_dump_json()) == m
    dp = m.with_data_parallel(2)
    assert dp.processes == 8 and dp.process(5) == (1, 1)

    plain = Mapping.create(tp=2)
    assert plain.pp == 1 and plain.rank_graphs == 2
    assert not {"pp", "stages", "micro_batches"} & set(plain.model_dump())


@pytest.mark.parametrize("update", [
    {"pp": 2, "stages": ((0, 1), (2, 3))},          # not contiguous
    {"pp": 2, "stages": ((0, 1), (1, 1))},          # an empty stage
    {"pp": 3, "stages": ((0, 1), (1, 2))},          # pp != number of stages
    {"pp": 2},                                      # no stages
    {"stages": ((0, 2),)},                          # stages with pp 1
    {"micro_batches": 2},                           # micro-batches without a pipeline
])
def test_mapping_refuses_a_bad_pipeline(update: dict[str, object]) -> None:
    base = Mapping.create(tp=2).model_dump()
    with pytest.raises(ValueError, match=r"stages must be|micro_batches needs"):
        Mapping.model_validate({**base, **update})
