"""LAMBADA cloze accuracy, as PaddleNLP's `slm/examples/benchmark/wiki_lambada/eval.py --cloze_eval`
defines it (REFERENCE.md 17).

Per example, with `encode` the model's tokenizer (special tokens added as its config says):

    last  = text.split()[-1]
    begin = encode(text[:text.rfind(last)].strip())
    label = encode(text.strip())[len(begin):]
    input = begin[:seq_len] + label

The example is correct when, teacher-forced over `input`, the argmax of the logits before every
label token is that token. accuracy = correct / examples. The script counts an example with no
label position to score (an empty label, or an empty `begin` before a one-token label) as
correct; so does this module, and `unscored` says how many there were.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ernie_ir.ir.inputs import loads_json, read_text

from .corpus import EvalError

LogitsFn = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class ClozeExample:
    line: int
    """Line number in the data file (for messages)."""
    begin: list[int]
    label: list[int]

    def ids(self, seq_len: int) -> list[int]:
        """The teacher-forced sequence: `begin` cut to `seq_len` tokens, then the label."""
        return self.begin[:seq_len] + self.label

    def scored(self, seq_len: int) -> bool:
        """Whether any label token has a position before it to be predicted at."""
        return bool(self.label) and len(self.begin[:seq_len]) > 0


def split_cloze(text: str, encode: Callable[[str], list[int]]) -> tuple[list[int], list[int]]:
    """(begin, label) token ids of one LAMBADA text (the module docstring's `get_tokens`)."""
    last = text.split()[-1]
    begin = encode(text[:text.rfind(last)].strip())
    return begin, encode(text.strip())[len(begin):]


def read_cloze(path: str | Path, encode: Callable[[str], list[int]]) -> list[ClozeExample]:
    """The examples of a LAMBADA JSON Lines file (`{"text": ...}` per line; blank lines skipped).
    EvalError names the file and line of a line without text, and a file without examples."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"--data {p}: no such file")
    examples = []
    for n, line in enumerate(read_text(p, "LAMBADA file", EvalError).splitlines(), 1):
        if not line.strip():
            continue
        row = loads_json(line, f"--data {p}: line {n}", EvalError, fix='write one {"text": ...} per line')
        text = row.get("text") if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.split():
            raise EvalError(f'--data {p}: line {n} has no text: write {{"text": "..."}} with the passage '
                            "and its last word")
        begin, label = split_cloze(text, encode)
        examples.append(ClozeExample(n, begin, label))
    if not examples:
        raise EvalError(f'--data {p} holds no example: write one {{"text": ...}} per line')
    return examples


def check_lengths(examples: list[ClozeExample], seq_len: int, context_length: int | None, path: str) -> None:
    """EvalError for a --seq-len below 1 or an input longer than the model's positions."""
    if seq_len < 1:
        raise EvalError(f"--seq-len must be >= 1 (got {seq_len})")
    if context_length is None:
        return
    for ex in examples:
        n = len(ex.ids(seq_len)) - 1  # the last token is only predicted, never fed
        if n > context_length:
            raise EvalError(f"--data {path}: line {ex.line} is {n} tokens long with --seq-len {seq_len}, "
                            f"beyond the model's {context_length} positions: lower --seq-len")


def cloze_correct(logits_of: LogitsFn, examples: list[ClozeExample], seq_len: int, batch: int = 1,
                  progress: Callable[[int, int], None] | None = None) -> list[bool]:
    """Per example, whether the model predicts its whole label (teacher-forced). Inputs of the
    same length run `batch` at a time."""
    correct = [True] * len(examples)  # unscored examples count as correct, as the script counts them
    by_len: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        if ex.scored(seq_len):
            by_len.setdefault(len(ex.ids(seq_len)), []).append(i)
    done, total = 0, sum(len(v) for v in by_len.values())
    if progress is not None:
        progress(0, total)
    for group in by_len.values():
        for k in range(0, len(group), batch):
            chunk = group[k:k + batch]
            ids = np.asarray([examples[i].ids(seq_len) for i in chunk], np.int64)
            top = np.argmax(logits_of(ids[:, :-1]), axis=-1)  # [B, L - 1]: the prediction of token j + 1
            for r, i in enumerate(chunk):
                n_label = len(examples[i].label)
                correct[i] = bool(np.array_equal(top[r, -n_label:], ids[r, -n_label:]))
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return correct
