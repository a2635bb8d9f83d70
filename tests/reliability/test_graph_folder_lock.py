"""Graph-folder writers take the destination's lock, as an artifact write does (issue 24 item 6):
`save_graph` and `ernie-ir show --dump-dir` refuse at once, with one line naming the lock and its
holder's PID (exit 2 from the CLI), and write nothing while another process holds the lock.

The holder is a real process holding `artifact_lock`, the lock compile takes: both are
`ernie_ir.ir.storage.folder_lock`, one mechanism.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli_kit import user_error

from ernie_ir.artifacts import artifact_lock
from ernie_ir.ir import DType, ErnieIRError, Graph, GraphBuilder, tensor
from ernie_ir.ir.storage import GRAPH_FILE, WEIGHTS_FILE, load_graph, lock_holder, save_graph
from ernie_ir.ir.weights import ArraySource
from ernie_ir.passes import DumpInstrument, run_pipeline
from ernie_ir.passes.infra.instruments import InstrumentError

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60


def _graph() -> Graph:
    import numpy as np

    b = GraphBuilder("locked")
    x = b.input("x", tensor(DType.F32, 4))
    w = b.param("w", source=ArraySource(np.eye(4, dtype=np.float32)))
    b.output(b.linear(x, w), name="y")
    return b.graph


@pytest.fixture
def holder(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """(destination, PID) of another process holding `tmp_path / NAME`'s lock (NAME: the
    test's param, default "g") until the test ends."""
    dest = tmp_path / getattr(request, "param", "g")
    code = ("import sys, time; from pathlib import Path; from ernie_ir.artifacts import artifact_lock\n"
            "with artifact_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(dest)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield dest, proc.pid
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=TIMEOUT_S)
        if proc.stdout is not None:
            proc.stdout.close()


def _refusal(dest: Path, pid: int, what: str) -> str:
    return (f"{dest} is being written by PID {pid} (lock {dest.parent / ('.' + dest.name + '.lock')}): "
            f"wait for it to finish, or choose another {what}")


def test_save_graph_refuses_a_folder_another_process_is_writing_and_writes_nothing(
        holder: tuple[Path, int]) -> None:
    dest, pid = holder
    with pytest.raises(ErnieIRError) as e:
        save_graph(_graph(), dest)
    assert str(e.value) == _refusal(dest, pid, "folder")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in dest.parent.iterdir()) == [f".{dest.name}.lock"]  # the holder's


def test_save_graph_with_overwrite_leaves_a_locked_folder_as_it_was(holder: tuple[Path, int]) -> None:
    dest, _ = holder
    dest.mkdir()
    (dest / "keep.txt").write_text("precious", encoding="utf-8")
    with pytest.raises(ErnieIRError, match="is being written by PID"):
        save_graph(_graph(), dest, overwrite=True)
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in dest.parent.iterdir()) == [f".{dest.name}.lock", dest.name]


def test_save_graph_takes_the_lock_while_it_writes_and_lets_go_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ernie_ir.ir import storage

    dest = tmp_path / "g"
    seen: list[str | None] = []
    real = storage.write_graph_files

    def spy(graph: Graph, folder: Path, *args: object, **kwargs: object) -> dict[str, str]:
        seen.append(lock_holder(dest))
        return real(graph, folder, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(storage, "write_graph_files", spy)
    save_graph(_graph(), dest)
    assert seen == [f"PID {os.getpid()}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]  # the lock file went with the lock
    assert sorted(p.name for p in dest.iterdir()) == [GRAPH_FILE, WEIGHTS_FILE]
    # under its own lock (compile --stop-after does so) a thread saves: taking it again is a no-op
    with artifact_lock(dest):
        save_graph(load_graph(dest), dest, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]


@pytest.mark.parametrize("holder", ["dumps"], indirect=True)
def test_show_dump_dir_refuses_a_folder_another_process_is_writing(
        holder: tuple[Path, int], capsys: pytest.CaptureFixture[str]) -> None:
    dest, pid = holder
    line = user_error(capsys, "show", "gpt-345m@tiny", "--pipeline", "cse", "--dump-dir", str(dest))
    assert line == f"error: {_refusal(dest, pid, 'dump folder')}"
    assert not dest.exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == [".dumps.lock"]


@pytest.mark.parametrize("holder", ["dumps"], indirect=True)
def test_dump_instrument_refuses_a_locked_folder_and_lets_go_of_its_own(holder: tuple[Path, int]) -> None:
    dest, pid = holder
    with pytest.raises(InstrumentError) as e:
        run_pipeline(_graph(), "cse", instruments=[DumpInstrument(dest)])
    assert str(e.value) == _refusal(dest, pid, "dump folder")
    assert not dest.exists()
    free = dest.parent / "free"
    dump = DumpInstrument(free)
    run_pipeline(_graph(), "cse", instruments=[dump])
    assert lock_holder(free) is None and not (dest.parent / ".free.lock").exists()
    assert [p.name for p in dump.files] == ["000-input.ir", "001-cse.ir"]
