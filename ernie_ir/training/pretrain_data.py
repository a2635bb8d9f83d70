"""Pretraining data as PaddleNLP writes it: `PREFIX_ids.npy` + `PREFIX_idx.npz`, cut into
`seq_len + 1`-token windows in the order PaddleNLP's GPT dataset gives them.

    corpus = PretrainCorpus.open(Path("data/openwebtext"))
    train = corpus.windows("train", seq_len=1024, seed=1234, split="949,50,1", num_samples=4000)

The files (PaddleNLP's old `create_pretraining_data.py` output, read by its
`CompatibleIndexedDataset`): `PREFIX_ids.npy` is every token id, one 1-D integer array (uint16
or int32), memory-mapped here, never read whole; `PREFIX_idx.npz` holds `lens` (the length of
each entry, in order: `sum(lens) == ids.size`) and `docs` (the entry index where each document
starts, then `len(lens)`). PaddleNLP's GPT dataset (`paddlenlp.data.causal_dataset`, 3.0.0b4)
calls each entry of `lens` a document (for GPT data an entry is a document; ERNIE data splits
documents into sentences, and the dataset treats each sentence as one): so does this module.

What it reproduces, step by step, from `causal_dataset.py` (`_build_train_valid_test_datasets`,
`GPTDataset`, `_build_index_mappings`):

- split: `--split "949,50,1"` (or `/`-separated, fewer parts padded with 0) normalised, each
  part's entry count `int(round(part * n))`, the rounding error taken off every boundary
  (`get_train_valid_test_split_`): train, valid, test are entries [b0, b1), [b1, b2), [b2, b3);
- per split: a `np.random.RandomState(seed)`; tokens per epoch T = the split's token count;
  epochs = the fewest E with `(E T - 1) // L >= num_samples`; the document order `doc_idx`: the
  split's entries repeated E times and shuffled together, or, when E > 1 and the last epoch
  would contribute fewer than 80 % of an epoch's windows, the first E - 1 epochs shuffled
  together, then the last one alone (`separate_last_epoch`);
- the sample index (`fast_dataindex.helpers.build_sample_idx`, PaddleNLP's C++ helper; here in
  numpy, `sample_index`): the documents in `doc_idx` order as one stream, window i is stream
  tokens [i L, i L + L] (L + 1 tokens: consecutive windows share one token), `(E T - 1) // L`
  windows; row i of the index is (position in doc_idx, offset) of stream token i L;
- the shuffle index: the windows' order, `arange` shuffled by the same generator after
  doc_idx (with a separate last epoch: the windows before the last epoch shuffled, then the
  rest shuffled, appended);
- window j of the dataset = window `shuffle_idx[j]`, its token ids as int64.

The test tests/finetune/test_pretrain_data.py runs PaddleNLP's own dataset
(tests/reference/nlp_pretrain_windows.py) and checks the windows, doc_idx, sample index and
shuffle index are equal.

Deliberate differences from PaddleNLP:

- nothing is cached: PaddleNLP writes the three index arrays under `index-cache/` beside the
  data (keyed by an md5 of the settings) and reads them back; here they are rebuilt in memory
  every run (a vectorised numpy pass, no file written next to the user's data);
- `lens` may be any integer dtype (PaddleNLP's C++ helper asserts int32), and the files are
  checked: ids 1-D integers, `sum(lens) == ids.size`, `docs` from 0 to `len(lens)`, never
  decreasing: a mismatch is a `PretrainDataError` instead of windows read past the data;
- `--split` must have at most 3 parts, each finite and >= 0, summing to more than 0 (PaddleNLP
  drops parts past the third and does not check signs); the training split must hold at least
  one window (L + 1 tokens; PaddleNLP would repeat a shorter split over epochs);
- the test split (the third part) is never read.
"""

from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from ernie_ir.ir import ErnieIRError

DEFAULT_SPLIT = "949,50,1"
"""PaddleNLP's and ERNIEKit's default train/valid/test split."""

Part = Literal["train", "valid", "test"]
PARTS: tuple[Part, ...] = ("train", "valid", "test")


class PretrainDataError(ErnieIRError):
    """Pretraining data (a PREFIX_ids.npy / PREFIX_idx.npz pair, a split) that cannot be used."""


def prefix_files(prefix: Path) -> tuple[Path, Path]:
    """(PREFIX_ids.npy, PREFIX_idx.npz)."""
    return Path(f"{prefix}_ids.npy"), Path(f"{prefix}_idx.npz")


def is_prefix(path: Path) -> bool:
    """`path` names pretraining data: it is no file itself, and one of its two files exists."""
    ids, idx = prefix_files(path)
    return not Path(path).exists() and (ids.exists() or idx.exists())


