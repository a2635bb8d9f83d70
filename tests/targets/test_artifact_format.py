"""The one implementation of the artifact format (ernie_ir.artifacts) and its write protocol:
the old names, the lock, stale-temp cleanup, the umask, files added later (training checkpoints).

The tests of compile itself (umask, lock, temp cleanup, --stop-after) compile; the others write
into a copy of the session's shared artifact (`compiled_artifact`, tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ernie_ir
from ernie_ir.artifacts import ArtifactError, publish_into, record_files, temp_name, verify_artifact
from ernie_ir.artifacts.publish import lock_holder
from ernie_ir.targets import CompileOptions, compile_model

MODEL = "ernie-4.5-0.3b@tiny"
PKG = Path(ernie_ir.__file__).parent
ROOT = PKG.parent


def test_the_old_names_stay_importable_from_targets() -> None:
    import ernie_ir.artifacts as a
    import ernie_ir.targets as t
    import ernie_ir.targets.artifact as ta

    for name in ("ArtifactError", "read_manifest", "verify_artifact", "require_weights", "artifact_mapping",
                 "load_rank_graphs", "load_artifact"):
        assert getattr(t, name) is getattr(a, name)
    assert ta.FORMATS == a.FORMATS and ta.MANIFEST == "manifest.json"


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_the_artifact_gets_the_users_umask(tmp_path: Path, umask: int) -> None:
    before = os.umask(umask)
    try:
        compile_model(MODEL, "kunlun", CompileOptions(out=tmp_path / "a"))
    finally:
        os.umask(before)
    root = tmp_path / "a"
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode & umask == 0, (p, oct(mode))
        if p.is_dir():
            assert mode == 0o777 & ~umask, (p, oct(mode))
    assert stat.S_IMODE((root / "inference" / "launch.sh").stat().st_mode) == 0o777 & ~umask


def _hold_lock(dest: Path) -> subprocess.Popen[str]:
    code = ("import sys, time; from pathlib import Path; from ernie_ir.artifacts import artifact_lock\n"
            "with artifact_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(dest)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_held_lock_fails_fast_naming_its_holder_and_a_dead_holders_is_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "a"
    holder = _hold_lock(out)
    try:
        t0 = time.monotonic()
        with pytest.raises(ArtifactError) as e:
            compile_model(MODEL, "kunlun", CompileOptions(out=out))
        assert time.monotonic() - t0 < 5
        assert str(e.value) == (f"{out} is being written by PID {holder.pid} (lock {tmp_path / '.a.lock'}): "
                                "wait for it to finish, or choose another --out")
        assert lock_holder(out) == f"PID {holder.pid}"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    assert (tmp_path / ".a.lock").exists()  # a killed holder leaves its file, not its lock
    compile_model(MODEL, "kunlun", CompileOptions(out=out))
    verify_artifact(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_the_next_compile_removes_dead_writers_temp_folders_only(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale = tmp_path / f".other.tmp-{dead.pid}-0123abcd"
    (stale / "rank0").mkdir(parents=True)
    (stale / "rank0" / "weights.safetensors").write_bytes(b"\0" * 4096)
    live = tmp_path / f".busy.tmp-{os.getppid()}-0123abcd"  # a live writer (our parent process)
    live.mkdir()
    mine = tmp_path / "notes.tmp-1-0123abcd"  # not one of ours: no leading dot
    mine.mkdir()
    compile_model(MODEL, "kunlun", CompileOptions(out=tmp_path / "a"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a", live.name, mine.name])


def test_files_added_later_are_numbered_and_listed_under_the_lock(tmp_path: Path, compiled_artifact) -> None:
    """Two runs that started from the same manifest both publish: distinct run numbers, both
    listed (the second reads the manifest afresh), verify passes."""
    root = compiled_artifact.copy(compiled_artifact(MODEL, "kunlun"), tmp_path / "a")
    start = verify_artifact(root)
    folder = root / "training" / "checkpoints"
    folder.mkdir(parents=True)
    outs = []
    for i in range(2):
        staged = temp_name(folder, "checkpoint")
        staged.write_bytes(bytes([i]) * 100)
        outs.append(publish_into(root, staged, folder, "run-{run:03d}-step-5.safetensors", start))
    assert [p.name for p in outs] == ["run-001-step-5.safetensors", "run-002-step-5.safetensors"]
    files = verify_artifact(root).files
    assert {"training/checkpoints/run-001-step-5.safetensors",
            "training/checkpoints/run-002-step-5.safetensors"} <= set(files)


def test_a_run_on_a_recompiled_artifact_records_nothing(tmp_path: Path, compiled_artifact) -> None:
    root = compiled_artifact.copy(compiled_artifact(MODEL, "kunlun"), tmp_path / "a")
    start = verify_artifact(root)
    compile_model(MODEL, "kunlun", CompileOptions(out=root, force=True, quant="wint8"))  # replaced meanwhile
    folder = root / "training"
    staged = temp_name(folder, "checkpoint") if folder.exists() else temp_name(root, "checkpoint")
    staged.write_bytes(b"x")
    with pytest.raises(ArtifactError, match="changed while it was in use"):
        publish_into(root, staged, staged.parent, "run-{run:03d}-step-1.safetensors", start)
    assert not staged.exists()
    verify_artifact(root)  # nothing half-recorded


def test_without_renameat2_the_swap_still_leaves_old_or_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            compiled_artifact) -> None:
    """Where exchange is unavailable: the two-rename swap, and a failure between its renames
    puts the old artifact back."""
    from ernie_ir.artifacts import publish

    monkeypatch.setattr(publish, "_renameat2", lambda *a: False)
    out = compiled_artifact.copy(compiled_artifact(MODEL, "kunlun"), tmp_path / "a")  # the old artifact
    old = verify_artifact(out)
    compile_model(MODEL, "kunlun", CompileOptions(out=out, force=True, quant="wint8"))
    assert verify_artifact(out).pipeline != old.pipeline
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    before = verify_artifact(out)
    real_rename = os.rename
    calls: list[str] = []

    def second_fails(src: object, dst: object) -> None:
        calls.append(str(dst))
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(publish.os, "rename", second_fails)
    with pytest.raises(ArtifactError, match="No space left on device"):
        compile_model(MODEL, "kunlun", CompileOptions(out=out, force=True))
    assert calls[0].endswith(f".a.old-{os.getpid()}") and calls[1] == str(out)
    assert verify_artifact(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    monkeypatch.setattr(publish.os, "rename", real_rename)
    with pytest.raises(ArtifactError, match="already exists"):
        compile_model(MODEL, "kunlun", CompileOptions(out=out))


def _params_writer(value: float):
    """What a trainer writes into its staged checkpoint folder (here: one params file)."""
    def write(stage: Path) -> None:
        import numpy as np
        from safetensors.numpy import save_file

        save_file({"w": np.full((4,), value, np.float32)}, str(stage / "params.safetensors"))

    return write


def test_two_trainings_saving_at_once_keep_both_checkpoints(tmp_path: Path, compiled_artifact) -> None:
    """Two runs that read the manifest at the same start save together (threads: each lock is
    its own open file): folders run-001 and run-002, both listed; a killed run's temp folder is
    removed."""
    import threading

    from ernie_ir.training.checkpoints import CheckpointRun, checkpoint_expected, save_checkpoint

    root = compiled_artifact.copy(compiled_artifact(MODEL, "kunlun"), tmp_path / "a")
    start = verify_artifact(root)
    folder = root / "training" / "checkpoints"
    folder.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    killed = folder / f".checkpoint.tmp-{dead.pid}-0123abcd"  # a SIGKILLed run's staging folder
    killed.mkdir()
    (killed / "params.safetensors").write_bytes(b"\0" * 1000)
    outs: list[Path] = []
    runs = [threading.Thread(target=lambda v=v: outs.append(
        save_checkpoint(root, _params_writer(v), 3, CheckpointRun(), checkpoint_expected(start))))
        for v in (1.0, 2.0)]
    for t in runs:
        t.start()
    for t in runs:
        t.join(timeout=60)
    assert sorted(p.name for p in outs) == ["run-001-step-3", "run-002-step-3"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in outs)
    files = verify_artifact(root).files
    assert all(f"training/checkpoints/{p.name}/params.safetensors" in files for p in outs)


def test_older_checkpoints_are_removed_and_unlisted_under_the_lock(tmp_path: Path, compiled_artifact) -> None:
    """retire_published (--save-total-limit): the newest by (run, step) stay, the others are
    deleted with every manifest entry under them (files added to a folder later too); other
    entries of the folder are never touched; verify passes."""
    from ernie_ir.artifacts.publish import retire_published
    from ernie_ir.training.checkpoints import CheckpointRun, checkpoint_order, save_checkpoint

    root = compiled_artifact.copy(compiled_artifact(MODEL, "kunlun"), tmp_path / "a")
    start = verify_artifact(root)
    first, second = CheckpointRun(), CheckpointRun()
    made = [save_checkpoint(root, _params_writer(1.0), s, first, start) for s in (2, 10)]
    made += [save_checkpoint(root, _params_writer(2.0), s, second, start) for s in (4, 6)]
    assert [p.name for p in made] == ["run-001-step-2", "run-001-step-10", "run-002-step-4", "run-002-step-6"]
    folder = root / "training" / "checkpoints"
    extra = made[0] / "adapter" / "lora_config.json"  # what an on_checkpoint callback adds
    extra.parent.mkdir()
    extra.write_text("{}")
    record_files(root, [extra])
    removed = retire_published(root, folder, 2, checkpoint_order)
    assert [p.name for p in removed] == ["run-001-step-2", "run-001-step-10"]
    assert sorted(p.name for p in folder.iterdir()) == ["run-002-step-4", "run-002-step-6"]
    files = verify_artifact(root).files
    assert not any("run-001" in n for n in files)
    assert "training/checkpoints/run-002-step-4/params.safetensors" in files
    assert retire_published(root, folder, 2, checkpoint_order) == []


def test_compile_stop_after_writes_its_graph_folder_under_the_lock(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # --stop-after writes a graph folder (rank folders for a split) instead of an artifact: it holds
    # the destination's lock while it writes, as an artifact's write does
    from ernie_ir.targets import compile as compile_module

    seen: list[str | None] = []
    real = compile_module._save_graphs

    def spy(ranks: list, dest: Path) -> None:
        seen.append(lock_holder(dest))
        real(ranks, dest)

    monkeypatch.setattr(compile_module, "_save_graphs", spy)
    out = tmp_path / "g"
    compile_model(MODEL, "ascend", CompileOptions(quant="wint8", tp=2, stop_after="split", out=out))
    assert seen == [f"PID {os.getpid()}"]
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]  # the lock file is gone with the lock


def test_record_files_takes_a_relative_root_with_absolute_files(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  compiled_artifact) -> None:
    # `ernie-ir train ART` with a relative ART: the checkpoint's adapter files come back absolute
    compiled_artifact.copy(compiled_artifact(MODEL, "kunlun"), tmp_path / "a")
    extra = tmp_path / "a" / "training-notes.txt"
    extra.write_text("x")
    monkeypatch.chdir(tmp_path)
    record_files(Path("a"), [extra])
    assert "training-notes.txt" in verify_artifact(tmp_path / "a").files


def test_the_shared_artifact_is_read_only_and_its_copy_as_compiled(tmp_path: Path, compiled_artifact) -> None:
    """The suite's artifact factory (tests/conftest.py): one compile per option set, shared
    without write bits; its copy carries the modes compile gave (here: the umask's)."""
    shared = compiled_artifact(MODEL, "kunlun")
    assert compiled_artifact(MODEL, "kunlun") == shared != compiled_artifact(MODEL, "kunlun", quant="wint8")
    assert all(stat.S_IMODE(p.lstat().st_mode) & 0o222 == 0 for p in [shared, *shared.rglob("*")]
               if not p.is_symlink())
    copy = compiled_artifact.copy(shared, tmp_path / "a")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((copy / "inference" / "launch.sh").stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE(copy.stat().st_mode) == 0o777 & ~umask
    (copy / "notes.txt").write_text("x")
    verify_artifact(shared)
    assert not (shared / "notes.txt").exists()
