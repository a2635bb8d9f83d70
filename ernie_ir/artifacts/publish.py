"""Writing an artifact folder so that no user data is lost, under kills and concurrency.

The protocol (what git does for its refs, what pip/uv do for installs):

- **A lock per destination**: `PARENT/.NAME.lock`, an `fcntl.flock` held while a writer
  changes `NAME` (compile's write phase, a training checkpoint being recorded); it is
  `ernie_ir.ir.storage.folder_lock`, which graph folders and `--dump-dir` take too. The kernel drops
  the lock when its holder dies, so a killed writer never blocks the next one; the file holds
  the holder's PID for the message. A second writer fails at once (`wait_s=0`, compile) with one
  line naming the lock and the holder's PID, or waits up to `wait_s` (training checkpoints).
- **Temp folders** `PARENT/.NAME.tmp-PID-XXXXXXXX` (the writer's PID in the name), with the
  user's umask.
- **The final move decides**: without force, `renameat2(RENAME_NOREPLACE)` (a check and a
  rename where that call is missing): a folder that appeared at NAME while compiling is never
  touched. With force, NAME must still be an artifact (or an empty folder), and the new folder is
  swapped in with `renameat2(RENAME_EXCHANGE)`, so at every instant NAME holds the old or the new
  artifact; the old one (now under the temp name) is then removed. Where exchange is missing,
  the old artifact is renamed to `PARENT/.NAME.old-PID` first and put back if anything fails.
- **Cleanup of killed writers**: `clean_stale(PARENT, NAME)` (run under NAME's lock) removes
  the temp folders of any NAME in PARENT whose PID is dead and recovers `.NAME.old-PID`: put
  back at NAME when NAME is missing (a swap killed half way), removed otherwise.
- **Files added to an artifact later** (training checkpoints, `publish_into`): written under a
  temp name, then, under the artifact's lock, renamed to the next free `run-K-...` name and listed
  in a manifest read afresh; two trainers never overwrite each other's checkpoint or entry.
  `retire_published` removes older ones the same way round (`--save-total-limit`): renamed
  to a temp name, unlisted, deleted, under the lock.

`test_pause(stage)` is a test-only hook: with `ERNIE_IR_TEST_PAUSE_AT=stage` in the environment
the writer sleeps `ERNIE_IR_TEST_PAUSE_S` seconds (default 30) at that named point, so the
reliability tests can kill a real compile there (tests/reliability/). Stages: "temp" (temp folder
made), "weights" (rank weights written), "manifest" (manifest written, before the move), "swap"
(new artifact in place, old one not yet removed), "checkpoint" (a training checkpoint listed,
its adapter not yet written: ernie_ir.training.checkpoints.save_checkpoint).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ernie_ir.ir.storage import folder_lock
from ernie_ir.ir.storage import lock_holder as lock_holder  # re-exported: who holds a lock
from ernie_ir.ir.storage import lock_path as lock_path

from .manifest import (
    MANIFEST,
    ArtifactError,
    read_manifest,
    read_manifest_data,
    record_files,
    show,
    write_manifest,
)

PAUSE_ENV = "ERNIE_IR_TEST_PAUSE_AT"
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")
_OLD = re.compile(r"^\.(?P<name>.+)\.old-(?P<pid>\d+)$")


def artifact_lock(dest: Path, *, wait_s: float = 0.0, what: str = "--out",
                  parents: bool = False) -> contextlib.AbstractContextManager[Path]:
    """Hold `dest`'s lock (`PARENT/.NAME.lock`) for the block; the parent must exist (`parents`:
    make it).

    Held elsewhere: wait up to `wait_s` seconds, then ArtifactError (one line, the lock's path
    and its holder's PID). The lock is `ernie_ir.ir.storage.folder_lock`, the one every folder
    writer takes (graph folders, `--dump-dir` too)."""
    return folder_lock(dest, wait_s=wait_s, what=what, kind="artifact", parents=parents,
                       error=ArtifactError)


def make_temp_dir(dest: Path) -> Path:
    """A fresh `PARENT/.NAME.tmp-PID-XXXXXXXX` folder with the user's umask (mkdir, not mkdtemp's 0700)."""
    while True:
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir(0o777)  # the umask applies
            return tmp
        except FileExistsError:
            continue


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:  # a killed process its parent has not reaped yet still answers kill(0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def clean_stale(parent: Path, name: str | None = None) -> list[Path]:
    """Remove what killed writers left in `parent`: temp folders (any artifact name) whose
    writer's PID is dead, and, for `name` (whose lock the caller holds), `.NAME.old-PID`: put back
    at NAME if NAME is missing, else removed. Returns the paths removed or restored."""
    done: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return done
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m and not _alive(int(m["pid"])):
            _remove(Path(entry.path))
            done.append(Path(entry.path))
            continue
        m = _OLD.match(entry.name)
        if m and name is not None and m["name"] == name and not _alive(int(m["pid"])):
            dest = parent / name
            if not os.path.lexists(dest):
                with contextlib.suppress(OSError):
                    os.rename(entry.path, dest)  # the swap was killed between its two renames
                    done.append(dest)
                    continue
            _remove(Path(entry.path))
            done.append(Path(entry.path))
    return done


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


# -- the final move ------------------------------------------------------------------------------

_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(2) with `flags`; False where the call or the flag is not available here."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _appeared(dest: Path) -> ArtifactError:
    return ArtifactError(f"{show(dest)} appeared while compiling (another process wrote it); it was left "
                         "untouched and the new artifact removed: pass --force to replace it, or choose "
                         "another --out")


def _place_new(tmp: Path, dest: Path) -> None:
    try:
        if _renameat2(tmp, dest, _RENAME_NOREPLACE):
            return
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise _appeared(dest) from None
        raise
    if os.path.lexists(dest):
        raise _appeared(dest)
    try:
        os.rename(tmp, dest)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise _appeared(dest) from None
        raise


def replaceable(dest: Path) -> None:
    """Refuse (ArtifactError) when `dest` holds anything but an ernie-ir artifact or an empty folder."""
    if dest.is_symlink():
        raise ArtifactError(f"{show(dest)} is a symbolic link, not an artifact folder: choose another --out "
                            "(--force replaces only folders)")
    if not dest.is_dir():
        raise ArtifactError(f"{show(dest)} is a file, not an artifact folder: choose another --out "
                            "(--force replaces only folders)")
    if any(dest.iterdir()):
        if not (dest / MANIFEST).is_file():
            # --force replaces an artifact, never an arbitrary folder that happens to be named.
            raise ArtifactError(f"{show(dest)} is a folder with files but no {MANIFEST}, so not an ernie-ir "
                                "artifact: --force only replaces artifacts; choose another --out")
        try:
            read_manifest(dest)
        except ArtifactError:
            raise ArtifactError(f"{show(dest)} has a {MANIFEST} that is not an ernie-ir artifact's: --force "
                                "only replaces artifacts; choose another --out") from None


def move_into_place(tmp: Path, dest: Path, force: bool) -> None:
    """Move the finished folder `tmp` to `dest` (the caller holds dest's lock); the decision to
    replace is made here, on what is at `dest` now. On any failure `tmp` is still there for the
    caller to remove and `dest` holds what it held before."""
    if not force or not os.path.lexists(dest):
        _place_new(tmp, dest)
        return
    replaceable(dest)
    if _renameat2(tmp, dest, _RENAME_EXCHANGE):  # atomic: dest is old, then new; never missing
        try:
            test_pause("swap")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # the old artifact, now under the temp name
        return
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except BaseException:
        if not os.path.lexists(dest):
            os.rename(old, dest)  # put the previous artifact back
        raise
    try:
        test_pause("swap")
    finally:
        shutil.rmtree(old, ignore_errors=True)


CHECKPOINT_WAIT_S = 120.0
"""How long a finished training run waits for the artifact's lock before giving up."""
_RUN = re.compile(r"^run-(\d+)-")


def temp_name(folder: Path, what: str) -> Path:
    """A fresh temp path `folder/.WHAT.tmp-PID-XXXXXXXX` that `clean_stale(folder)` removes once
    this process is dead."""
    return folder / f".{what}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def publish_into(root: Path, staged: Path, folder: Path, name: str,
                 expected: dict[str, Any] | None = None) -> Path:
    """Move `staged` (a file or folder inside the artifact `root`) to `folder/name` and list its
    files in the manifest, under the artifact's lock; returns the new path.

    `name` is formatted with `run`, the next free run number in `folder` (1 + the largest
    `run-K-*` there). `expected`: the manifest the caller read when it started; if the artifact
    was recompiled meanwhile, ArtifactError and `staged` is removed."""
    try:
        with artifact_lock(root, wait_s=CHECKPOINT_WAIT_S, what="artifact"):
            clean_stale(folder)
            runs = [int(m[1]) for p in folder.iterdir() if (m := _RUN.match(p.name))]
            out = folder / name.format(run=1 + max(runs, default=0))
            os.rename(staged, out)
            try:
                files = sorted(p for p in out.rglob("*") if p.is_file()) if out.is_dir() else [out]
                record_files(root, files, expected)
            except BaseException:
                _remove(out)
                raise
            return out
    finally:
        if os.path.lexists(staged):
            _remove(staged)


