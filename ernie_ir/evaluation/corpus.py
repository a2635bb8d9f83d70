"""The evaluation corpus: documents of token ids, and the windows that score each token once.

A corpus file is JSON Lines (one document per line: an object with `text` or `input_ids`, a
string, or a list of ids) or plain text (`.txt`: the whole file is one document). Text needs the
model's tokenizer. Windows never cross documents.

Windows follow HF's perplexity guide ("strided sliding window", L = seq_len, S = stride <= L):
each window scores only the tokens no earlier window scored, so with S < L every token but a
document's first is scored exactly once, with at least L - S tokens of context except at the
start of a document (see `windows`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.inputs import read_text, read_text_or_ids_lines


class EvalError(ErnieIRError):
    """An evaluation that cannot run (one line: what and how to fix it)."""


@dataclass(frozen=True)
class Corpus:
    documents: list[list[int]]

    @property
    def tokens(self) -> int:
        return sum(len(d) for d in self.documents)


def read_corpus(path: str | Path, encode: Callable[[str], list[int]] | None,
                vocab_size: int | None = None, max_tokens: int | None = None) -> Corpus:
    """The documents of `path`; `encode` turns text into ids (None: the model has no tokenizer,
    and text is refused). `max_tokens`: stop once that many tokens are read (the last document
    cut). EvalError names the file and line of anything malformed."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"--data {p}: no such file")
    text = read_text(p, "corpus", EvalError)

    def tokens_of(s: str, where: str) -> list[int]:
        if encode is None:
            raise EvalError(f"{where} is text, and the model has no tokenizer: give input_ids instead "
                            "(or evaluate the checkpoint folder that holds the tokenizer)")
        return encode(s)

    docs: list[list[int]] = []
    if p.suffix == ".txt":
        docs = [tokens_of(text, f"--data {p}")] if text.strip() else []
    else:
        for n, item in read_text_or_ids_lines(p, "corpus", "text", "input_ids", EvalError):
            where = f"--data {p}: line {n}"
            ids = tokens_of(item, where) if isinstance(item, str) else item
            bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if bad:
                raise EvalError(f"{where}: token id {bad[0]} is outside the model's vocabulary "
                                f"[0, {vocab_size})")
            docs.append(ids)
    if max_tokens is not None:
        kept, left = [], max_tokens
        for d in docs:
            if left <= 0:
                break
            kept.append(d[:left])
            left -= len(kept[-1])
        docs = kept
    return Corpus([d for d in docs if d])


def windows(document: list[int], seq_len: int, stride: int) -> Iterator[tuple[list[int], int]]:
    """(window ids, index in the window of its first scored token) over one document.

    Windows end at L, L + S, L + 2S, ... (the last at the document's end) and are L tokens long
    (shorter at the start); each scores the tokens after the previous window's end. So with
    S < L every token but the document's first is scored once, after at least L - S tokens of
    context; with S = L (disjoint chunks, as llama.cpp and HF's guide at stride = L) a chunk's
    first token has no context in its chunk and is not scored."""
    n = len(document)
    prev_end = 0
    end = min(seq_len, n)
    while True:
        start = max(0, end - seq_len)
        first = max(prev_end, start + 1)
        if first < end:
            yield document[start:end], first - start
        if end >= n:
            break
        prev_end, end = end, min(end + stride, n)


def check_window(seq_len: int, stride: int, context_length: int | None, corpus: Corpus) -> None:
    """EvalError for impossible window sizes or a corpus with nothing to score."""
    if seq_len < 2:
        raise EvalError(f"--seq-len must be >= 2 (got {seq_len}): a window scores its tokens after the first")
    if not 0 < stride <= seq_len:
        raise EvalError(f"--stride must be in [1, --seq-len {seq_len}] (got {stride})")
    if context_length is not None and seq_len > context_length:
        raise EvalError(f"--seq-len {seq_len} is beyond the model's {context_length} positions: lower it")
    scored = sum(max(len(d) - 1, 0) for d in corpus.documents)
    if scored == 0:
        raise EvalError("the corpus has no token to score (every document is shorter than 2 tokens): give "
                        "more text")
