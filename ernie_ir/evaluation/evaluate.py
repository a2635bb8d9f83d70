"""`evaluate`: perplexity of a model (or artifact) over a corpus, and its KL against a reference."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.generation.decoders import Decoder, open_decoder
from ernie_ir.runtime.decoding import empty_cache

from .corpus import EvalError, check_window, read_corpus, windows
from .statistics import TokenStats, summarize, token_stats

LogitsFn = Callable[[np.ndarray], np.ndarray]
"""ids [B, L] -> logits [B, L, V] (float32), a whole window at once, no cache."""
Progress = Callable[[int, int], None]
"""progress(tokens scored so far, tokens to score)."""


@dataclass
class EvalReport:
    model: str
    reference: str | None
    seq_len: int
    stride: int
    documents: int
    windows: int
    seconds: float
    figures: dict[str, Any] = field(default_factory=dict)
    """summarize()'s figures: perplexity, mean_nll, tokens_scored, and with a reference kl_*, ..."""
    quant: str | None = None
    """`evaluate_quantized`: the --quant preset `model` was quantized with here (else None)."""

    def __getattr__(self, name: str) -> Any:
        figures = self.__dict__.get("figures", {})
        if name in figures:
            return figures[name]
        raise AttributeError(name)

    @property
    def tokens_per_s(self) -> float:
        return float(self.figures.get("tokens_scored", 0)) / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k != "figures" and (k != "quant" or v is not None)}
        data.update(self.figures)
        data["tokens_per_s"] = round(self.tokens_per_s, 2)
        return data


def full_logits(decoder: Decoder) -> LogitsFn:
    """The logits of whole windows from a decoder: an empty past (of the decoder's cache dtype),
    every position kept."""
    def run(ids: np.ndarray) -> np.ndarray:
        b, s = ids.shape
        feeds = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((b, s), np.int64),
                 "position_ids": np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy(),
                 **empty_cache(decoder.cache_layers, b, decoder.cache_dtype)}  # u8 for a C8 cache
        return np.asarray(decoder.step(feeds)["logits"], np.float32)
    return run


def _source(model: str | Path, backend: str, trust_pickle: bool) -> tuple[Decoder | None, LogitsFn]:
    decoder = open_decoder(model, backend, trust_pickle=trust_pickle)
    if decoder.step_here:
        return decoder, full_logits(decoder)
    # several Paddle ranks: one gloo process per rank and per call, scoring whole windows
    from ernie_ir.backends import open_backend

    session = open_backend(Path(model), backend)
    return decoder, lambda ids: session.logits(ids)


def evaluate(model: str | Path, data: str | Path, *, compare_to: str | Path | None = None,
             seq_len: int = 512, stride: int | None = None, max_tokens: int | None = None, batch: int = 1,
             backend: str = "interpreter", trust_pickle: bool = False,
             progress: Progress | None = None) -> EvalReport:
    """Score every token of `data` (see corpus.py for the windows) with `model` on `backend`;
    with `compare_to` (a MODEL or artifact, run by the interpreter, or on `backend` where that
    artifact offers it) also the KL statistics.

    EvalError (one line) before any window runs: a corpus with nothing to score, impossible
    window sizes, a vocabulary that differs from the reference's, text without a tokenizer."""
    from ernie_ir.frontends.tokenizer import load_tokenizer

    stride = seq_len if stride is None else stride
    if batch < 1:
        raise EvalError(f"--batch must be >= 1 (got {batch})")
    if max_tokens is not None and max_tokens < 2:
        raise EvalError(f"--max-tokens must be >= 2 (got {max_tokens})")
    decoder, logits_of = _source(model, backend, trust_pickle)
    assert decoder is not None
    reference = None
    if compare_to is not None:
        from ernie_ir.backends import reference_backend

        # a reference artifact offering this backend runs on it (a model compared with itself agrees)
        ref = open_decoder(compare_to, reference_backend(compare_to, backend), trust_pickle=trust_pickle)
        if ref.vocab_size != decoder.vocab_size:
            raise EvalError(f"{model} has a vocabulary of {decoder.vocab_size} tokens but --compare-to "
                            f"{compare_to} has {ref.vocab_size}: compare models of the same tokenizer")
        reference = full_logits(ref)
    tokenizer = load_tokenizer(decoder.folder) if decoder.folder is not None else None
    corpus = read_corpus(data, tokenizer.encode if tokenizer is not None else None, decoder.vocab_size,
                         max_tokens)
    check_window(seq_len, stride, decoder.context_length, corpus)

    jobs = [(w, first) for doc in corpus.documents for w, first in windows(doc, seq_len, stride)]
    total = sum(len(w) - first for w, first in jobs)
    by_len: dict[int, list[tuple[list[int], int]]] = {}
    for job in jobs:
        by_len.setdefault(len(job[0]), []).append(job)
    stats = TokenStats()
    done = 0
    start = time.perf_counter()
    if progress is not None:
        progress(0, total)
    for group in by_len.values():
        for i in range(0, len(group), batch):
            chunk = group[i:i + batch]
            ids = np.asarray([w for w, _ in chunk], np.int64)
            logits = logits_of(ids)
            ref_logits = reference(ids) if reference is not None else None
            for r, (w, first) in enumerate(chunk):
                pos = np.arange(first, len(w))  # scored tokens; predicted at pos - 1
                stats.add(token_stats(logits[r, pos - 1], np.asarray(w)[pos],
                                      None if ref_logits is None else ref_logits[r, pos - 1]))
                done += len(pos)
            if progress is not None:
                progress(done, total)
    return EvalReport(model=str(model), reference=None if compare_to is None else str(compare_to),
                      seq_len=seq_len, stride=stride, documents=len(corpus.documents), windows=len(jobs),
                      seconds=time.perf_counter() - start, figures=summarize(stats))


