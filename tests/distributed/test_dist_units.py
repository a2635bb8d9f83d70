"""The pieces of the distributed runtime that need no second process: the Paddle lowerings of
the parallel ops (world 1 and rank-local ops against the reference kernels), the "f" insertion,
the refusal to run a rank graph outside paddle.distributed, the checkpoint merge and the launch
recipes of multi-rank artifacts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _dist_testkit import compile_art

from ernie_ir.backends.paddle.layer import PaddleEmitError, build_layer, require_paddle
from ernie_ir.ir import GraphBuilder, i64, tensor
from ernie_ir.ir.storage import load_graph
from ernie_ir.ir.weights import ArraySource
from ernie_ir.passes.parallel.rank_varying import rank_varying
from ernie_ir.runtime.interpreter import run_graph
from ernie_ir.training.rank_worker import merge_shards


def _parallel_ops_graph() -> GraphBuilder:
    rng = np.random.default_rng(0)
    b = GraphBuilder("parallel_ops")
    ids = b.input("ids", tensor(i64, "B", "S"))
    table = b.param("table", source=ArraySource(rng.standard_normal((4, 8)).astype(np.float32)))
    router = b.param("router", source=ArraySource(rng.standard_normal((8, 6)).astype(np.float32)))
    h = b.vocab_parallel_embedding(ids, table, vocab_start=4, vocab_size=12)
    h = b.all_reduce(h, world_size=1)
    w, idx = b.moe_gate(h, router, top_k=3)
    w, idx = b.moe_local_experts(w, idx, first=2, count=2)
    g = b.all_gather(h, axis=-1, world_size=1)
    b.output(g, w, idx, names=["h", "w", "idx"])
    return b


def test_parallel_op_lowerings_equal_reference_kernels() -> None:
    paddle = require_paddle()
    graph = _parallel_ops_graph().graph
    ids = np.array([[0, 3, 4, 5, 7, 8, 11]], np.int64)  # below, inside and above rows [4, 8)
    ref = run_graph(graph, {"ids": ids})
    layer = build_layer(graph, device="cpu")
    h, w, idx = (t.numpy() for t in layer(paddle.to_tensor(ids)))
    np.testing.assert_allclose(h, ref["h"], rtol=1e-6)
    assert not h[0, [0, 1, 5, 6]].any()  # ids held by other ranks look up zeros
    np.testing.assert_allclose(w, ref["w"], rtol=1e-6)
    np.testing.assert_array_equal(idx, ref["idx"])


def test_rank_graph_outside_paddle_distributed_is_one_line(tmp_path: Path) -> None:
    paddle = require_paddle()
    art = compile_art(tmp_path, "gpt-345m@tiny", "gpt", tp=2)
    layer = build_layer(load_graph(art / "rank0"), device="cpu")
    with pytest.raises(PaddleEmitError, match=r"over 2 ranks needs 2 paddle.distributed processes") as e:
        layer(paddle.to_tensor(np.array([[1, 2]], np.int64)))
    assert "\n" not in str(e.value) and "--backend paddle" in str(e.value)


def test_f_guards_exactly_the_replicated_inputs_of_rank_dependent_nodes(tmp_path: Path) -> None:
    """LoRA tp 2: f before each column layer's replicated input and its whole lora_A, before
    each row layer's whole lora_B; never before a cut param or a rank-local value."""
    art = compile_art(tmp_path, "ernie-4.5-0.3b@tiny", "lora", tp=2, mode="training", lora_rank=4)
    graph = load_graph(art / "rank0")
    varying = rank_varying(graph)
    guarded = set()
    for node in graph:
        if node.op in ("all_reduce", "all_gather") or not any(id(o) in varying for o in node.outputs):
            continue
        for v in node.inputs:
            if (v is not None and id(v) not in varying and v.type.dtype.is_float
                    and not (hasattr(v, "trainable") and (not v.trainable or "shard" in v.annotations))):
                guarded.add(id(v))
    assert build_layer(graph, device="cpu", grad_sync=True).synced_values == len(guarded) > 0
    assert build_layer(graph, device="cpu").synced_values == 0  # inference: no f at all
    names = {v.name for v in graph.params.values() if id(v) in guarded}
    assert names == {n for n, p in graph.params.items() if p.trainable and "shard" not in p.annotations}
    assert all(n.endswith(("qkv_proj.lora_A", "up_gate_proj.lora_A", "o_proj.lora_B", "down_proj.lora_B"))
               for n in names)


