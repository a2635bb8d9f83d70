"""Goldens pin values, not only structure.

A golden file records a content hash per param (`param @w : f32[4,8] hash "..."`), so a
rewrite that builds the right graph from the wrong numbers (q/k/v weights concatenated in
the wrong order) fails its golden. Structure-only comparison stays available, explicitly:
`// compare: structure` in a golden's header, `ernie-ir golden check --structure-only`,
`pytest --golden-structure-only`, `golden.check(..., structure_only=True)`. Params whose
values are not portable (calibrated on float activations, so they depend on the BLAS
kernel) are named in the header (`// no-hash: *.input_scale`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ernie_ir.ir import DType, ErnieIRError
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.weights import GeneratedSource, content_hash
from ernie_ir.passes.fusion import column_row_fusion
from ernie_ir.runtime import Interpreter
from ernie_ir.testing import GoldenCase, check_goldens
from ernie_ir.testing.golden import find_goldens

ROOT = Path(__file__).resolve().parents[2]
GOLDENS = ROOT / "tests" / "golden"
FUSED = "ernie.layers.0.self_attn.qkv_proj.weight"


def _qkv_case(folder: Path) -> GoldenCase:
    """ERNIE-4.5's fused q|k|v cut apart and fused again: the same weights if done right."""
    return GoldenCase.new(folder / "qkv.ir", input="ernie-4.5-0.3b@tiny", pipeline="unfuse-qkv,fuse-qkv")