@dataclass(frozen=True)
class Scoring:
    """How a corpus is scored: windows of `seq_len` tokens every `stride` (None: seq_len), at
    most `max_tokens` scored (None: all), `batch` windows per call (`evaluate`'s arguments)."""

    seq_len: int = 512
    stride: int | None = None
    max_tokens: int | None = None
    batch: int = 1


def evaluate_quantized(model: str | Path, data: str | Path, quants: Sequence[str], *,
                       target: str = "cuda", cuda_arch: int | None = None,
                       calib_data: str | Path | None = None, compare_to: str | Path | None = None,
                       scoring: Scoring = Scoring(), trust_pickle: bool = False,
                       progress: Progress | None = None) -> list[EvalReport]:
    """`evaluate` each quantization of the float `model` against `compare_to` (default: `model`
    itself): per preset (`wint4`, `wint8mix`, `w4a8c8`, `wint2{w4_end_layer=1}`, ...) the artifact
    `compile --target target --quant Q` writes (one rank; in a temporary folder, removed after),
    run by the interpreter. `calib_data` (a .npy of token ids) goes to the calibrated presets
    (w4a8c8, fp8) only; the others have no static activation scales. One report per preset, in
    order, `quant` naming it. Bad presets and options are refused (one line) before any compile."""
    reference = model if compare_to is None else compare_to
    reports: list[EvalReport] = []
    for q, art in quantized_artifacts(model, quants, target=target, cuda_arch=cuda_arch,
                                      calib_data=calib_data, trust_pickle=trust_pickle):
        report = evaluate(art, data, compare_to=reference, seq_len=scoring.seq_len, stride=scoring.stride,
                          max_tokens=scoring.max_tokens, batch=scoring.batch, trust_pickle=trust_pickle,
                          progress=progress)
        reports.append(replace(report, model=str(model), quant=q))
    return reports


def quantized_artifacts(model: str | Path, quants: Sequence[str], *, target: str = "cuda",
                        cuda_arch: int | None = None, calib_data: str | Path | None = None,
                        trust_pickle: bool = False) -> Iterator[tuple[str, Path]]:
    """(preset, artifact folder) per preset of `quants`, in order: `model` compiled by `compile
    --target target --quant Q` (one rank, emit paddle) into a temporary folder that is removed
    once the caller moves on. Every preset and `calib_data` is checked (EvalError, one line)
    before the first compile."""
    import shutil
    import tempfile

    from ernie_ir.passes.quant.cli_flags import CALIBRATED, NO_QUANT, pipeline_for
    from ernie_ir.passes.quant.config import preset_method, resolve_quant_name
    from ernie_ir.targets.compile import CompileOptions, compile_model

    if not quants:
        raise EvalError("give at least one --quant preset to evaluate")
    calib = Path(calib_data) if calib_data is not None else None

    def calibrates(q: str) -> bool:  # static activation scales, or weights by a calibrated method
        if q.strip().lower() in NO_QUANT:
            return False
        if resolve_quant_name(q) in CALIBRATED:
            return True
        method = preset_method(q)
        return method is not None and method.calibrated

    if calib is not None and not any(calibrates(q) for q in quants):
        raise EvalError(f"--calib-data calibrates static activation scales or method=gptq weights: none of "
                        f"--quant {', '.join(quants)} has any (it applies to {' or '.join(CALIBRATED)} and "
                        "'wint4{method=gptq}')")
    for q in quants:  # every preset's flags checked before the first compile
        pipeline_for(q, None, None, None, None, None, calib_data=calib if calibrates(q) else None)
    work = Path(tempfile.mkdtemp(prefix="ernie-ir-eval-"))
    try:
        for i, q in enumerate(quants):
            art = compile_model(str(model), target, CompileOptions(quant=q, cuda_arch=cuda_arch,
                                out=work / f"q{i}", emit="paddle", trust_pickle=trust_pickle,
                                calib_data=calib if calibrates(q) else None))
            yield q, Path(art.out)
            shutil.rmtree(work / f"q{i}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