def test_merge_shards_reassembles_cuts_and_takes_rank0_where_ranks_overlap() -> None:
    full = np.arange(4 * 10, dtype=np.float32).reshape(4, 10)
    cut0 = {"global_shape": [4, 10], "cuts": [{"axis": 1, "ranges": [[0, 3], [6, 10]]}]}
    cut1 = {"global_shape": [4, 10], "cuts": [{"axis": -1, "ranges": [[3, 6], [6, 10]]}]}  # [6, 10) on both
    r0 = full[:, [0, 1, 2, 6, 7, 8, 9]].copy()
    r1 = full[:, [3, 4, 5, 6, 7, 8, 9]].copy()
    r1[:, 3:] += 100  # a (wrong) copy of the shared columns: rank 0's must win
    np.testing.assert_array_equal(merge_shards("p", [(r0, cut0), (r1, cut1)]), full)
    np.testing.assert_array_equal(merge_shards("q", [(full, None), (full + 1, None)]), full)
    with pytest.raises(Exception, match="do not cover"):
        merge_shards("p", [(r0, cut0), (r0, cut0)])


@pytest.mark.parametrize("target,flag,env,backend,device", [
    ("cuda", "--gpus", "CUDA_VISIBLE_DEVICES", "nccl", "gpu"),
    ("ascend", "--npus", "ASCEND_RT_VISIBLE_DEVICES", "xccl", "npu"),
    ("kunlun", "--xpus", "XPU_VISIBLE_DEVICES", "bkcl", "xpu"),
])
def test_multi_rank_launch_recipe_starts_the_rank_worker(tmp_path: Path, target: str, flag: str, env: str,
                                                         backend: str, device: str) -> None:
    from ernie_ir.targets import CompileOptions, compile_model

    for mode, extra in (("inference", {}), ("training", {"lora_rank": 4})):
        out = tmp_path / f"{target}-{mode}"
        compile_model("ernie-4.5-0.3b@tiny", target, CompileOptions(tp=2, mode=mode, out=out, **extra))
        recipe = json.loads((out / mode / "launch.json").read_text())
        assert recipe["nproc"] == 2 and recipe["flag"] == flag and recipe["env"][env] == "0,1"
        assert recipe["collective_backend"].startswith(backend)
        assert recipe["cpu"]["collective_backend"] == "gloo"
        script = (out / mode / "launch.sh").read_text()
        worker = ("ernie_ir.training.rank_worker" if mode == "training" else
                  "ernie_ir.backends.paddle.rank_worker run")
        launch = f'--nproc_per_node 2 {flag} "${{{env}}}" "$PYTHON" -m {worker} "$ARTIFACT" --device {device}'
        assert launch in script
        assert "command -v ernie-ir" not in script
        assert ("PADDLE_XCCL_BACKEND" in script) == (target == "ascend")
        if mode == "training":
            train = json.loads((out / "training/train.json").read_text())
            assert train["world_size"] == 2 and train["cpu_collective_backend"] == "gloo"
            assert "--nproc_per_node 2" in train["launch"][target] and "--save" in script


