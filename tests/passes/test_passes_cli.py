"""The pass-related CLI: `ernie-ir show --pipeline ...` with its instruments, `ernie-ir explain`,
`ernie-ir passes`, and bad input (one line on stderr, exit code 2, no traceback).

Commands run in process through `ernie_ir.cli.app.main`, the console script's
entry point; one test runs the installed script to check the same contract
end to end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _passes_testkit import ERNIE_IR, assert_ir, cli, ir, one_error_line, run_tool

from ernie_ir.ir.parser import parse_graph

MODEL = """\
graph @g(%x: f32[B,4]) -> (y: f32[B,8], z: f32[B,8]) {
  param @w : f32[4,8]
  param @w2 : f32[4,8]
  param @b : f32[8]
  param @b2 : f32[1,8]
  %0 = reshape(%x) {shape = [0, 2, 2]} : f32[B,2,2]
  %1 = reshape(%0) {shape = [0, 4]} : f32[B,4]
  %2 = silu(%1) : f32[B,4] loc("act")
  %3 = silu(%x) : f32[B,4] loc("act2")
  %4 = linear(%2, @w) : f32[B,8] loc("proj")
  %5 = add(%4, @b) : f32[B,8] loc("proj")
  %6 = linear(%3, @w2) : f32[B,8] loc("other")
  %7 = add(%6, @b2) : f32[B,8] loc("other")
  return %5, %7
}
"""

AFTER_O1 = """\
graph @g(%x: f32[B,4]) -> (y: f32[B,8], z: f32[B,8]) {
  param @w : f32[4,8]
  param @w2 : f32[4,8]
  param @b : f32[8]
  param @b2 : f32[1,8]
  %0 = silu(%x) : f32[B,4] loc("act")
  %1 = linear(%0, @w) : f32[B,8] loc("proj")
  %2 = add(%1, @b) : f32[B,8] loc("proj")
  %3 = linear(%0, @w2) : f32[B,8] loc("other")
  %4 = add(%3, @b2) : f32[B,8] loc("other")
  return %2, %4
}
"""


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    Path("model.ir").write_text(MODEL, encoding="utf-8")
    return "model.ir"


def test_show_prints_the_ir_after_the_pipeline(model: str, capsys: pytest.CaptureFixture[str]):
    code, out, err = cli(capsys, "show", model, "--pipeline", "O1")
    assert (code, err) == (0, "")
    assert_ir(parse_graph(out), AFTER_O1)


def test_show_with_timing_print_after_and_dumps(model: str, capsys: pytest.CaptureFixture[str]):
    code, out, err = cli(capsys, "show", model, "--pipeline", "O1,fuse-linear-bias", "--timing",
                         "--print-after", "cse", "--dump-dir", "dumps")
    assert code == 0
    final = parse_graph(out)
    assert [n.op for n in final] == ["silu", "linear", "linear", "add"]

    # --print-after cse: the IR after cse, which changed the graph (the two silus merged).
    block = err.split("// ----- IR after cse (pass 2) -----\n", 1)[1]
    after_cse = block[: block.index("}\n") + 2]
    assert_ir(parse_graph(after_cse), AFTER_O1)
    assert "IR after canonicalize" not in err and "IR after dce" not in err

    # --timing: one row per pass, with its rewrite counts, and a total.
    assert "pipeline canonicalize,cse,dce,fuse-linear-bias" in err
    rows = {line.split("│")[2].strip(): [c.strip() for c in line.split("│")[3:-1]]
            for line in err.splitlines() if line.count("│") == 8}
    assert list(rows) == ["canonicalize", "cse", "dce", "fuse-linear-bias", "total"]
    assert rows["canonicalize"][3:] == ["yes", "fold-reshape-chain=1, identity-reshape=1"]
    assert rows["cse"][3:] == ["yes", "merged=1"]
    assert rows["dce"][3:] == ["no", ""]
    assert rows["fuse-linear-bias"][3:] == ["yes", "fuse-linear-bias=1"]
    assert all(float(c) >= 0 for r in rows.values() for c in r[:3])

    # --dump-dir: every step, the last one equal to what was printed.
    dumps = sorted(Path("dumps").iterdir())
    assert [p.name for p in dumps] == ["000-input.ir", "001-canonicalize.ir", "002-cse.ir",
                                       "003-dce.ir", "004-fuse-linear-bias.ir"]
    assert_ir(parse_graph(dumps[-1].read_text(encoding="utf-8")), final)
    assert_ir(parse_graph(dumps[0].read_text(encoding="utf-8")), ir(MODEL))
    assert dumps[2].read_text(encoding="utf-8").split("\n")[2] == (
        "// replay from this step: ernie-ir show dumps/002-cse.ir --pipeline dce,fuse-linear-bias")


def test_show_print_before_and_a_yaml_pipeline(model: str, capsys: pytest.CaptureFixture[str]):
    Path("p.yaml").write_text("pipeline:\n  - canonicalize\n  - dce\n", encoding="utf-8")
    code, out, err = cli(capsys, "show", model, "--pipeline", "p.yaml", "--print-before",
                         "canonicalize,dce")
    assert code == 0
    assert err.startswith("// ----- IR before canonicalize (pass 1) -----\n")
    assert_ir(parse_graph(err.split("-----\n", 1)[1]), ir(MODEL))
    assert "IR before dce" not in err  # dce found nothing to remove
    assert [n.op for n in parse_graph(out)] == ["silu", "silu", "linear", "add", "linear", "add"]


def test_explain_prints_matches_and_the_best_near_miss(model: str, capsys: pytest.CaptureFixture[str]):
    code, out, err = cli(capsys, "explain", "fuse-linear-bias", model)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "fuse-linear-bias: 1 match(es) among 2 candidate node(s)",
        "  match: add at proj (2 nodes)",
    ]
    code, out, _ = cli(capsys, "explain", "fuse-linear-bias", model, "--pipeline", "fuse-linear-bias")
    assert code == 0
    assert out.splitlines() == [
        "fuse-linear-bias: 0 match(es) among 1 candidate node(s); best partial match at add at other: "
        "2/2 pattern nodes, failed because variable b must have rank 1, found f32[1,8]",
    ]


def test_explain_a_rule_whose_root_op_is_absent(model: str, capsys: pytest.CaptureFixture[str]):
    code, out, _ = cli(capsys, "explain", "identity-cast", model)
    assert code == 0
    assert out.strip() == ("identity-cast: 0 match(es) among 0 candidate node(s) (no node has the "
                           "pattern's root op)")


def test_ernie_ir_passes_lists_passes_options_and_presets(capsys: pytest.CaptureFixture[str]):
    code, out, err = cli(capsys, "passes")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    for name in ("canonicalize", "cse", "dce", "fuse-linear-bias"):
        assert name in lines
    i = lines.index("fuse-linear-bias")
    assert lines[i + 1] == "    Fold add(linear(x, W), b) into linear(x, W, b)."
    assert "lora{rank=<int>,alpha=none,targets=none,rslora=false,dropout=0.0,seed=0,dtype=f32," \
           "freeze_base=true}" in lines
    assert "O1 = canonicalize,cse,dce" in lines


@pytest.mark.parametrize(("argv", "message"), [
    (["show", "model.ir", "--pipeline", "csee"],
     "error: position 1: unknown pass 'csee' (did you mean cse?); `ernie-ir passes` lists them"),
    (["show", "model.ir", "--pipeline", "dce{aggressive=1}"],
     "error: position 1: pass dce: bad option (aggressive: Extra inputs are not permitted); valid "
     "options: none"),
    (["show", "model.ir", "--pipeline", "dce,{cse}"],
     "error: pipeline 'dce,{cse}': expected a pass name at character 5"),
    (["show", "model.ir", "--pipeline", "bad.yaml"],
     "error: bad.yaml: invalid YAML at line 2, column 11: mapping values are not allowed here"),
    (["show", "model.ir", "--pipeline", "missing.yaml"],
     "error: pipeline file missing.yaml does not exist"),
    (["show", "model.ir", "--pipeline", "O1{level=2}"],
     "error: preset O1 (position 1) takes no options; its pipeline is canonicalize,cse,dce"),
    (["show", "model.ir", "--pipeline", "dce", "--print-after", "cse"],
     "error: --print-before/--print-after: pass 'cse' is not in the pipeline (dce)"),
    (["show", "model.ir", "--timing"],
     "error: --print-before/--print-after/--dump-dir/--timing/--disable-pass/--stop-after need "
     "--pipeline"),
    (["explain", "fuse-linear-bais", "model.ir"],
     "error: unknown rewrite rule 'fuse-linear-bais' (did you mean fuse-linear-bias?); known rules: "),
    (["show", "broken.ir"], "error: broken.ir:2:8: unknown op 'nosuchop'"),
])
def test_bad_input_is_one_line_and_exit_code_2(model: str, capsys: pytest.CaptureFixture[str],
                                               argv: list[str], message: str):
    Path("bad.yaml").write_text("pipeline:\n  - dce: x: y\n", encoding="utf-8")
    Path("broken.ir").write_text("graph @g() -> () {\n  %0 = nosuchop() : f32[1]\n}\n", encoding="utf-8")
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == ""
    assert one_error_line(err).startswith(message)


@pytest.mark.slow
def test_the_installed_script_reports_bad_input_without_a_traceback(model: str):
    run = run_tool(ERNIE_IR, "show", model, "--pipeline", "canonicalize,dce{x=[1,}")
    assert run.returncode == 2 and run.stdout == ""
    assert one_error_line(run.stderr) == (
        "error: pipeline 'canonicalize,dce{x=[1,}': expected a value, found '}' at character 23")
