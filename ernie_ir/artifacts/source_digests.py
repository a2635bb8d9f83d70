"""sha256 of a source model's files, remembered by their stat so a checkpoint is hashed once.

The manifest records the sha256 of every source file. Hashing runs at about
1.6 GB/s a core here, so a 600 GB checkpoint costs six minutes of CPU, and
compiling it again (another target, quantization or parallel layout) would
pay that again. As git's index and DVC's state database do, a file's digest
is remembered together with the stat fields that change whenever its bytes
can have changed: device, inode, size, mtime_ns and ctime_ns (ctime cannot be
set from user space). An entry is used only if all of them still match.

A file whose mtime or ctime is less than `RACY_SECONDS` before the hash
started is not remembered: timestamps move in clock ticks, so a write of the
same size in the same tick would leave the stat unchanged (git's "racily
clean" files).

Entries live in `$ERNIE_IR_CACHE_DIR/sha256/` (default
`$XDG_CACHE_HOME/ernie-ir`, else `~/.cache/ernie-ir`), one small JSON file per
source path, replaced atomically. `ERNIE_IR_SOURCE_DIGESTS=off` turns the
memory off. A missing, unreadable or malformed entry is a miss, and a cache
that cannot be written is skipped: the digest is always the file's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from ernie_ir.ir.storage import sha256_file

RACY_SECONDS = 1.0
"""A file changed less than this long before hashing is hashed again next time."""

_STAT_FIELDS = ("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")


def cache_dir() -> Path | None:
    """Where digests are remembered, or None when `ERNIE_IR_SOURCE_DIGESTS=off`."""
    if os.environ.get("ERNIE_IR_SOURCE_DIGESTS", "").strip().lower() in ("off", "0", "no", "false"):
        return None
    root = os.environ.get("ERNIE_IR_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "ernie-ir") if xdg else os.path.join(os.path.expanduser("~"), ".cache",
                                                                         "ernie-ir")
    return Path(root) / "sha256"


def source_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of the file at `path`: remembered from an earlier call if its stat is unchanged."""
    folder = cache_dir()
    if folder is None:
        return sha256_file(path)
    real = os.path.realpath(path)
    entry = folder / (hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:32] + ".json")
    before = os.stat(real)
    stamp = [getattr(before, f) for f in _STAT_FIELDS]
    known = _read_entry(entry, real)
    if known is not None and known[0] == stamp:
        return known[1]
    started = time.time_ns()
    digest = sha256_file(real)
    after = os.stat(real)
    settled = max(after.st_mtime_ns, after.st_ctime_ns) < started - int(RACY_SECONDS * 1e9)
    if settled and [getattr(after, f) for f in _STAT_FIELDS] == stamp:
        _write_entry(entry, {"path": real, "stat": stamp, "sha256": digest})
    return digest


def _read_entry(entry: Path, real: str) -> tuple[list[int], str] | None:
    try:
        data = json.loads(entry.read_text(encoding="utf-8"))
        stamp, digest = data["stat"], data["sha256"]
        if (data["path"] == real and isinstance(digest, str) and len(digest) == 64
                and isinstance(stamp, list) and all(type(v) is int for v in stamp)):
            return stamp, digest
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    return None


def _write_entry(entry: Path, data: dict[str, object]) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=entry.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, entry)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass  # a cache that cannot be written (read-only home, full disk) only costs a rehash