def retire_published(root: Path, folder: Path, keep: int,
                     order: Callable[[str], tuple[int, ...] | None]) -> list[Path]:
    """Of the entries of `folder` (inside the artifact `root`) that `order` ranks (a key; None:
    not one of them), keep the `keep` with the largest keys and remove the others, under the
    artifact's lock: each is first renamed to a temp name (that `clean_stale` removes should this
    process die), then every manifest entry under it is dropped (the manifest rewritten
    atomically), then it is deleted. Returns the paths removed, oldest first."""
    with artifact_lock(root, wait_s=CHECKPOINT_WAIT_S, what="artifact"):
        ranked = sorted((key, p) for p in folder.iterdir() if (key := order(p.name)) is not None)
        old = [p for _, p in ranked[:max(0, len(ranked) - keep)]]
        if not old:
            return []
        moved = []
        for p in old:
            tmp = temp_name(folder, p.name)
            os.rename(p, tmp)
            moved.append(tmp)
        manifest = read_manifest_data(root)
        for p in old:
            prefix = p.relative_to(root).as_posix()
            for name in [n for n in manifest["files"] if n == prefix or n.startswith(prefix + "/")]:
                del manifest["files"][name]
        write_manifest(root, manifest)
        for tmp in moved:
            _remove(tmp)
        return old


def test_pause(stage: str) -> None:
    """Test-only: sleep at `stage` when ERNIE_IR_TEST_PAUSE_AT names it (see the module docstring)."""
    if os.environ.get(PAUSE_ENV) == stage:
        time.sleep(float(os.environ.get("ERNIE_IR_TEST_PAUSE_S", "30")))


test_pause.__test__ = False  # type: ignore[attr-defined]  # not a pytest test when imported
