"""Golden-graph testing: GoldenCase, `ernie-ir golden check|update`, and the pytest plugin.

Inputs are small `.ir` files written by the tests, so these tests depend on
neither the frontends nor the project's own golden files.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
from _passes_testkit import cli, run_tool

from ernie_ir.ir import ErnieIRError
from ernie_ir.testing import GoldenCase, check_goldens, find_goldens

MODEL = """\
graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {
  %0 = reshape(%x) {shape = [0, 2, 2]} : f32[B,2,2]
  %1 = reshape(%0) {shape = [0, 4]} : f32[B,4]
  %2 = silu(%1) : f32[B,4] loc("act")
  %3 = silu(%1) : f32[B,4] loc("act2")
  %4 = add(%2, %3) : f32[B,4]
  return %4
}
"""

HEADER = "// golden case\n// input: model.ir\n// pipeline: O1\n"

EXPECTED = """\
graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {
  %0 = silu(%x) : f32[B,4] loc("act")
  %1 = add(%0, %0) : f32[B,4]
  return %1
}
"""

# The same graph with other value names: structurally equal.
RENAMED = """\
graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {
  %act = silu(%x) : f32[B,4] loc("act")
  %sum = add(%act, %act) : f32[B,4]
  return %sum
}
"""

WRONG = EXPECTED.replace('loc("act")', 'loc("elsewhere")')


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "model.ir").write_text(MODEL, encoding="utf-8")
    return tmp_path


def golden(folder: Path, name: str, body: str, header: str = HEADER) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + body, encoding="utf-8")
    return path


def test_write_then_check_round_trips(work: Path):
    case = GoldenCase.new(work / "goldens" / "o1.ir", input="../model.ir", pipeline="O1")
    case.write(case.compute())
    assert (work / "goldens" / "o1.ir").read_text(encoding="utf-8") == (
        "// golden case\n// input: ../model.ir\n// pipeline: O1\n" + EXPECTED)
    again = GoldenCase.read(work / "goldens" / "o1.ir")
    assert (again.input, again.pipeline, again.expected) == ("../model.ir", "O1", EXPECTED)
    result = again.check()
    assert (result.ok, result.diff, result.reason) == (True, "", "")


def test_comparison_is_structural_so_value_names_do_not_matter(work: Path):
    assert GoldenCase.read(golden(work, "renamed.ir", RENAMED)).check().ok


def test_a_mismatch_reports_the_difference_and_a_unified_diff(work: Path):
    path = golden(work, "wrong.ir", WRONG)
    result = GoldenCase.read(path).check()
    assert not result.ok
    assert result.reason == "node #0 (silu at act): scope 'act' vs 'elsewhere'"
    assert result.diff.splitlines() == [
        f"--- {path} (expected)",
        "+++ model.ir | O1 (actual)",
        "@@ -1,5 +1,5 @@",
        " graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {",
        '-  %0 = silu(%x) : f32[B,4] loc("elsewhere")',
        '+  %0 = silu(%x) : f32[B,4] loc("act")',
        "   %1 = add(%0, %0) : f32[B,4]",
        "   return %1",
        " }",
    ]


def test_the_diff_is_of_canonical_text_not_of_the_file_as_written(work: Path):
    path = golden(work, "renamed_wrong.ir", RENAMED.replace('loc("act")', 'loc("elsewhere")'))
    result = GoldenCase.read(path).check()
    assert not result.ok
    assert '-  %0 = silu(%x) : f32[B,4] loc("elsewhere")' in result.diff.splitlines()
    assert "%act" not in result.diff


@pytest.mark.parametrize(("text", "reason"), [
    (HEADER, "golden file has no IR yet"),
    (HEADER.rstrip("\n"), "golden file has no IR yet"),
    (HEADER + "graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {\n  return %zz\n}\n",
     "golden IR does not parse: "),
])
def test_a_golden_without_valid_ir_fails_with_a_reason(work: Path, text: str, reason: str):
    path = work / "broken.ir"
    path.write_text(text, encoding="utf-8")
    result = GoldenCase.read(path).check()
    assert not result.ok and result.reason.startswith(reason)


def test_reading_a_file_that_is_not_a_golden_case(work: Path):
    with pytest.raises(ErnieIRError, match=r"model\.ir: not a golden case \(first line must be "
                                           r"'// golden case'\)"):
        GoldenCase.read(work / "model.ir")
    path = golden(work, "no_input.ir", EXPECTED, header="// golden case\n// pipeline: O1\n")
    with pytest.raises(ErnieIRError, match=r"no_input\.ir: golden header needs an '// input: MODEL' "
                                           r"line"):
        GoldenCase.read(path)


def test_find_goldens_searches_folders_and_skips_other_ir_files(work: Path):
    a = golden(work, "a.ir", EXPECTED)
    b = golden(work, "sub/b.ir", EXPECTED, header=HEADER.replace("model.ir", "../model.ir"))
    golden(work, "sub/by_a_test.ir", EXPECTED, header=HEADER.replace("model.ir", "<test>"))
    assert find_goldens([work]) == [a, b]
    with pytest.raises(ErnieIRError, match=r"model\.ir: not a golden case"):
        find_goldens([work / "model.ir"])
    with pytest.raises(ErnieIRError, match=r"nope: no such file or folder"):
        find_goldens([work / "nope"])
    with pytest.raises(ErnieIRError, match=r"by_a_test\.ir: written by a test's `golden` fixture"):
        find_goldens([work / "sub" / "by_a_test.ir"])


def test_update_rewrites_only_the_failing_goldens(work: Path):
    good = golden(work, "good.ir", RENAMED)  # passes, though not in canonical form
    bad = golden(work, "bad.ir", WRONG)
    os.utime(good, ns=(1_000_000_000, 1_000_000_000))
    results = check_goldens([work], update=True)
    assert [(r.case.path.name, r.ok, r.updated) for r in results] == [
        ("bad.ir", False, True), ("good.ir", True, False)]
    assert bad.read_text(encoding="utf-8") == HEADER + EXPECTED
    assert good.read_text(encoding="utf-8") == HEADER + RENAMED
    assert good.stat().st_mtime_ns == 1_000_000_000
    assert all(r.ok for r in check_goldens([work]))


def test_ernie_ir_golden_check_and_update(work: Path, capsys: pytest.CaptureFixture[str]):
    good = golden(work, "good.ir", RENAMED)
    bad = golden(work, "bad.ir", WRONG)
    os.utime(good, ns=(1_000_000_000, 1_000_000_000))

    code, out, err = cli(capsys, "golden", "check", str(work))
    assert (code, err) == (1, "")
    assert f"FAIL     {bad}: node #0 (silu at act): scope 'act' vs 'elsewhere'" in out
    assert '+  %0 = silu(%x) : f32[B,4] loc("act")' in out
    assert f"ok       {good}" in out
    assert out.rstrip().endswith("2 golden file(s), 1 failed")
    assert bad.read_text(encoding="utf-8") == HEADER + WRONG  # check never writes

    code, out, err = cli(capsys, "golden", "update", str(work))
    assert (code, err) == (0, "")
    assert f"updated  {bad} (node #0 (silu at act): scope 'act' vs 'elsewhere')" in out
    assert out.rstrip().endswith("2 golden file(s), 0 failed, 1 updated")
    assert bad.read_text(encoding="utf-8") == HEADER + EXPECTED
    assert good.read_text(encoding="utf-8") == HEADER + RENAMED
    assert good.stat().st_mtime_ns == 1_000_000_000

    code, out, _ = cli(capsys, "golden", "check", str(bad), str(good))
    assert code == 0
    assert out.rstrip().endswith("2 golden file(s), 0 failed")


def test_ernie_ir_golden_errors_are_one_line(work: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(work)
    code, _, err = cli(capsys, "golden", "check")
    assert code == 2
    assert err.strip() == ("error: no PATHS given and ./tests/golden does not exist: name golden files "
                           "or folders, or run from the project root")
    code, _, err = cli(capsys, "golden", "check", "model.ir")
    assert code == 2
    assert err.strip() == "error: model.ir: not a golden case (first line must be '// golden case')"


# -- the pytest plugin -------------------------------------------------------------------------

FIXTURE_TEST = '''
from pathlib import Path

from ernie_ir.ir.parser import parse_graph
from ernie_ir.passes import run_pipeline

HERE = Path(__file__).parent


def test_with_the_golden_fixture(golden):
    graph = parse_graph((HERE / "model.ir").read_text())
    run_pipeline(graph, "O1")
    golden.check(graph, HERE / "goldens" / "from_fixture.ir")
'''


def pytest_in(folder: Path, *args: str, env: dict[str, str] | None = None):
    return run_tool(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", *args,
                    str(folder), env=env, cwd=folder)


@pytest.mark.slow
def test_the_pytest_plugin_checks_goldens_and_updates_them_on_request(work: Path):
    good = golden(work, "goldens/good.ir", RENAMED, header=HEADER.replace("model.ir", "../model.ir"))
    bad = golden(work, "goldens/bad.ir", WRONG, header=HEADER.replace("model.ir", "../model.ir"))
    (work / "test_fixture_user.py").write_text(textwrap.dedent(FIXTURE_TEST), encoding="utf-8")
    from_fixture = work / "goldens" / "from_fixture.ir"
    os.utime(good, ns=(1_000_000_000, 1_000_000_000))

    # 1. Plain run: the wrong golden fails with a diff; the fixture has nothing to compare with yet.
    run = pytest_in(work)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "2 failed, 1 passed" in run.stdout
    assert "node #0 (silu at act): scope 'act' vs 'elsewhere'" in run.stdout
    assert '+  %0 = silu(%x) : f32[B,4] loc("act")' in run.stdout
    assert "(run pytest --update-goldens or `ernie-ir golden update` to accept)" in run.stdout
    assert f"golden {from_fixture} differs: golden file has no IR yet" in run.stdout
    assert bad.read_text(encoding="utf-8").endswith(WRONG) and not from_fixture.exists()

    # 2. --update-goldens: failing goldens are rewritten, passing ones left alone.
    run = pytest_in(work, "--update-goldens")
    assert run.returncode == 0, run.stdout + run.stderr
    assert bad.read_text(encoding="utf-8").endswith(EXPECTED)
    assert from_fixture.read_text(encoding="utf-8") == (
        "// golden case\n// input: <test>\n// pipeline: \n" + EXPECTED)
    assert good.read_text(encoding="utf-8").endswith(RENAMED)
    assert good.stat().st_mtime_ns == 1_000_000_000

    # 3. ERNIE_IR_UPDATE_GOLDENS=1 does the same; afterwards a plain run passes. The golden the
    #    fixture wrote is checked by its test only (it is not collected as a golden case).
    bad.write_text(HEADER.replace("model.ir", "../model.ir") + WRONG, encoding="utf-8")
    from_fixture.write_text(from_fixture.read_text(encoding="utf-8").replace("add", "mul"),
                            encoding="utf-8")
    run = pytest_in(work, env={"ERNIE_IR_UPDATE_GOLDENS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert bad.read_text(encoding="utf-8").endswith(EXPECTED)
    assert from_fixture.read_text(encoding="utf-8").endswith(EXPECTED)

    run = pytest_in(work)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 passed" in run.stdout