def _k_before_q(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug: a fusion that concatenates [K|Q|V] where the graph reads [Q|K|V]."""
    real = column_row_fusion.concat_view

    def wrong(parts, axis):
        parts = list(parts)
        if len(parts) == 3:
            parts[0], parts[1] = parts[1], parts[0]
        return real(parts, axis)

    monkeypatch.setattr(column_row_fusion, "concat_view", wrong)


def _logits(graph) -> np.ndarray:
    ids = np.array([[1, 5, 9, 2]], dtype=np.int64)
    return Interpreter(graph).run({"input_ids": ids})[graph.output_names[0]]


def test_a_wrong_order_concat_fails_its_golden_by_hash(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch):
    case = _qkv_case(tmp_path)
    good = case.compute()
    case.write(good)
    text = case.path.read_text(encoding="utf-8")
    assert f'param @{FUSED} : bf16[64,160] hash "' in text
    assert GoldenCase.read(case.path).check().ok

    _k_before_q(monkeypatch)
    bad = case.compute()
    assert not np.allclose(_logits(bad), _logits(good))  # the bug is real
    result = GoldenCase.read(case.path).check(bad)
    assert not result.ok
    assert result.reason.startswith(f"param @{FUSED}: values differ (hash ")
    want = content_hash(good.params[FUSED].read())
    assert result.reason.endswith(f", golden {want})")
    assert f'-  param @{FUSED} : bf16[64,160] hash "{want}"' in result.diff
    # What the comparison used to be: structure alone passes the wrong graph.
    assert GoldenCase.read(case.path).check(bad, structure_only=True).ok


def test_update_records_the_hashes_of_a_golden_written_without_them(tmp_path: Path):
    case = _qkv_case(tmp_path)
    graph = case.compute()
    case.write(graph)
    hashed = case.path.read_text(encoding="utf-8")
    case.path.write_text("\n".join(line.split(" hash ")[0] for line in hashed.split("\n")),
                         encoding="utf-8")
    result = GoldenCase.read(case.path).check()
    assert not result.ok
    assert result.reason.startswith("param @ernie.embed_tokens.weight: the golden records no hash")
    (updated,) = check_goldens([case.path], update=True)
    assert updated.updated and case.path.read_text(encoding="utf-8") == hashed


def test_structure_only_is_an_explicit_choice_in_the_header(tmp_path: Path):
    case = GoldenCase.new(tmp_path / "s.ir", input="ernie-4.5-0.3b@tiny", pipeline="O1",
                          compare="structure")
    case.write(case.compute())
    text = case.path.read_text(encoding="utf-8")
    assert text.startswith("// golden case\n// input: ernie-4.5-0.3b@tiny\n// pipeline: O1\n"
                           "// compare: structure\n")
    assert " hash " not in text
    assert GoldenCase.read(case.path).check().ok
    (tmp_path / "bad.ir").write_text(text.replace("compare: structure", "compare: vibes"),
                                     encoding="utf-8")
    with pytest.raises(ErnieIRError, match=r"bad\.ir: '// compare: vibes': give 'values' \(the default"):
        GoldenCase.read(tmp_path / "bad.ir")


def test_no_hash_params_are_compared_by_structure_only(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch):
    case = _qkv_case(tmp_path)
    case.no_hash = ("*.qkv_proj.weight",)
    case.write(case.compute())
    text = case.path.read_text(encoding="utf-8")
    assert "// no-hash: *.qkv_proj.weight\n" in text
    assert f'param @{FUSED} : bf16[64,160]\n' in text
    assert 'o_proj.weight : bf16[128,64] hash "' in text
    _k_before_q(monkeypatch)
    assert GoldenCase.read(case.path).check().ok  # exempt, so the swap goes unseen: use sparingly


def test_hashes_are_pinned_values():
    """The tiny models' weights are numpy PCG64 draws: the same bits on every machine. These
    literals fail if a numpy, a platform or a change to GeneratedSource moves a bit."""
    assert content_hash(GeneratedSource(DType.F32, [64, 64], seed=7).read()) == "6891324ddb5be6ac"
    assert content_hash(GeneratedSource(DType.BF16, [64, 64], seed=7).read()) == "96529626d29f6927"


def _golden_texts(env: dict[str, str], *paths: Path) -> str:
    script = ("import sys\nfrom ernie_ir.testing.golden import GoldenCase\n"
              "for p in sys.argv[1:]:\n"
              "    c = GoldenCase.read(p)\n"
              "    sys.stdout.write(c.render(c.compute()))\n")
    run = subprocess.run([sys.executable, "-c", script, *map(str, paths)], capture_output=True,
                         text=True, env={**os.environ, **env}, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.slow
def test_golden_text_is_the_same_under_other_hash_seeds_threads_and_blas_kernels():
    """What differs between machines, emulated here: Python's hash seed, BLAS threads and the
    BLAS kernel (OpenBLAS picks one per CPU; SSE3 vs AVX2 sum in different orders), and
    numpy's own SIMD loops. The fp8 golden's calibrated scales are the ones that move; its
    header exempts them, so its text is the same too."""
    paths = [GOLDENS / "quant" / "ernie21b_wint8mix_lora.ir", GOLDENS / "quant" / "gpt345m_fp8.ir",
             GOLDENS / "parallel" / "ernie-4.5-21b-a3b-tiny-tp2-ep2.ir"]
    base = _golden_texts({"PYTHONHASHSEED": "0"}, *paths)
    assert base.count(' hash "') > 100
    for env in ({"PYTHONHASHSEED": "12345", "OPENBLAS_NUM_THREADS": "1"},
                {"OPENBLAS_CORETYPE": "Prescott", "NPY_DISABLE_CPU_FEATURES": "AVX512F AVX512_SKX"},
                {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "2"}):
        assert _golden_texts(env, *paths) == base, env


@pytest.mark.slow
def test_every_golden_records_the_values_of_every_param_with_data():
    checked = 0
    for path in find_goldens([GOLDENS]):
        case = GoldenCase.read(path)
        assert case.compare == "values", path
        recorded = parse_graph(case.expected, source=str(path), check_types=False).params
        actual = case.compute()
        with_data = [name for name, p in actual.params.items() if p.source is not None]
        missing = [name for name in with_data if recorded[name].digest is None and not case.exempt(name)]
        assert not missing, f"{path}: no hash for {missing[:3]}"
        checked += bool(with_data)
    assert checked >= 35  # all but the meta model and the weightless parallel-block inputs


def _tampered(folder: Path) -> Path:
    """A golden whose recorded values are not the model's: one hash changed."""
    case = GoldenCase.new(folder / "tampered.ir", input="ernie-4.5-0.3b@tiny")
    case.write(case.compute())
    text = case.path.read_text(encoding="utf-8")
    line = next(line for line in text.split("\n") if f"@{FUSED} :" in line)
    case.path.write_text(text.replace(line, line[:-17] + '0123456789abcdef"'), encoding="utf-8")
    return case.path


def test_ernie_ir_golden_check_compares_values_unless_told_structure_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from ernie_ir.cli.app import main

    path = _tampered(tmp_path)

    def golden(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        try:
            main(["golden", *argv])
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
        return code, capsys.readouterr().out

    code, out = golden("check", str(path))
    assert code == 1
    assert f"FAIL     {path}: param @{FUSED}: values differ (hash " in out
    assert ", golden 0123456789abcdef)" in out
    code, out = golden("check", "--structure-only", str(path))
    assert code == 0 and out.rstrip().endswith("1 golden file(s), 0 failed")
    code, out = golden("update", str(path))
    assert code == 0 and "0123456789abcdef" not in path.read_text(encoding="utf-8")


@pytest.mark.slow
def test_pytest_golden_structure_only(tmp_path: Path):
    _tampered(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "ERNIE_IR_UPDATE_GOLDENS"}

    def pytest_run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args,
                               str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=300)

    run = pytest_run()
    assert run.returncode == 1 and f"param @{FUSED}: values differ" in run.stdout, run.stdout
    run = pytest_run("--golden-structure-only")
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout


def test_the_golden_fixture_compares_values_or_structure_only(golden, tmp_path: Path):
    from ernie_ir.load import load_input

    path = _tampered(tmp_path)
    graph = load_input("ernie-4.5-0.3b@tiny")
    golden.check(graph, path, structure_only=True)
    with pytest.raises(pytest.fail.Exception, match=r"values differ \(hash .*, golden 0123456789abcdef\)"):
        golden.check(graph, path)
