"""WikiText perplexity, as PaddleNLP's `slm/examples/benchmark/wiki_lambada/eval.py` (without
`--cloze_eval`) defines it (REFERENCE.md 17).

The whole file is one text: `original` = the number of its space-separated words (before
detokenizing), then it is detokenized (`detokenize`, the script's `wikitext_detokenizer`) and
encoded at once into N tokens. Window i starts at token i * O (O: `--overlapping_eval`, here
--stride) and holds up to L + 1 tokens (L: --seq-len); past the text's end it is padded with the
pad token (the tokenizer's EOS, else `<pad>`). Position j of a window predicts its token j + 1;
window 0 scores every position, every later window its last O only (the script's loss mask), and
no position whose input is the pad token. There are max(ceil(max(N - 1 - O, 0) / O) + 1, 1)
windows. So each token after the first is scored once and, as in the script, the window that
runs past the end also scores predicting the pad token after the last one.

    avg_loss           = summed cross-entropy / (N - 1)
    perplexity         = exp(min(20, avg_loss))
    token_ratio        = (N - 1) / (original - 1)
    adjusted_perplexity = exp(min(20, avg_loss * token_ratio))
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator

import numpy as np

from .statistics import log_softmax

LogitsFn = Callable[[np.ndarray], np.ndarray]

# the script's `wikitext_detokenizer`, rule for rule and in its order: (old, new, is a regex)
_RULES = [("s '", "s'", False), (r"/' [0-9]/", r"/'[0-9]/", True),
          (" @-@ ", "-", False), (" @,@ ", ",", False), (" @.@ ", ".", False),
          (" : ", ": ", False), (" ; ", "; ", False), (" . ", ". ", False), (" ! ", "! ", False),
          (" ? ", "? ", False), (" , ", ", ", False),
          (r"\(\s*([^\)]*?)\s*\)", r"(\1)", True), (r"\[\s*([^\]]*?)\s*\]", r"[\1]", True),
          (r"{\s*([^}]*?)\s*}", r"{\1}", True), (r"\"\s*([^\"]*?)\s*\"", r'"\1"', True),
          (r"'\s*([^']*?)\s*'", r"'\1'", True),
          ("= = = =", "====", False), ("= = =", "===", False), ("= =", "==", False),
          (" \u00b0 ", "\u00b0", False), (" \n", "\n", False), ("\n ", "\n", False), (" N ", " 1 ", False),
          (" 's", "'s", False)]


def detokenize(text: str) -> str:
    """WikiText's tokenized text as prose (the script's `wikitext_detokenizer`)."""
    for old, new, regex in _RULES:
        text = re.sub(old, new, text) if regex else text.replace(old, new)
    return text


def original_words(text: str) -> int:
    """The script's count of the raw text's tokens: its space-separated fields after strip()."""
    return len(text.strip().split(" "))


def window_count(n_tokens: int, overlap: int) -> int:
    return max(math.ceil(max(n_tokens - 1 - overlap, 0) / overlap) + 1, 1)


def scored_windows(ids: list[int], seq_len: int, overlap: int,
                   pad_id: int) -> Iterator[tuple[list[int], list[int], np.ndarray]]:
    """(inputs, targets, scored positions) of every window that scores something. `inputs` stop
    at the text's end (causal attention: the padding after it changes no scored logit)."""
    for i in range(window_count(len(ids), overlap)):
        chunk = ids[i * overlap:i * overlap + seq_len + 1]
        inputs = chunk[:seq_len]
        targets = chunk[1:] + ([] if len(chunk) > seq_len else [pad_id])
        j = np.arange(len(inputs))
        keep = np.asarray(inputs) != pad_id
        if i > 0 and overlap != seq_len:
            keep &= j >= seq_len - overlap
        if keep.any():
            yield inputs, targets, j[keep]


def summed_loss(logits_of: LogitsFn, ids: list[int], seq_len: int, overlap: int, pad_id: int,
                batch: int = 1, progress: Callable[[int, int], None] | None = None) -> tuple[float, int]:
    """(summed cross-entropy of the scored positions, windows run)."""
    jobs = list(scored_windows(ids, seq_len, overlap, pad_id))
    by_len: dict[int, list[tuple[list[int], list[int], np.ndarray]]] = {}
    for job in jobs:
        by_len.setdefault(len(job[0]), []).append(job)
    total, done = 0.0, 0
    if progress is not None:
        progress(0, len(jobs))
    for group in by_len.values():
        for k in range(0, len(group), batch):
            chunk = group[k:k + batch]
            logits = logits_of(np.asarray([inputs for inputs, _, _ in chunk], np.int64))
            for r, (_, targets, pos) in enumerate(chunk):
                lp = log_softmax(logits[r, pos])
                total -= float(lp[np.arange(len(pos)), np.asarray(targets)[pos]].sum())
            done += len(chunk)
            if progress is not None:
                progress(done, len(jobs))
    return total, len(jobs)


def perplexity_figures(loss_sum: float, n_tokens: int, n_original: int) -> dict[str, float]:
    """The script's figures from the summed loss (see the module docstring)."""
    avg = loss_sum / (n_tokens - 1)
    ratio = (n_tokens - 1) / (n_original - 1)
    return {"avg_loss": avg, "perplexity": math.exp(min(20.0, avg)), "token_ratio": ratio,
            "adjusted_perplexity": math.exp(min(20.0, avg * ratio))}
