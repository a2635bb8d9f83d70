"""Reading the user's files totally: every failure is an `ErnieIRError` naming the file.

Two hazards every reader shares. A path that is not a regular file (a FIFO, a device such
as /dev/zero, a folder) would block or never end: `open_regular` opens without blocking and
refuses anything but a regular file. JSON can nest deeper than Python's recursion limit or
hold an integer literal longer than `int()` converts: `loads_json` turns those, and plain
syntax errors, into one line. Callers pass the error class of their layer (ConfigError,
WeightError, ...) and what the file is, for the message.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import IO, Any

import numpy as np

from .errors import ErnieIRError

MAX_JSON_BYTES = 1 << 30
"""A JSON file larger than this is refused before it is read (config, index, manifest files
are kilobytes to a few megabytes)."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], what: str = "file",
                 error: type[ErnieIRError] = ErnieIRError) -> IO[bytes]:
    """`path` opened for reading in binary, if it is a regular file (symlinks followed).

    The open does not block (O_NONBLOCK), so a FIFO without a writer is refused at once
    instead of waited on; a device or folder is refused too."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{p}: cannot read ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{p}: this {what} is {_kind(mode)}, not a regular file: give a file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike[str], what: str = "file",
               error: type[ErnieIRError] = ErnieIRError, limit: int | None = None) -> bytes:
    """The bytes of a regular file; `limit`: refuse a larger file before reading it."""
    with open_regular(path, what, error) as f:
        if limit is not None:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise error(f"{path}: {size} bytes, more than the {limit} a {what} may have: is it the "
                            "right file?")
        try:
            return f.read()
        except OSError as e:
            raise error(f"{path}: cannot read ({e.strerror or e})") from None


def read_text(path: str | os.PathLike[str], what: str = "file",
              error: type[ErnieIRError] = ErnieIRError, limit: int | None = None) -> str:
    """The UTF-8 text of a regular file."""
    data = read_bytes(path, what, error, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: this {what} is not UTF-8 text (byte {e.start}): fix or re-export it") from None


def loads_json(text: str | bytes, source: str, error: type[ErnieIRError] = ErnieIRError,
               fix: str = "fix or re-export it") -> Any:
    """Parsed JSON, or one line naming `source`: syntax errors, nesting deeper than the parser
    can recurse, integer literals too long to convert, an empty file."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise error(f"{source}: not UTF-8 text: {fix}") from None
    if not text.strip():
        raise error(f"{source}: the file is empty: {fix}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{source} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): "
                    f"{fix}") from None
    except RecursionError:
        raise error(f"{source}: JSON arrays or objects nest too deeply to read: {fix}") from None
    except ValueError as e:  # an integer literal longer than int() converts (sys.int_info)
        raise error(f"{source}: {str(e).split(';')[0]}: {fix}") from None


def read_json(path: str | os.PathLike[str], what: str = "file", error: type[ErnieIRError] = ErnieIRError,
              fix: str = "fix or re-export it") -> Any:
    """`loads_json` of a regular file's UTF-8 text."""
    return loads_json(read_bytes(path, what, error, MAX_JSON_BYTES), str(path), error, fix)


def read_token_ids(path: str | os.PathLike[str], what: str = "token file",
                   error: type[ErnieIRError] = ErnieIRError) -> np.ndarray:
    """A .npy file of integer token ids as int64 [batch, seq] (a 1-D array is one sequence).

    Refused with one line: not a regular file, not a plain .npy array (pickled objects are
    never loaded), empty or truncated, not integers, not 1-D/2-D, no ids, values outside int64."""
    with open_regular(path, what, error):
        pass  # a FIFO or a device is refused before numpy opens it (and would wait on it)
    try:
        # Mapped, not read: a header claiming 10**9 rows must not allocate them before the size
        # checks below (a file shorter than its header says fails to map: ValueError).
        with np.errstate(over="ignore"):  # the byte size of a huge declared shape overflows
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError, OSError, OverflowError) as e:
        why = str(e).splitlines()[0] if str(e) else "the file is empty or truncated"
        raise error(f"{path}: not a plain .npy array of token ids ({why})") from None
    if not isinstance(ids, np.ndarray):
        raise error(f"{path}: holds several arrays (.npz), not one .npy array of token ids")
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise error(f"{path}: expected integer token ids [batch, seq], got {ids.dtype}{list(ids.shape)}")
    if ids.size == 0:
        raise error(f"{path}: the array is empty {list(ids.shape)}: give at least one token id per sequence")
    if ids.dtype == np.uint64 and int(ids.max()) > np.iinfo(np.int64).max:
        raise error(f"{path}: token id {int(ids.max())} is not a valid token id (above int64)")
    return ids.astype(np.int64)


def read_text_or_ids_lines(path: str | os.PathLike[str], what: str, text_key: str, ids_key: str,
                           error: type[ErnieIRError] = ErnieIRError) -> list[tuple[int, str | list[int]]]:
    """(line number, text or token ids) per non-blank line of a JSON Lines file whose lines are a
    string, a non-empty list of ints, or an object with `text_key` (text) or `ids_key` (ids).

    One line naming the file and line number for anything else (prompt files, eval corpora)."""
    shape = f'a string, a list of token ids, {{"{text_key}": ...}} or {{"{ids_key}": [...]}}'
    items: list[tuple[int, str | list[int]]] = []
    for n, line in enumerate(read_text(path, what, error).splitlines(), 1):
        if not line.strip():
            continue
        try:
            item: Any = json.loads(line)
        except (ValueError, RecursionError):
            raise error(f"{path}: line {n} is not valid JSON: write one {shape} per line") from None
        if isinstance(item, dict):
            item = item.get(text_key, item.get(ids_key))
        if isinstance(item, str):
            items.append((n, item))
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in item):
            items.append((n, list(item)))
        else:
            raise error(f"{path}: line {n} holds nothing to read: give {shape}")
    return items
