"""The pipeline cut as a pass (`pipeline-stages{pp=N}`) run by the pass manager, and by compile.

- After `split`, the manager hands the cut every rank graph at once (a fan-out after a fan-out):
  it returns pp x world stage graphs, stage-major, the very graphs `pipeline_ranks` makes; the
  passes after it run on each stage graph; instruments see it (index, spec, the first graph it
  made, its counts); `stop_after` and `disabled_passes` cut it like any pass.
- The verifier runs on every stage graph it made: a broken one is named with the pass.
- Run on one graph (`run_pipeline`, `show --pipeline`), the graph becomes stage `stage`.
- compile --pp appends it after the target's legalization: the manifest's pipeline ends with it,
  the progress instrument reports it, the rank folders hold exactly `pipeline_ranks` of the
  legalized rank graphs (what compile wrote before the cut was a pass), `--stop-after` the
  legalization keeps the uncut rank graphs, `--disable-pass pipeline-stages` writes the
  tensor-parallel artifact alone, and a `--pipeline` holding the cut is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.mapping import Mapping, stage_info
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.storage import load_graph
from ernie_ir.load import load_input
from ernie_ir.passes import PassContext, PassInstrument, TimingInstrument, run_pipeline
from ernie_ir.passes.infra.base import Pass
from ernie_ir.passes.infra.manager import PassVerificationError, run_pipeline_ranks
from ernie_ir.passes.parallel import pipeline_stages
from ernie_ir.passes.parallel.pipeline_stages import StageError, pipeline_ranks
from ernie_ir.targets import CompileOptions, compile_model, read_manifest, verify_artifact

MODEL = "ernie-4.5-0.3b@tiny"  # 2 decoder layers


class Recorder(PassInstrument):
    def __init__(self) -> None:
        self.after: list[tuple[int, str, Graph, bool, dict[str, int]]] = []
        self.timed: list[str] = []

    def after_pass(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext) -> None:
        self.after.append((index, p.spec(), graph, changed, dict(ctx.stats)))

    def pass_timed(self, index: int, p: Pass, times: object) -> None:
        self.timed.append(p.spec())


def _texts(graphs: list[Graph]) -> list[str]:
    return [print_graph(g) for g in graphs]


def test_the_cut_after_the_split_is_a_fan_out_of_every_rank_graph() -> None:
    rec, timing = Recorder(), TimingInstrument()
    graph = load_input(MODEL)
    ranked = run_pipeline_ranks(graph, "split{tp=2,sp=true},pipeline-stages{pp=2},dce",
                                instruments=[rec, timing])
    stages = ranked.ranks
    assert len(stages) == 4
    for g_index, g in enumerate(stages):  # graph g: stage g // world of tensor rank g % world
        assert stage_info(g.metadata)["stage"] == g_index // 2
        assert stage_info(g.metadata)["stages"] == [[0, 1], [1, 2]]
        assert g.metadata["parallel"]["rank"] == g_index % 2
    assert ranked.global_graph is graph and stage_info(graph.metadata) is None  # as the split found it
    # exactly the graphs the cut makes by hand of the split's rank graphs (dce finds nothing)
    split = run_pipeline_ranks(load_input(MODEL), "split{tp=2,sp=true}").ranks
    by_hand, bounds = pipeline_ranks(split, 2)
    assert bounds == ((0, 1), (1, 2))
    assert _texts(stages) == _texts(by_hand)
    assert stage_info(stages[2].metadata)["rank_varying_inputs"] == ["act0"]  # the token shard
    # the instruments see the cut as pass 2, after the split, on the first stage graph it made
    assert [(i, spec) for i, spec, *_ in rec.after] == [
        (1, "split{tp=2,sp=true}"), (2, "pipeline-stages{pp=2}"),
        (3, "dce"), (3, "dce"), (3, "dce"), (3, "dce")]
    _, _, seen, changed, stats = rec.after[1]
    assert seen is stages[0] and changed and stats == {"stages": 2, "stage-graphs": 4}
    assert rec.timed[:2] == ["split{tp=2,sp=true}", "pipeline-stages{pp=2}"]
    assert [r.spec for r in timing.rows][:2] == ["split{tp=2,sp=true}", "pipeline-stages{pp=2}"]
    assert ranked.result.stats["2:pipeline-stages"] == {"stages": 2, "stage-graphs": 4}
    assert ranked.result.changed_by[:2] == ["split", "pipeline-stages"]


def test_stop_after_and_disable_cut_the_cut_like_any_pass() -> None:
    text = "split{tp=2},pipeline-stages{pp=2},dce"
    stopped = run_pipeline_ranks(load_input(MODEL), text, stop_after="pipeline-stages").ranks
    assert [stage_info(g.metadata)["stage"] for g in stopped] == [0, 0, 1, 1]
    by_position = run_pipeline_ranks(load_input(MODEL), text, stop_after=2).ranks
    assert _texts(by_position) == _texts(stopped)
    uncut = run_pipeline_ranks(load_input(MODEL), text, disabled_passes=["pipeline-stages"]).ranks
    assert len(uncut) == 2 and all(stage_info(g.metadata) is None for g in uncut)
    alone = run_pipeline_ranks(load_input(MODEL), "pipeline-stages{pp=2}").ranks  # no split: 1 x pp
    assert [(stage_info(g.metadata)["stage"], [v.name for v in g.inputs]) for g in alone] == [
        (0, ["input_ids"]), (1, ["act0"])]


def test_the_verifier_names_the_cut_when_a_stage_graph_is_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    real = pipeline_ranks

    def broken(ranks: list[Graph], pp: int) -> tuple[list[Graph], tuple[tuple[int, int], ...]]:
        stages, bounds = real(ranks, pp)
        g = stages[3]  # stage 1 of tensor rank 1: drop a node whose result is read
        node = next(n for n in g if any(o._uses for o in n.outputs))
        g.erase(node, force=True)
        return stages, bounds

    monkeypatch.setattr(pipeline_stages, "pipeline_ranks", broken)
    with pytest.raises(PassVerificationError) as e:
        run_pipeline_ranks(load_input(MODEL), "split{tp=2},pipeline-stages{pp=2}")
    assert ("IR is invalid after pass pipeline-stages{pp=2} (pass 2; ran before it: split{tp=2})"
            in str(e.value))


def test_on_one_graph_the_cut_keeps_one_stage() -> None:
    graph = load_input(MODEL)
    result = run_pipeline(graph, "pipeline-stages{pp=2,stage=1}")
    assert result.changed_by == ["pipeline-stages"]
    info = stage_info(graph.metadata)
    assert (info["stage"], info["pp"], info["layers"]) == (1, 2, [1, 2])
    assert [v.name for v in graph.inputs] == ["act0"] and graph.output_names == ["logits"]
    assert not run_pipeline(load_input(MODEL), "pipeline-stages").changed  # pp 1: the whole graph
    with pytest.raises(StageError, match="stage 2 is outside the 2 stage"):
        run_pipeline(load_input(MODEL), "pipeline-stages{pp=2,stage=2}")
    with pytest.raises(StageError, match="already pipeline stage 1 of 2"):
        run_pipeline(graph, "pipeline-stages{pp=2}")
    with pytest.raises(StageError, match="has 2 decoder layer"):
        run_pipeline(load_input(MODEL), "pipeline-stages{pp=3}")


def test_compile_runs_the_cut_after_legalization_and_records_it(tmp_path: Path) -> None:
    progress: list[str] = []
    report = compile_model(MODEL, "cuda", CompileOptions(tp=2, pp=2, micro_batches=2, out=tmp_path / "a"),
                           progress=lambda stage, done, total: progress.append(stage))
    assert report.pipeline == "split{tp=2},legalize-cuda,pipeline-stages{pp=2}"
    assert report.passes_run[-1] == "pipeline-stages{pp=2}"
    assert progress.count("pass pipeline-stages") == 1
    manifest = verify_artifact(tmp_path / "a")
    assert manifest.pipeline == report.pipeline
    mapping = Mapping.model_validate(manifest.parallel.mapping)
    assert (mapping.pp, mapping.stages, mapping.micro_batches) == (2, ((0, 1), (1, 2)), 2)
    assert mapping.world_size == 2 and len(manifest.parallel.ranks) == 4

    # stopping after the legalization keeps the uncut rank graphs; cut by hand, they are
    # byte for byte the stage graphs of the artifact (rank folder g: stage g // 2 of rank g % 2)
    stopped = compile_model(MODEL, "cuda", CompileOptions(tp=2, pp=2, stop_after="legalize-cuda",
                                                          out=tmp_path / "s"))
    assert "not run: pipeline-stages{pp=2}" in stopped.stopped
    legal = [load_graph(tmp_path / "s" / f"rank{r}") for r in range(2)]
    assert all(stage_info(g.metadata) is None for g in legal)
    by_hand, _ = pipeline_ranks(legal, 2)
    assert _texts(by_hand) == [(tmp_path / "a" / f"rank{g}" / "graph.ir").read_text() for g in range(4)]

    # without the cut: the tensor-parallel artifact alone
    uncut = compile_model(MODEL, "cuda", CompileOptions(tp=2, pp=2, disabled_passes=("pipeline-stages",),
                                                        out=tmp_path / "u"))
    layout = read_manifest(uncut.out).parallel
    assert len(layout.ranks) == 2 and "pp" not in layout.mapping
    assert not (tmp_path / "u" / "rank2").exists()


def test_compile_refuses_the_cut_in_its_pipeline(tmp_path: Path) -> None:
    with pytest.raises(ErnieIRError, match=r"--pipeline holds pipeline-stages\{pp=2\}: .* give --pp"):
        compile_model(MODEL, "cuda", CompileOptions(pipeline="dce,pipeline-stages{pp=2}", out=tmp_path / "x"))
    assert not any(tmp_path.iterdir())