def test_a_cpu_launch_strips_the_device_variables_the_artifact_names(tmp_path: Path) -> None:
    """The built-in targets' variables, plus whatever a (plugin) target's recipe sets."""
    from ernie_ir.backends.paddle.launch import device_env

    (tmp_path / "inference").mkdir()
    (tmp_path / "inference" / "launch.json").write_text(json.dumps(
        {"target": "dcu", "env": {"HIP_VISIBLE_DEVICES": "0,1", "DCU_EXTRA": "1"}}))
    names = device_env(tmp_path)
    assert {"HIP_VISIBLE_DEVICES", "DCU_EXTRA", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"} <= names
    (tmp_path / "inference" / "launch.json").write_text("{not json")
    assert "HIP_VISIBLE_DEVICES" not in device_env(tmp_path)


def test_process_groups_are_made_by_one_helper_in_one_order_each_with_a_barrier(monkeypatch) -> None:
    """Data and pipeline parallelism list their groups; `create_groups` creates every one on every
    process, in the listing's order, a barrier after each, and hands back the process's own."""
    from ernie_ir.backends.paddle.groups import create_groups, data_parallel_group_ranks, pipeline_group_ranks
    from ernie_ir.backends.paddle.pipeline import pipeline_groups
    from ernie_ir.training.data_parallel import new_groups

    assert data_parallel_group_ranks(2, 2) == [(("mp", 0), [0, 1]), (("mp", 1), [2, 3]), (("dp", 0), [0, 2]),
                                               (("dp", 1), [1, 3])]
    assert data_parallel_group_ranks(3, 1) == [(("dp", 0), [0, 1, 2])]  # one rank: no mp group
    assert pipeline_group_ranks(3, 2) == [
        (("mp", 0), [0, 1]), (("mp", 1), [2, 3]), (("mp", 2), [4, 5]),
        (("edge", 0, 0), [0, 2]), (("edge", 0, 1), [1, 3]),
        (("edge", 1, 0), [2, 4]), (("edge", 1, 1), [3, 5]),
        (("ring", 0), [0, 2, 4]), (("ring", 1), [1, 3, 5]),
        (("ends", 0), [0, 4]), (("ends", 1), [1, 5])]  # the tied embedding's first and last stage
    assert pipeline_group_ranks(2, 1) == [(("edge", 0, 0), [0, 1])]  # two stages: the edge is the ring

    calls: list[tuple[str, ...] | tuple[str, list[int]]] = []

    class FakeDist:  # paddle.distributed's two calls, recorded
        @staticmethod
        def new_group(ranks: list[int]) -> tuple[int, ...]:
            calls.append(("new_group", ranks))
            return tuple(ranks)

        @staticmethod
        def barrier() -> None:
            calls.append(("barrier",))

    pytest.importorskip("paddle.distributed")  # loaded, then replaced on the package below
    import paddle

    monkeypatch.setattr(paddle, "distributed", FakeDist)
    wanted = data_parallel_group_ranks(2, 2)
    assert create_groups(3, wanted) == {("mp", 1): (2, 3), ("dp", 1): (1, 3)}
    assert calls == [c for _, ranks in wanted for c in (("new_group", ranks), ("barrier",))]
    assert new_groups(3, 2, 2) == ((2, 3), (1, 3)) and new_groups(1, 2, 1) == (None, (0, 1))
    calls.clear()
    assert new_groups(0, 1, 2) == (None, None) and calls == []  # one replica: no group at all
    g = pipeline_groups(3, 3, 2)  # stage 1 of tensor rank 1
    assert (g.stage, g.mp_rank, g.mp, g.prev, g.next, g.ring, g.ends) == (1, 1, (2, 3), (1, 3), (3, 5),
                                                                          (1, 3, 5), None)
    assert pipeline_groups(5, 3, 2).ends == (1, 5)  # the last stage of tensor rank 1
    g = pipeline_groups(1, 2, 1)  # the last of two stages: its ring and its ends are its edge
    assert (g.stage, g.mp, g.prev, g.next, g.ring, g.ends) == (1, None, (0, 1), None, (0, 1), (0, 1))
