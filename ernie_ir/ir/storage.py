"""Graph folders: `graph.ir` (the text) + `weights.safetensors` (param data).

`save_graph` streams one param at a time into the weights file, so saving
never holds more than one tensor in memory; `load_graph` parses the text and
attaches memory-mapped sources, so loading reads no weight bytes. A reload is
bit-exact: the same dtypes, shapes and bytes.

`folder_lock` is the one lock per destination folder that every writer of a folder takes
(`save_graph`, `--dump-dir`, and the artifact writers above this layer through
`ernie_ir.artifacts.artifact_lock`): `PARENT/.NAME.lock`, an `fcntl.flock` that the kernel drops
when its holder dies. A second writer is refused at once with one line naming the lock and its
holder's PID (or waits up to `wait_s`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from copy import deepcopy
from pathlib import Path

from .errors import ErnieIRError, WeightError
from .graph import Graph
from .parser import parse_graph
from .printer import print_graph
from .weights import SafetensorsFile, content_hash, write_safetensors

GRAPH_FILE = "graph.ir"
WEIGHTS_FILE = "weights.safetensors"


def sha256_file(path: str | os.PathLike[str]) -> str:
    """sha256 of a file, read in 1 MiB chunks (artifacts list one per file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_graph_files(graph: Graph, folder: Path,
                      on_tensor: Callable[[str, int, int], None] | None = None, *,
                      require_finite: bool = True) -> dict[str, str]:
    """Write graph.ir and weights.safetensors into an existing folder; returns {file: sha256}.

    `require_finite`: a float param holding NaN or Inf is refused (WeightError naming it) as
    its values are written, so a compiled artifact never carries weights that cannot compute."""
    text = print_graph(graph).encode("utf-8")
    (folder / GRAPH_FILE).write_bytes(text)
    weights = write_safetensors(
        folder / WEIGHTS_FILE,
        ((p.name, p.source) for p in graph.params.values() if p.source is not None),
        on_tensor=on_tensor,
        require_finite=require_finite,
    )
    return {GRAPH_FILE: hashlib.sha256(text).hexdigest(), WEIGHTS_FILE: weights}


def clone_graph(graph: Graph) -> Graph:
    """An independent copy of `graph` to rewrite (nodes, values, params, metadata), whose params
    read the same weights as the original's (each param's `source` is shared, no byte is
    copied): a pass run on the copy leaves the original as it was. Made through the text form
    (`print_graph` + `parse_graph`), so the copy is what a save and load would give."""
    copy = parse_graph(print_graph(graph), source=f"<clone of {graph.name or 'graph'}>")
    for name, p in copy.params.items():
        orig = graph.params[name]
        p.source = orig.source
        p.digest = orig.digest
    copy.metadata = deepcopy(graph.metadata)
    return copy


def save_graph(graph: Graph, folder: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Save a graph folder atomically: a failure leaves nothing behind.

    Under the folder's lock (`folder_lock`), as an artifact is written: while another process
    writes the same folder, ErnieIRError (one line, the lock and its holder's PID) and nothing
    is written."""
    dest = Path(folder)
    with folder_lock(dest, what="folder", kind="graph folder", parents=True):
        if dest.exists() and not overwrite:
            raise ErnieIRError(f"{dest} already exists (pass overwrite=True / --force to replace it)")
        # a graph folder may hold what it is given: no finiteness check
        return replace_folder(dest, lambda tmp: write_graph_files(graph, tmp, require_finite=False))


def replace_folder(dest: Path, fill: Callable[[Path], object]) -> Path:
    """`fill` a fresh temp folder beside `dest`, then put it in `dest`'s place (replacing what
    was there); any failure or interruption removes the temp folder and leaves `dest` as it was."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        fill(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` (UTF-8) to `path` through a temp file beside it: a reader sees the old file or
    the whole new one, and an interruption leaves no partial file."""
    dest = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


# -- the lock per destination folder ---------------------------------------------------------------


def printable(text: object) -> str:
    """A name or path as it may appear in a one-line message (control characters escaped)."""
    s = str(text)
    return s if s.isprintable() else repr(s)[1:-1]


def lock_path(dest: Path) -> Path:
    """Where `dest`'s lock lives: `PARENT/.NAME.lock`."""
    return dest.parent / f".{dest.name}.lock"


def _holder(fd: int) -> str:
    text = ""
    for _ in range(20):  # the holder writes its PID just after it takes the lock
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            break
        if text.isdigit():
            return f"PID {text}"
        time.sleep(0.01)
    return "another process"


_held = threading.local()  # .paths: the lock files this thread holds (a nested take is a no-op)


@contextlib.contextmanager
def folder_lock(dest: Path, *, wait_s: float = 0.0, what: str = "--out", kind: str = "folder",
                parents: bool = False,
                error: type[ErnieIRError] = ErnieIRError) -> Iterator[Path]:
    """Hold `dest`'s lock (`PARENT/.NAME.lock`) for the block; the parent must exist (`parents`:
    make it).

    Held by another process (or thread): wait up to `wait_s` seconds, then `error` (one line, the
    lock's path and its holder's PID, ending "choose another `what`"). Taken again by the thread
    that holds it (compile --stop-after saving a graph folder under its own lock): a no-op.
    `kind` names the folder in the message when its parent cannot be made."""
    import fcntl

    path = lock_path(dest)
    held: set[str] = _held.__dict__.setdefault("paths", set())
    key = os.path.abspath(path)
    if key in held:
        yield path
        return
    if parents:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise error(f"cannot write the {kind} {printable(dest)}: {e.strerror or e} "
                        f"({printable(e.filename or dest.parent)}): choose a writable {what}") from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise error(f"cannot lock {printable(dest)}: {e.strerror or e} ({printable(path)}): choose a "
                        f"writable {what}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise error(f"{printable(dest)} is being written by {holder} (lock {printable(path)}): wait "
                        f"for it to finish, or choose another {what}") from None
        # The holder we waited for unlinks the file before it lets go: a lock on an unlinked
        # file guards nothing, so take it again on whatever the path names now.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    held.add(key)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        held.discard(key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def lock_holder(dest: Path) -> str | None:
    """Who holds `dest`'s lock right now ("PID n"), or None (free, or no lock file)."""
    import fcntl

    try:
        fd = os.open(lock_path(dest), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)
    return None


def load_graph(folder: str | os.PathLike[str], *, check_hashes: bool = True) -> Graph:
    """Load a graph folder; params get memory-mapped sources from weights.safetensors."""
    root = Path(folder)
    text_path = root / GRAPH_FILE
    if not text_path.is_file():
        raise ErnieIRError(f"{root} is not a graph folder (no {GRAPH_FILE})")
    try:
        text = text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ErnieIRError(f"{text_path}: not a text file (IR files are UTF-8 text)") from None
    graph = parse_graph(text, source=str(text_path))
    weights = root / WEIGHTS_FILE
    if weights.exists():
        st = SafetensorsFile(weights)
        for key in st:
            p = graph.params.get(key)
            if p is None:
                raise WeightError(f"{weights}: tensor {key!r} is not a param of the graph")
            p.source = None
            src = st.source(key)
            p._check_source(src)
            p.source = src
            if check_hashes and p.digest is not None and content_hash(src.read()) != p.digest:
                raise WeightError(f"param @{key}: data does not match the hash in {GRAPH_FILE}")
    return graph
