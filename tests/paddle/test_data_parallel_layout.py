"""Data parallelism without processes: the layout (Mapping dp, sharding, the process order), how a
batch and the params are split over replicas, what compile writes for --dp, and every refusal
(one line, exit 2) before any process starts. The gloo runs:
tests/distributed/test_gloo_data_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli_kit import user_error

from ernie_ir.backends.paddle.rank_worker import WorkerError, load_rank_graph
from ernie_ir.ir.mapping import Mapping, MappingError
from ernie_ir.targets import CompileOptions, compile_model, verify_artifact
from ernie_ir.training.data_parallel import partition, replica_rows

MODEL = "ernie-4.5-0.3b@tiny"


def test_replica_rows_split_contiguously_and_as_evenly_as_possible() -> None:
    assert [replica_rows(4, 2, d) for d in range(2)] == [(0, 2), (2, 4)]
    assert [replica_rows(3, 2, d) for d in range(2)] == [(0, 2), (2, 3)]
    assert [replica_rows(1, 2, d) for d in range(2)] == [(0, 1), (1, 1)]  # replica 1: no rows
    assert [replica_rows(5, 4, d) for d in range(4)] == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert [replica_rows(8, 4, d) for d in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_partition_is_greedy_by_size_deterministic_and_balanced() -> None:
    sizes = {"a": 10, "b": 10, "c": 6, "d": 4, "e": 1}
    owners = partition(sizes, 2)
    assert owners == partition(dict(reversed(sizes.items())), 2)  # the order given does not matter
    assert owners == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 1}
    load = [sum(s for n, s in sizes.items() if owners[n] == d) for d in range(2)]
    assert load == [16, 15]
    assert set(partition(sizes, 8).values()) == {0, 1, 2, 3, 4}  # more replicas than params: some own none


def test_mapping_records_dp_only_when_set() -> None:
    tp2 = Mapping.create(2, vocab_size=8)
    assert "dp" not in tp2.model_dump(mode="json") and "sharding" not in tp2.model_dump(mode="json")
    layout = tp2.with_data_parallel(2, "stage2")
    data = layout.model_dump(mode="json")
    assert (data["dp"], data["sharding"], layout.processes) == (2, "stage2", 4)
    assert Mapping.model_validate(data) == layout and layout.world_size == 2
    assert [layout.process(g) for g in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # dp outermost
    assert layout.describe() == "world 2, tp 2, dp 2 (sharding stage2): 4 processes"
    with pytest.raises(MappingError, match="add --dp N"):
        tp2.with_data_parallel(1, "stage1")
    with pytest.raises(ValueError):
        Mapping.model_validate({**tp2.model_dump(mode="json"), "sharding": "stage1"})


def test_compile_dp_stores_the_rank_graphs_once_and_records_the_layout(tmp_path: Path) -> None:
    out = tmp_path / "art"
    report = compile_model(MODEL, "cuda", CompileOptions(mode="training", lora_rank=4, tp=2, dp=2,
                           sharding="stage1", out=out))
    assert report.parallel == "world 2, tp 2, dp 2 (sharding stage1): 4 processes"
    assert sorted(p.name for p in out.glob("rank*")) == ["rank0", "rank1"]
    manifest = verify_artifact(out)
    par = manifest.parallel
    assert (par.world_size, par.dp, par.processes, par.sharding) == (2, 2, 4, "stage1")
    assert (par.mapping["dp"], par.mapping["sharding"]) == (2, "stage1")
    recipe = json.loads((out / "training/train.json").read_text())
    assert recipe["data_parallel"] == {"dp": 2, "sharding": "stage1", "processes": 4}
    assert recipe["world_size"] == 2 and "--nproc_per_node 4" in recipe["launch"]["cuda"]
    launch = json.loads((out / "training/launch.json").read_text())
    assert launch["nproc"] == 4 and launch["devices"] == "0,1,2,3"
    assert "--nproc_per_node 4" in (out / "training/launch.sh").read_text()
    # a device launch of the wrong size is refused by each rank, naming the count to start
    with pytest.raises(WorkerError, match=r"2 rank\(s\) x dp 2 but 2 process\(es\) were started: launch 4"):
        load_rank_graph(out, 0, 2, dp=2)
    _, graph = load_rank_graph(out, 3, 4, dp=2)
    assert graph.metadata["parallel"]["rank"] == 1  # process 3 = replica 1 of rank graph 1


@pytest.mark.parametrize(("argv", "message"), [
    (["--dp", "2"], "--dp 2: data parallelism is a training layout"),
    (["--mode", "training", "--lora-rank", "4", "--sharding", "stage1"],
     "--sharding stage1 splits the optimizer"),
    (["--mode", "training", "--lora-rank", "4", "--dp", "2", "--sharding", "stage3"],
     "--sharding stage3: unknown"),
    (["--mode", "training", "--lora-rank", "4", "--dp", "0"], "--dp 0: the data-parallel degree must be"),
    (["--mode", "training", "--lora-rank", "4", "--tp", "2", "--dp", "2049"],
     "= 4098 processes, more than the 4096 a launch recipe starts"),
])
def test_compile_refuses_bad_data_parallel_layouts(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                   argv: list[str], message: str) -> None:
    line = user_error(capsys, "compile", MODEL, "--target", "cuda", "--out", str(tmp_path / "x"), *argv)
    assert message in line
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("dp-layout")
    out = {"dp2": tmp / "dp2", "one": tmp / "one", "qat": tmp / "qat"}
    compile_model(MODEL, "cuda", CompileOptions(mode="training", lora_rank=4, dp=2, out=out["dp2"]))
    compile_model(MODEL, "cuda", CompileOptions(mode="training", lora_rank=4, out=out["one"]))
    compile_model(MODEL, "cuda", CompileOptions(mode="training", quant="qat-int8", out=out["qat"]))
    return out


@pytest.mark.parametrize(("art", "argv", "message"), [
    ("dp2", ["--batch-size", "3"], "--batch-size 3 does not split into --dp 2 replicas"),
    ("dp2", ["--dp", "1", "--sharding", "stage2"], "--sharding stage2 splits the optimizer states"),
    ("one", ["--sharding", "stage1"], "--sharding stage1 splits the optimizer states"),
    ("one", ["--dp", "3", "--batch-size", "4"], "--batch-size 4 does not split into --dp 3"),
    ("one", ["--sharding", "stage3"], "--sharding: Input should be 'stage1' or 'stage2'"),
    ("qat", ["--dp", "2"], "--dp 2: this artifact trains QAT moving-average scales"),
])
def test_train_refuses_bad_layouts_before_any_process(capsys: pytest.CaptureFixture[str],
                                                      arts: dict[str, Path], art: str, argv: list[str],
                                                      message: str) -> None:
    line = user_error(capsys, "train", str(arts[art]), "--steps", "1", "--no-progress", *argv)
    assert message in line
    assert not (arts[art] / "training/checkpoints").exists()
