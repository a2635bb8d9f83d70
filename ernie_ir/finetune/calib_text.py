"""Calibration text as token ids: `--calib-data FILE.jsonl` tokenized with the model's tokenizer.

The calibrating passes (`passes.quant.calib_data`) read token ids only: they sit below the
tokenizers. This module, which may use both, reads a `.jsonl` with the fine-tuning reader
(`sft_data.read_sft_data`: `{"text": ...}` lines encoded as training encodes them, an EOS after
each document; ERNIEKit SFT `src`/`tgt` and alpaca chats rendered through the tokenizer's chat
template exactly as training renders them; `{"input_ids": ...}` lines as they are), concatenates
every example's input ids in file order and hands the passes a cached `.npy` of them
(`calib_data.write_tokenized`), whose sidecar keeps the user's file and sha256 for the manifest.

    calib = calibration_ids(Path("calib.jsonl"), "ckpt/")   # a .npy path; a .npy is returned as is
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ernie_ir.artifacts import MANIFEST, read_manifest
from ernie_ir.frontends.tokenizer import Tokenizer, load_tokenizer, tokenizer_files
from ernie_ir.load import tokenizer_folder
from ernie_ir.passes.quant.calib_data import FLAG, CalibrationDataError, is_text, write_tokenized

from .sft_data import read_sft_data


def _tokenizer_of(model: str | Path) -> tuple[Tokenizer | None, str]:
    """MODEL's tokenizer (a checkpoint folder's, a built-in's, an artifact's copy) and a digest of
    its files; (None, "") when it has none."""
    folder: Path | None
    if (Path(model) / MANIFEST).is_file():
        name = read_manifest(Path(model)).tokenizer
        folder = Path(model) / name if isinstance(name, str) else None
    else:
        folder = tokenizer_folder(model)
    tokenizer = load_tokenizer(folder) if folder is not None else None
    if tokenizer is None or folder is None:
        return None, ""
    h = hashlib.sha256()
    for f in tokenizer_files(folder):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return tokenizer, h.hexdigest()


def calibration_ids(data: str | Path, model: str | Path) -> Path:
    """The `.npy` of token ids the calibrating passes read for `--calib-data data` of `model`: `data`
    itself unless it is text (`.jsonl`), which is tokenized with `model`'s tokenizer. A text file
    for a model without a tokenizer is CalibrationDataError (one line naming the fix); a bad line
    is the fine-tuning reader's one-line `SftDataError` (`path:line`)."""
    p = Path(data)
    if not is_text(p):
        return p
    if not p.is_file():
        raise CalibrationDataError(f"{FLAG} {p}: no such file")
    tokenizer, digest = _tokenizer_of(model)
    if tokenizer is None:
        raise CalibrationDataError(f"{FLAG} {p} is text, but {model} has no tokenizer to read it with: "
                                   "give a .npy of token ids [batch, seq], or a checkpoint folder with its "
                                   "tokenizer files")
    rows = read_sft_data(p, tokenizer)
    return write_tokenized([ids for ids, _ in rows], p, digest)
