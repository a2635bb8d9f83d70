"""`compare_to`: generated tokens against a reference model run teacher-forced on them.

The reference (e.g. the float model behind a quantized artifact) reads each row's prompt and
new tokens as one full sequence, without a cache; at every generated position its greedy choice
is compared with the token that was generated there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ernie_ir.runtime.decoding import DecodeResult


@dataclass(frozen=True)
class Comparison:
    reference: str
    first_divergence: list[int | None]
    """Per row: the first generated step (0-based) whose token is not the reference's greedy
    choice; None where every step agrees."""
    agreement: list[float]
    """Per row: the fraction of generated steps where the tokens agree."""

    @property
    def mean_agreement(self) -> float:
        return float(np.mean(self.agreement)) if self.agreement else 1.0


def compare_to(reference: str | Path, result: DecodeResult, *, trust_pickle: bool = False) -> Comparison:
    """Teacher-force `reference` (a MODEL or artifact, on the interpreter) on `result`'s sequences."""
    run = _reference_logits(reference, trust_pickle)
    firsts: list[int | None] = []
    agree: list[float] = []
    for prompt, new in zip(result.prompts, result.new_tokens, strict=True):
        if not new:
            firsts.append(None)
            agree.append(1.0)
            continue
        seq = np.asarray([prompt + new[:-1]], np.int64)
        logits = run(seq)[0]
        choice = np.argmax(logits[len(prompt) - 1:], axis=-1)
        same = choice == np.asarray(new)
        bad = np.flatnonzero(~same)
        firsts.append(int(bad[0]) if bad.size else None)
        agree.append(float(same.mean()))
    return Comparison(str(reference), firsts, agree)


def _reference_logits(reference: str | Path, trust_pickle: bool) -> Callable[[np.ndarray], np.ndarray]:
    """Logits [B, S, V] of `reference` for token ids [B, S] on the interpreter: an artifact runs
    whole (every rank graph: its rank-0 graph alone may be a shard or the first pipeline stage)."""
    if (Path(reference) / "manifest.json").is_file():
        from ernie_ir.backends import open_backend

        return open_backend(Path(reference), "interpreter").logits  # its hashes checked once
    from ernie_ir.load import load_input
    from ernie_ir.runtime import Interpreter

    graph = load_input(str(reference), trust_pickle=trust_pickle)
    it = Interpreter(graph)
    name, out = graph.inputs[0].name, graph.output_names[0]
    return lambda ids: it.run({name: ids})[out]
