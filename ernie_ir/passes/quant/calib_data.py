"""Calibration data for the calibrated weight methods: token ids cut into windows.

One reader for the data a calibrated method runs on: a `.npy` of token ids [batch, seq] (a
1-D array is one sequence), cut into `seq_len`-token windows, the first `samples` of them
kept. Defaults: 128 windows of min(512, the model's max positions) tokens. Data that holds
fewer windows, or shorter sequences than the default window, is used as it is, with one
warning; sequences shorter than an explicitly asked window are refused. The file's sha256 is
the digest the manifest records.

Text data (`.jsonl`: `{"text": ...}` lines, ERNIEKit SFT `src`/`tgt` chats, alpaca, or
`{"input_ids": ...}` lines) needs the checkpoint's tokenizer, which lives above this layer: the
caller tokenizes it (`ernie_ir.finetune.calib_text`) and hands the pass the ids, concatenated
into one sequence, as a `.npy` in the cache folder (`write_tokenized`). Beside that file a small
JSON names the user's file and its sha256, which the manifest records instead of the cache's.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.inputs import read_token_ids

DEFAULT_SAMPLES = 128
DEFAULT_SEQ_LEN = 512
FLAG = "--calib-data"
TEXT_SUFFIX = ".jsonl"
SOURCE_SUFFIX = ".source.json"


class CalibrationDataError(ErnieIRError):
    """Calibration data that is missing, unreadable, or too short to calibrate on."""


@dataclass(frozen=True)
class CalibrationWindows:
    """The windows a calibration runs on, and where they came from."""

    ids: np.ndarray
    """int64 [windows, seq_len]."""
    source: str
    sha256: str

    def record(self) -> dict[str, Any]:
        """What the graph (and so the manifest) records of the data."""
        n, length = self.ids.shape
        return {"file": Path(self.source).name, "sha256": self.sha256, "windows": int(n),
                "seq_len": int(length)}


def is_text(path: str | Path) -> bool:
    """Calibration data that must be tokenized first (a JSON Lines file)."""
    return Path(path).suffix.lower() == TEXT_SUFFIX


def cache_folder() -> Path:
    """Where tokenized calibration text is kept, named by the text's and tokenizer's digests."""
    return Path(tempfile.gettempdir()) / "ernie-ir-calib"


def write_tokenized(rows: Sequence[Sequence[int]], source: str | Path, tokenizer_digest: str) -> Path:
    """The token-id rows of text file `source`, concatenated into one sequence [1, total], as a .npy
    in `cache_folder()` (reused when the text and the tokenizer are the same), with the sidecar
    that names `source` and its sha256 for the manifest."""
    src = Path(source)
    digest = sha256_file(src)
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{digest[:24]}-{tokenizer_digest[:16]}.npy"
    ids = np.asarray([i for row in rows for i in row], dtype=np.int64)[None, :]
    # written under a temporary name, then renamed: a reader never sees half a file
    for target, write in ((path.with_name(path.name + SOURCE_SUFFIX),
                           lambda f: f.write(json.dumps({"file": src.name, "sha256": digest}).encode())),
                          (path, lambda f: np.save(f, ids))):
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".part")
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, target)
    return path


def _source_of(path: Path) -> tuple[str, str]:
    """The file and sha256 the manifest records: the user's text for a tokenized cache file."""
    side = path.with_name(path.name + SOURCE_SUFFIX)
    if path.parent.resolve() == cache_folder().resolve() and side.is_file():
        rec = json.loads(side.read_text())
        return str(rec["file"]), str(rec["sha256"])
    return str(path), sha256_file(path)


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_windows(path: str | Path, *, vocab: int, samples: int = DEFAULT_SAMPLES,
                 seq_len: int | None = None, max_positions: int | None = None,
                 warn: Callable[[str], None] = lambda _: None) -> CalibrationWindows:
    """The calibration windows of `path` (see the module docstring); CalibrationDataError, one
    line naming --calib-data, for data that cannot be used."""
    p = Path(path)
    if not p.is_file():
        raise CalibrationDataError(f"{FLAG} {p}: no such file")
    if is_text(p):
        raise CalibrationDataError(f"{FLAG} {p}: text calibration data is tokenized by the caller: "
                                   "pass it through ernie_ir.finetune.calib_text.calibration_ids first "
                                   "(ernie-ir compile and eval do)")
    if p.suffix.lower() != ".npy":
        raise CalibrationDataError(f"{FLAG} {p}: give a .npy array of token ids [batch, seq] or a .jsonl "
                                   "of text or ERNIEKit SFT chats")
    shown, digest = _source_of(p)  # a tokenized text file speaks of the user's file
    ids = read_token_ids(p, f"{FLAG} file", CalibrationDataError)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise CalibrationDataError(f"{FLAG} {shown}: token ids must be in [0, {vocab}) for this model, got "
                                   f"{lo}..{hi}")
    rows, held = ids.shape
    default = min(DEFAULT_SEQ_LEN, max_positions or DEFAULT_SEQ_LEN)
    length = default if seq_len is None else seq_len
    if held < length:
        if seq_len is not None:
            raise CalibrationDataError(f"{FLAG} {shown}: its sequences hold {held} tokens, shorter than one "
                                       f"calibration window of {seq_len}: give longer sequences or a "
                                       "smaller window")
        warn(f"{FLAG} {shown}: sequences of {held} tokens, shorter than the default window of {default}: "
             f"calibrating on windows of {held}")
        length = held
    per_row = held // length
    windows = ids[:, :per_row * length].reshape(rows * per_row, length)
    if windows.shape[0] < samples:
        warn(f"{FLAG} {shown}: holds {windows.shape[0]} window(s) of {length} tokens, fewer than the "
             f"{samples} asked for: calibrating on those")
    return CalibrationWindows(np.ascontiguousarray(windows[:samples]), shown, digest)
