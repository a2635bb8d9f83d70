"""A failing or stuck rank: one clear error line, the tail of its log, and no process left.

The broken artifact is consistent for `verify` (its manifest lists rank 1's files with their
real sha256) but rank 1's files are rank 0's: rank 1 refuses them after starting, while
rank 0 is already waiting for it in the rendezvous, so the launcher must stop rank 0 too.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from _dist_testkit import IDS, compile_art, leftover_processes

from ernie_ir.backends.paddle.launch import DistributedRunError
from ernie_ir.backends.sessions import run_artifact
from ernie_ir.cli.app import main
from ernie_ir.targets import verify_artifact


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_art(tmp_path_factory.mktemp("gloo-failures"), "gpt-345m@tiny", "gpt", tp=2)


@pytest.fixture
def broken(art: Path, tmp_path: Path) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(art, out)
    manifest = json.loads((out / "manifest.json").read_text())
    for name in ("graph.ir", "weights.safetensors"):
        shutil.copy(out / "rank0" / name, out / "rank1" / name)
        digest = hashlib.sha256((out / "rank1" / name).read_bytes()).hexdigest()
        manifest["files"][f"rank1/{name}"] = manifest["rank_files"]["rank1"][name] = digest
    (out / "manifest.json").write_text(json.dumps(manifest))
    verify_artifact(out)
    return out


def _workdirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("ernie-ir-dist-*")}


def test_failing_rank_one_line_log_tail_no_processes(broken: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    before = _workdirs()
    with pytest.raises(SystemExit) as done:
        main(["run", str(broken), "--tokens", "1,2,3", "--backend", "paddle", "--timeout", "120"])
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0] == f"error: rank 1 of 2 failed: artifact {broken}: rank1/graph.ir is not rank 1's graph"
    assert "Traceback" not in err
    assert any("rank1/graph.ir is not rank 1's graph" in line for line in lines[1:])  # the log's tail
    assert not leftover_processes()
    assert _workdirs() <= before  # the logs' temp folder is gone


def test_timeout_stops_every_rank(art: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"^the 2 ranks did not finish within 1 s: stopped them"):
        run_artifact(art, IDS, "paddle", timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    assert not leftover_processes()
