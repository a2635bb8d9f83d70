"""Calibration data for the calibrated weight methods: token ids cut into windows.

One reader for the data a calibrated method runs on: a `.npy` of token ids [batch, seq] (a
1-D array is one sequence), cut into `seq_len`-token windows, the first `samples` of them
kept. Defaults: 128 windows of min(512, the model's max positions) tokens. Data that holds
fewer windows, or shorter sequences than the default window, is used as it is, with one
warning; sequences shorter than an explicitly asked window are refused. The file's sha256 is
the digest the manifest records.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.inputs import read_token_ids

DEFAULT_SAMPLES = 128
DEFAULT_SEQ_LEN = 512
FLAG = "--calib-data"


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


def _sha256(path: Path) -> str:
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
    if p.suffix.lower() != ".npy":
        raise CalibrationDataError(f"{FLAG} {p}: give a .npy array of token ids [batch, seq] (text is not "
                                   "read here: tokenize it with the checkpoint's tokenizer first)")
    ids = read_token_ids(p, f"{FLAG} file", CalibrationDataError)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise CalibrationDataError(f"{FLAG} {p}: token ids must be in [0, {vocab}) for this model, got "
                                   f"{lo}..{hi}")
    rows, held = ids.shape
    default = min(DEFAULT_SEQ_LEN, max_positions or DEFAULT_SEQ_LEN)
    length = default if seq_len is None else seq_len
    if held < length:
        if seq_len is not None:
            raise CalibrationDataError(f"{FLAG} {p}: its sequences hold {held} tokens, shorter than one "
                                       f"calibration window of {seq_len}: give longer sequences or a "
                                       "smaller window")
        warn(f"{FLAG} {p}: sequences of {held} tokens, shorter than the default window of {default}: "
             f"calibrating on windows of {held}")
        length = held
    per_row = held // length
    windows = ids[:, :per_row * length].reshape(rows * per_row, length)
    if windows.shape[0] < samples:
        warn(f"{FLAG} {p}: holds {windows.shape[0]} window(s) of {length} tokens, fewer than the "
             f"{samples} asked for: calibrating on those")
    return CalibrationWindows(np.ascontiguousarray(windows[:samples]), str(p), _sha256(p))