def parse_split(text: str) -> tuple[float, float, float]:
    """The train, valid, test weights of `--split` ("949,50,1", "98/2", "1"; missing parts 0),
    PretrainDataError in one line when malformed or not adding up to something positive."""
    sep = "," if "," in text else "/"
    parts = text.split(sep)
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise PretrainDataError(f"--split {text!r}: expected up to 3 numbers separated by ',' or '/' "
                                f"(train, validation, test weights, e.g. {DEFAULT_SPLIT})") from None
    if len(values) > 3 or not all(math.isfinite(v) and v >= 0 for v in values):
        raise PretrainDataError(f"--split {text!r}: expected up to 3 weights >= 0 (train, validation, "
                                f"test, e.g. {DEFAULT_SPLIT})")
    if sum(values) <= 0:
        raise PretrainDataError(f"--split {text!r}: the weights add up to 0: give the training part a "
                                f"positive weight (e.g. {DEFAULT_SPLIT})")
    values += [0.0] * (3 - len(values))
    return values[0], values[1], values[2]


def split_bounds(text: str, size: int) -> list[int]:
    """PaddleNLP's `get_train_valid_test_split_`: the 4 entry boundaries of train/valid/test."""
    splits = list(parse_split(text))
    total = sum(splits)
    splits = [s / total for s in splits]
    bounds = [0]
    for i, s in enumerate(splits):
        bounds.append(bounds[i] + round(s * float(size)))
    diff = bounds[-1] - size
    for i in range(1, len(bounds)):
        bounds[i] -= diff
    return bounds


@dataclass(frozen=True)
class WindowIndex:
    """The three index arrays of one split's dataset, as PaddleNLP builds them."""

    doc_idx: np.ndarray
    """int32: the order of the split's entries over every epoch."""
    sample_index: np.ndarray
    """int32 [windows + 1, 2]: (position in doc_idx, offset) where each window starts."""
    shuffle_idx: np.ndarray
    """uint32 (int64 past 2^32 - 2 windows): the dataset's window order."""
    num_epochs: int
    seq_len: int


def _num_epochs(tokens_per_epoch: int, seq_len: int, num_samples: int) -> int:
    epochs, total = 0, 0
    while True:
        epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_len >= num_samples:
            return epochs


def _doc_idx(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
             separate_last: bool) -> np.ndarray:
    if not separate_last or epochs == 1:
        doc_idx = np.tile(documents, epochs).astype(np.int32)
        rng.shuffle(doc_idx)
        return doc_idx
    first = _doc_idx(documents, epochs - 1, rng, False)
    last = _doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def sample_index(sizes: np.ndarray, doc_idx: np.ndarray, seq_len: int, num_epochs: int,
                 tokens_per_epoch: int) -> np.ndarray:
    """`helpers.build_sample_idx` in numpy: row i = (k, offset) of stream token i * seq_len, k the
    position in doc_idx of the (non-empty) document holding it; row 0 is (0, 0)."""
    n = (num_epochs * tokens_per_epoch - 1) // seq_len
    lengths = np.asarray(sizes, np.int64)[doc_idx]
    ends = np.cumsum(lengths)
    pos = np.arange(n + 1, dtype=np.int64) * seq_len
    k = np.searchsorted(ends, pos, side="right")
    out = np.empty((n + 1, 2), np.int32)
    out[:, 0] = k
    out[:, 1] = pos - (ends[k] - lengths[k])
    out[0] = (0, 0)
    return out


def build_index(sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_len: int,
                seed: int) -> WindowIndex:
    """PaddleNLP's `_build_index_mappings` for `documents` (entry ids) of `sizes` (no cache)."""
    tokens = int(np.asarray(sizes, np.int64)[documents].sum())
    epochs = _num_epochs(tokens, seq_len, num_samples)
    rng = np.random.RandomState(seed=seed)
    separate_last = False
    before_last = 0
    if epochs > 1:
        before_last = ((epochs - 1) * tokens - 1) // seq_len
        per_epoch = (tokens - 1) // seq_len
        separate_last = num_samples - before_last < int(0.80 * per_epoch)
    doc_idx = _doc_idx(np.asarray(documents, np.int32), epochs, rng, separate_last)
    samples = sample_index(sizes, doc_idx, seq_len, epochs, tokens)
    total = samples.shape[0] - 1
    first = before_last if separate_last else total
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    shuffle = np.arange(first, dtype=dtype)
    rng.shuffle(shuffle)
    if first != total:
        rest = np.arange(first, total, dtype=dtype)
        rng.shuffle(rest)
        shuffle = np.concatenate((shuffle, rest))
    return WindowIndex(doc_idx, samples, shuffle, epochs, seq_len)


