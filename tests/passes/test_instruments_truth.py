"""Instruments tell the truth, and pipelines can be bisected.

- `--timing` / `TimingInstrument`: a pass's time is the pass alone; verification (and the
  debug "changed" check) and what instruments spend printing or dumping are reported apart.
- `--print-after P` says so when P left the graph unchanged (instead of printing nothing).
- `--dump-dir` starts from an empty folder, or refuses a non-empty one (one line, exit 2).
- `--disable-pass NAME` (repeatable) and `--stop-after NAME|N` on every command that runs a
  pipeline, and `disabled_passes` / `stop_after` on `PassManager` and `run_pipeline`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _passes_testkit import assert_ir, cli, ir, one_error_line, registered

from ernie_ir.ir import Graph
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.passes import (
    DumpInstrument,
    PassContext,
    PassInstrument,
    PassManager,
    PassOptions,
    PipelineError,
    PrintIRInstrument,
    TimingInstrument,
    function_pass,
    load_pipeline,
    run_pipeline,
)
from ernie_ir.passes.infra import manager as manager_module
from ernie_ir.passes.infra.instruments import InstrumentError

PASS_SLEEP = 0.05
PRINT_SLEEP = 0.15
VERIFY_SLEEP = 0.1


@function_pass("t-slow", "Sleeps, then tags the graph (a pass whose cost is known).")
def slow(graph: Graph, options: PassOptions, ctx: PassContext) -> bool:
    time.sleep(PASS_SLEEP)
    graph.metadata["slow"] = graph.metadata.get("slow", 0) + 1
    return True


@function_pass("t-produce", "Establishes `t.made`.", produces=("t.made",))
def produce(graph: Graph, options: PassOptions, ctx: PassContext) -> bool:
    return False


@function_pass("t-consume", "Needs `t.made`.", requires=("t.made",))
def consume(graph: Graph, options: PassOptions, ctx: PassContext) -> bool:
    return False


@pytest.fixture(autouse=True)
def test_passes() -> Iterator[None]:
    with registered(slow, produce, consume):
        yield


GRAPH = """
graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {
  %0 = silu(%x) : f32[B,4] loc("act")
  %1 = silu(%x) : f32[B,4] loc("act2")
  %2 = reshape(%0) {shape = [0, 2, 2]} : f32[B,2,2]
  %3 = reshape(%2) {shape = [0, 4]} : f32[B,4]
  %4 = add(%3, %1) : f32[B,4]
  return %4
}
"""


class SlowPrinter(PassInstrument):
    """An instrument as costly as printing a big graph, before and after every pass."""

    def before_pass(self, index, p, graph) -> None:
        time.sleep(PRINT_SLEEP)

    def after_pass(self, index, p, graph, changed, ctx) -> None:
        time.sleep(PRINT_SLEEP)


# -- timing ------------------------------------------------------------------------------------


def test_timing_measures_the_pass_alone(monkeypatch: pytest.MonkeyPatch):
    real_verify = manager_module.verify_problems

    def slow_verify(graph: Graph) -> list[str]:
        time.sleep(VERIFY_SLEEP)
        return real_verify(graph)

    monkeypatch.setattr(manager_module, "verify_problems", slow_verify)
    # The slow printer runs before and after the timer, in either order of the instruments.
    for order in ("printer first", "timer first"):
        timing = TimingInstrument()
        instruments = [SlowPrinter(), timing] if order == "printer first" else [timing, SlowPrinter()]
        run_pipeline(ir(GRAPH), "t-slow", instruments=instruments)
        (row,) = timing.rows
        assert PASS_SLEEP <= row.seconds < PASS_SLEEP + 0.09, (order, row)
        assert VERIFY_SLEEP <= row.verify_seconds < VERIFY_SLEEP + 0.09, (order, row)
        assert 2 * PRINT_SLEEP <= row.instrument_seconds < 2 * PRINT_SLEEP + 0.09, (order, row)
        assert timing.total == row.seconds
        assert (timing.total_verify, timing.total_instruments) == (row.verify_seconds,
                                                                   row.instrument_seconds)


def test_show_timing_reports_pass_verify_and_print_time_apart(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]):
    monkeypatch.chdir(tmp_path)
    Path("model.ir").write_text(GRAPH, encoding="utf-8")
    code, _, err = cli(capsys, "show", "model.ir", "--pipeline", "O1,t-slow", "--timing",
                       "--print-after", "*", "--print-before", "*")
    assert code == 0
    header = next(line for line in err.splitlines() if "pass ms" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]] == [
        "#", "pass", "pass ms", "verify ms", "print ms", "changed", "rewrites"]
    rows = {line.split("│")[2].strip(): [c.strip() for c in line.split("│")[3:-1]]
            for line in err.splitlines() if line.count("│") == 8}
    assert list(rows) == ["canonicalize", "cse", "dce", "t-slow", "total"]
    assert PASS_SLEEP * 1e3 <= float(rows["t-slow"][0]) < (PASS_SLEEP + 0.09) * 1e3
    assert float(rows["t-slow"][2]) > 0  # printing the IR before and after it
    total = rows["total"]
    for col in range(3):
        parts = sum(float(r[col]) for name, r in rows.items() if name != "total")
        assert float(total[col]) == pytest.approx(parts, abs=0.006 * len(rows))  # rounded cells


# -- printing ----------------------------------------------------------------------------------


def test_print_after_says_when_the_pass_left_the_graph_unchanged():
    printed: list[str] = []
    run_pipeline(ir(GRAPH), "cse,dce,cse", instruments=[PrintIRInstrument(printed.append,
                                                                          after=["cse", "dce"])])
    assert [text.split("\n", 1)[0] for text in printed] == [
        "// ----- IR after cse (pass 1) -----",
        "// ----- dce (pass 2) left the IR unchanged -----",
        "// ----- cse (pass 3) left the IR unchanged -----",
    ]
    assert printed[1].count("\n") == 0  # the IR is not printed again


def test_show_print_after_an_unchanging_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]):
    monkeypatch.chdir(tmp_path)
    Path("model.ir").write_text(GRAPH, encoding="utf-8")
    code, out, err = cli(capsys, "show", "model.ir", "--pipeline", "dce", "--print-after", "dce")
    assert code == 0
    assert err == "// ----- dce (pass 1) left the IR unchanged -----\n"
    assert_ir(parse_graph(out), ir(GRAPH))


# -- dumps -------------------------------------------------------------------------------------


def test_a_dump_folder_must_be_new_or_empty(tmp_path: Path):
    empty = tmp_path / "empty"
    empty.mkdir()
    dump = DumpInstrument(empty)
    run_pipeline(ir(GRAPH), "cse", instruments=[dump])
    assert sorted(p.name for p in empty.iterdir()) == ["000-input.ir", "001-cse.ir"]
    with pytest.raises(InstrumentError, match=r"dump folder .*empty is not empty \(2 entries, e\.g\. "
                                              r"000-input\.ir\): choose a new or empty folder"):
        DumpInstrument(empty)
    a_file = tmp_path / "file"
    a_file.write_text("x", encoding="utf-8")
    with pytest.raises(InstrumentError, match=r"is a file, not a folder"):
        DumpInstrument(a_file)


def test_show_refuses_a_non_empty_dump_dir_before_running(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]):
    monkeypatch.chdir(tmp_path)
    Path("model.ir").write_text(GRAPH, encoding="utf-8")
    Path("dumps").mkdir()
    Path("dumps/old-notes.txt").write_text("mine", encoding="utf-8")
    code, out, err = cli(capsys, "show", "model.ir", "--pipeline", "O1", "--dump-dir", "dumps")
    assert code == 2 and out == ""
    assert one_error_line(err).startswith("error: dump folder dumps is not empty (1 entry, e.g. "
                                          "old-notes.txt): choose a new or empty folder")
    assert [p.name for p in Path("dumps").iterdir()] == ["old-notes.txt"]
    code, _, _ = cli(capsys, "show", "model.ir", "--pipeline", "O1", "--dump-dir", "new/dumps")
    assert code == 0 and len(list(Path("new/dumps").iterdir())) == 4


# -- bisecting: the library ----------------------------------------------------------------------


def test_disabled_passes_and_stop_after_in_the_library():
    full = load_pipeline("canonicalize,cse,dce,t-slow")
    g = ir(GRAPH)
    result = PassManager(full, disabled_passes=["cse", "t-slow"]).run(g)
    assert result.changed_by == ["canonicalize"]
    want = ir(GRAPH)
    run_pipeline(want, "canonicalize,dce")
    assert_ir(g, want)

    g = ir(GRAPH)
    result = run_pipeline(g, full, stop_after="cse")
    assert result.changed_by == ["canonicalize", "cse"] and "slow" not in g.metadata
    g2 = ir(GRAPH)
    run_pipeline(g2, full, stop_after=2)  # a 1-based position does the same
    assert print_graph(g2) == print_graph(g)

    kept = full.restricted(disabled=["dce"], stop_after="t-slow")
    assert str(kept) == "canonicalize,cse,t-slow" and str(full) == "canonicalize,cse,dce,t-slow"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"disabled_passes": ["fuse-qkv"]},
     r"^cannot disable pass 'fuse-qkv': it is not in the pipeline \(canonicalize, cse, t-produce, "
     r"t-consume\)$"),
    ({"stop_after": "dce"},
     r"^cannot stop after pass 'dce': it is not in the pipeline \(canonicalize, cse, t-produce, "
     r"t-consume\)$"),
    ({"stop_after": 5}, r"^cannot stop after pass 5: the pipeline has 4 passes$"),
    ({"stop_after": "cse", "disabled_passes": ["cse"]}, r"^cannot stop after pass 'cse': it is disabled$"),
    ({"disabled_passes": ["t-produce"]},
     r"^pass t-consume \(position 3\) requires t.made, which no earlier pass produces; run "
     r"t-produce before it$"),
])
def test_bisecting_mistakes_are_refused_before_any_pass_runs(kwargs: dict, message: str):
    g = ir(GRAPH)
    before = print_graph(g)
    with pytest.raises(PipelineError, match=message):
        run_pipeline(g, "canonicalize,cse,t-produce,t-consume", **kwargs)
    assert print_graph(g) == before


# -- bisecting: the CLI ------------------------------------------------------------------------


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    Path("model.ir").write_text(GRAPH, encoding="utf-8")
    return "model.ir"


def _show(capsys, *argv: str) -> tuple[int, str, str]:
    return cli(capsys, "show", "model.ir", *argv)


def test_show_disable_pass_and_stop_after(model: str, capsys: pytest.CaptureFixture[str]):
    _, reference, _ = _show(capsys, "--pipeline", "canonicalize,dce")
    code, out, err = _show(capsys, "--pipeline", "O1,t-slow", "--disable-pass", "cse",
                           "--disable-pass", "t-slow")
    assert (code, out) == (0, reference)
    assert err == "note: disabled cse (pass 2), t-slow (pass 4); ran canonicalize,dce\n"
    code, out2, _ = _show(capsys, "--pipeline", "O1,t-slow", "--disable-pass", "cse,t-slow")
    assert (code, out2) == (0, reference)

    _, reference, _ = _show(capsys, "--pipeline", "canonicalize,cse")
    for where in ("cse", "2"):
        code, out, err = _show(capsys, "--pipeline", "O1,t-slow", "--stop-after", where)
        assert (code, out) == (0, reference)
        assert err == "note: stopped after cse (pass 2 of 4); not run: dce, t-slow\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--pipeline", "O1", "--disable-pass", "fuse-qkv"],
     "error: cannot disable pass 'fuse-qkv': it is not in the pipeline (canonicalize, cse, dce)"),
    (["--pipeline", "O1", "--stop-after", "9"], "error: cannot stop after pass 9: the pipeline has 3 "
                                               "passes"),
    (["--stop-after", "cse"], "error: --print-before/--print-after/--dump-dir/--timing/"
                              "--disable-pass/--stop-after need --pipeline"),
])
def test_show_bisecting_errors_are_one_line(model: str, capsys: pytest.CaptureFixture[str],
                                            argv: list[str], message: str):
    code, out, err = _show(capsys, *argv)
    assert code == 2 and out == ""
    assert one_error_line(err) == message


def test_run_stop_after_runs_the_graph_as_it_was_after_that_pass(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]):
    monkeypatch.chdir(tmp_path)
    base = ["run", "gpt-345m@tiny", "--tokens", "1,2,3", "--json", "--save-logits"]
    cli(capsys, *base, "float.npy")
    cli(capsys, *base, "wint4.npy", "--quant", "wint4")
    code, out, err = cli(capsys, *base, "stopped.npy", "--quant", "wint4", "--stop-after",
                         "quant-annotate")
    assert code == 0, err
    assert json.loads(out)["saved"] == "stopped.npy"
    assert "note: stopped after quant-annotate{preset=wint4} (pass 1 of 2)" in err
    # Annotating does not change the numbers; the convert pass it stopped before does.
    assert np.array_equal(np.load("stopped.npy"), np.load("float.npy"))
    assert not np.array_equal(np.load("wint4.npy"), np.load("float.npy"))
    code, _, err = cli(capsys, *base, "disabled.npy", "--quant", "wint4", "--disable-pass",
                       "weight-only-quant")
    assert code == 0, err
    assert np.array_equal(np.load("disabled.npy"), np.load("float.npy"))


def test_explain_with_the_fusing_pass_disabled(capsys: pytest.CaptureFixture[str]):
    argv = ["explain", "fuse-qkv", "ernie-4.5-0.3b@tiny", "--pipeline", "unfuse-qkv,fuse-qkv"]
    code, out, _ = cli(capsys, *argv)
    assert code == 0 and out.startswith("fuse-qkv: 0 match(es)")
    for bisect in (["--disable-pass", "fuse-qkv"], ["--stop-after", "unfuse-qkv"]):
        code, out, err = cli(capsys, *argv, *bisect)
        assert code == 0, err
        assert out.startswith("fuse-qkv: 2 match(es)")


def test_compile_disable_pass_is_recorded_and_stop_after_writes_the_graph_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "compile", "gpt-345m@tiny", "--target", "ascend", "--pipeline", "O1",
                         "--disable-pass", "cse", "--out", "art", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["pipeline"] == "canonicalize,dce,legalize-ascend"
    manifest = json.loads(Path("art/manifest.json").read_text(encoding="utf-8"))
    assert manifest["pipeline"] == "canonicalize,dce,legalize-ascend"

    code, out, err = cli(capsys, "compile", "gpt-345m@tiny", "--target", "ascend", "--quant", "wint8",
                         "--stop-after", "weight-only-quant", "--out", "stopped")
    assert code == 0, err
    assert "stopped after weight-only-quant (pass 2 of 3); not run: legalize-ascend" in out
    assert not Path("stopped/manifest.json").exists()  # a graph folder, not an artifact
    _, shown, _ = cli(capsys, "show", "stopped")
    _, expected, _ = cli(capsys, "show", "gpt-345m@tiny", "--quant", "wint8")
    assert shown == expected

    code, out, err = cli(capsys, "compile", "gpt-345m@tiny", "--target", "ascend", "--stop-after",
                         "nope", "--out", "never")
    assert code == 2 and not Path("never").exists()
    assert one_error_line(err) == ("error: cannot stop after pass 'nope': it is not in the pipeline "
                                   "(legalize-ascend)")