class PretrainCorpus:
    """A PREFIX_ids.npy / PREFIX_idx.npz pair, checked (`open`), the ids memory-mapped."""

    def __init__(self, prefix: Path, ids: np.ndarray, lens: np.ndarray) -> None:
        self.prefix = prefix
        self.ids = ids
        self.lens = lens
        self.starts = np.concatenate(([0], np.cumsum(lens, dtype=np.int64)[:-1])).astype(np.int64)

    @classmethod
    def open(cls, prefix: Path) -> PretrainCorpus:
        """Read and check the pair; PretrainDataError in one line naming the file at fault."""
        ids_path, idx_path = prefix_files(Path(prefix))
        missing = [p for p in (ids_path, idx_path) if not p.is_file()]
        if missing:
            have = idx_path if missing[0] == ids_path else ids_path
            raise PretrainDataError(f"pretraining data {prefix}: {missing[0]} is missing ({have} is "
                                    "there): PREFIX needs both PREFIX_ids.npy and PREFIX_idx.npz")
        try:
            ids = np.load(ids_path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise PretrainDataError(f"{ids_path}: not a .npy array ({_reason(e)})") from None
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise PretrainDataError(f"{ids_path}: token ids must be one 1-D integer array, got "
                                    f"{ids.dtype} {list(ids.shape)}")
        try:
            with np.load(idx_path, allow_pickle=False) as idx:
                found = {k: idx[k] for k in ("lens", "docs") if k in idx.files}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            raise PretrainDataError(f"{idx_path}: not a .npz archive ({_reason(e)})") from None
        for key in ("lens", "docs"):
            a = found.get(key)
            if a is None or a.ndim != 1 or a.dtype.kind not in "iu":
                raise PretrainDataError(f"{idx_path}: needs a 1-D integer array {key!r} (lens: each "
                                        "document's token count; docs: where each starts, then their number)")
        lens, docs = found["lens"], found["docs"]
        if lens.size == 0 or np.any(lens < 0):
            raise PretrainDataError(f"{idx_path}: 'lens' must hold at least one length, none negative")
        total = int(lens.sum(dtype=np.int64))
        if total != ids.size:
            raise PretrainDataError(f"{prefix}: {idx_path.name}'s lengths add up to {total} tokens, but "
                                    f"{ids_path.name} holds {ids.size}: the two files do not belong together")
        if docs.size < 1 or docs[0] != 0 or docs[-1] != lens.size or np.any(np.diff(docs) < 0):
            raise PretrainDataError(f"{idx_path}: 'docs' must run from 0 to len(lens) = {lens.size} without "
                                    "decreasing (where each document starts, then the count)")
        return cls(Path(prefix), ids, lens)

    def documents(self, part: Part, split: str) -> np.ndarray:
        """The entry ids of a split part (int32)."""
        b = split_bounds(split, self.lens.size)
        i = PARTS.index(part)
        return np.arange(b[i], b[i + 1], dtype=np.int32)

    def tokens(self, documents: np.ndarray) -> int:
        return int(self.lens[documents].sum(dtype=np.int64))

    def windows_per_pass(self, part: Part, split: str, seq_len: int) -> int:
        """Windows of one pass over a part: (tokens - 1) // seq_len (0 when it is empty)."""
        tokens = self.tokens(self.documents(part, split))
        return max(tokens - 1, 0) // seq_len

    def index(self, part: Part, split: str, seq_len: int, seed: int, num_samples: int) -> WindowIndex | None:
        """The part's index for `num_samples` windows; None when the part has no entries (PaddleNLP:
        no dataset)."""
        documents = self.documents(part, split)
        if documents.size == 0 or self.tokens(documents) == 0:
            return None
        return build_index(self.lens, documents, max(num_samples, 0), seq_len, seed)

    def window_tokens(self, index: WindowIndex, order: np.ndarray) -> np.ndarray:
        """int64 [len(order), L + 1]: the token ids of dataset windows `order` (positions in the
        dataset, i.e. through shuffle_idx)."""
        lengths = self.lens[index.doc_idx].astype(np.int64)
        ends = np.cumsum(lengths)
        first = index.shuffle_idx[np.asarray(order, np.int64)].astype(np.int64) * index.seq_len
        pos = first[:, None] + np.arange(index.seq_len + 1, dtype=np.int64)
        k = np.searchsorted(ends, pos, side="right")
        flat = self.starts[index.doc_idx[k]] + pos - (ends[k] - lengths[k])
        return np.asarray(self.ids[flat.ravel()], np.int64).reshape(pos.shape)

    def windows(self, part: Part, split: str, seq_len: int, seed: int, num_samples: int) -> np.ndarray:
        """The first `num_samples` windows of a part's dataset built for `num_samples` (int64
        [n, seq_len + 1]; [0, seq_len + 1] when the part is empty)."""
        index = self.index(part, split, seq_len, seed, num_samples)
        if index is None or num_samples <= 0:
            return np.zeros((0, seq_len + 1), np.int64)
        return self.window_tokens(index, np.arange(num_samples))


def _reason(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
