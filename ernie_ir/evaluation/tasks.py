"""`eval --task lambada|wikitext`: the two benchmarks of PaddleNLP's wiki_lambada/eval.py on a model
or artifact, against a reference model, or for each --quant preset side by side.

    from ernie_ir.evaluation.tasks import TaskSpec, evaluate_task
    report = evaluate_task("art/cuda-wint8", "lambada_test.jsonl", TaskSpec("lambada"))
    report.figures["accuracy"], report.figures["correct"], report.figures["examples"]

Each model is scored with its own tokenizer (the checkpoint's, or the one an artifact carries); the
definitions are cloze.py's and wikitext.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .cloze import check_lengths, cloze_correct, read_cloze
from .corpus import EvalError
from .wikitext import detokenize as wikitext_detokenize
from .wikitext import original_words, perplexity_figures, summed_loss

TASKS = ("perplexity", "lambada", "wikitext")
"""`perplexity` is `evaluate`'s own corpus perplexity and KL; the other two are this module's."""
OVERLAPPING_EVAL = 32
"""The script's default `--overlapping_eval`: --task wikitext's default --stride."""
_COMPARED = {"lambada": ("accuracy", "correct"),
             "wikitext": ("avg_loss", "perplexity", "adjusted_perplexity")}

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class TaskSpec:
    """What a task run scores: `task` (lambada or wikitext), --seq-len, --stride (wikitext's
    window step, the script's --overlapping_eval; default 32) and --batch."""

    task: str
    seq_len: int = 512
    stride: int | None = None
    batch: int = 1

    def __post_init__(self) -> None:
        """EvalError, one line, for an unknown task and values the task cannot take."""
        if self.task not in TASKS[1:]:
            from ernie_ir.ir.suggest import did_you_mean

            if self.task == TASKS[0]:
                raise EvalError("--task perplexity is the corpus perplexity: call evaluate() for it")
            raise EvalError(f"unknown --task {self.task!r}{did_you_mean(self.task, TASKS)}: give "
                            f"{', '.join(TASKS[:-1])} or {TASKS[-1]}")
        if self.stride is not None and self.task == "lambada":
            raise EvalError("--stride steps WikiText's windows: --task lambada scores one input per example; "
                            "drop --stride")
        if self.batch < 1:
            raise EvalError(f"--batch must be >= 1 (got {self.batch})")
        if self.seq_len < 1:
            raise EvalError(f"--seq-len must be >= 1 (got {self.seq_len})")
        if self.task == "wikitext" and not 0 < self.overlap <= self.seq_len:
            raise EvalError(f"--stride must be in [1, --seq-len {self.seq_len}] (got {self.overlap}; the "
                            f"default is {OVERLAPPING_EVAL})")

    @classmethod
    def from_flags(cls, task: str, seq_len: int, stride: int | None, max_tokens: int | None,
                   batch: int) -> TaskSpec:
        """The spec of `eval --task` (EvalError, one line, also for --max-tokens, which only the
        corpus perplexity takes)."""
        if max_tokens is not None and task in TASKS[1:]:
            raise EvalError(f"--max-tokens cuts a --task perplexity corpus: --task {task} scores the whole "
                            "file, as PaddleNLP's eval.py does; drop --max-tokens")
        return cls(task, seq_len, stride, batch)

    @property
    def overlap(self) -> int:
        return OVERLAPPING_EVAL if self.stride is None else self.stride


@dataclass
class TaskReport:
    task: str
    model: str
    seq_len: int
    seconds: float
    figures: dict[str, Any] = field(default_factory=dict)
    """lambada: accuracy, correct, examples, unscored; wikitext: avg_loss, perplexity, token_ratio,
    adjusted_perplexity, tokens, original_tokens, windows, overlapping_eval. With a reference, its
    figures again with the suffix `_reference` (accuracy_reference, perplexity_reference, ...)."""
    reference: str | None = None
    quant: str | None = None

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"task": self.task, "model": self.model, "reference": self.reference}
        if self.quant is not None:
            data["quant"] = self.quant
        return {**data, "seq_len": self.seq_len, "seconds": round(self.seconds, 3), **self.figures}


def evaluate_task(model: str | Path, data: str | Path, spec: TaskSpec, *,
                  compare_to: str | Path | None = None, backend: str = "interpreter",
                  trust_pickle: bool = False, progress: Progress | None = None) -> TaskReport:
    """`spec.task` on `model` (a MODEL or artifact, run on `backend`); with `compare_to` also on that
    reference (the interpreter, or `backend` where the reference artifact offers it).

    EvalError (one line) before a model runs: a missing or empty file, a line without text, a
    model without tokenizer, an input beyond the model's positions."""
    from ernie_ir.backends import reference_backend

    start = time.perf_counter()
    figures = _score(model, data, spec, backend, trust_pickle, progress)
    if compare_to is not None:
        ref = _score(compare_to, data, spec, reference_backend(compare_to, backend), trust_pickle, progress)
        figures.update({f"{k}_reference": ref[k] for k in _COMPARED[spec.task]})
    return TaskReport(spec.task, str(model), spec.seq_len, time.perf_counter() - start, figures,
                      None if compare_to is None else str(compare_to))


def evaluate_task_quantized(model: str | Path, data: str | Path, spec: TaskSpec, quants: Sequence[str], *,
                            target: str = "cuda", cuda_arch: int | None = None,
                            calib_data: str | Path | None = None, compare_to: str | Path | None = None,
                            trust_pickle: bool = False, progress: Progress | None = None) -> list[TaskReport]:
    """`spec.task` on each preset's artifact of the float `model` (evaluate.quantized_artifacts:
    the interpreter runs it), each report also holding the figures of `compare_to` (default:
    `model` itself), scored once, after the presets are checked and before the first runs."""
    from .evaluate import quantized_artifacts

    reference = model if compare_to is None else compare_to
    presets = quantized_artifacts(model, quants, target=target, cuda_arch=cuda_arch, calib_data=calib_data,
                                  trust_pickle=trust_pickle)
    _require_file(data)
    ref: dict[str, Any] = {}
    reports = []
    for q, art in presets:  # the first step checks every preset, before any compile
        if not ref:
            ref = _score(reference, data, spec, "interpreter", trust_pickle, progress)
        report = evaluate_task(art, data, spec, trust_pickle=trust_pickle, progress=progress)
        report.figures.update({f"{k}_reference": ref[k] for k in _COMPARED[spec.task]})
        reports.append(replace(report, model=str(model), reference=str(reference), quant=q))
    return reports


def _score(model: str | Path, data: str | Path, spec: TaskSpec, backend: str, trust_pickle: bool,
           progress: Progress | None) -> dict[str, Any]:
    """The task's figures for one model."""
    from ernie_ir.frontends.tokenizer import load_tokenizer

    from .evaluate import _source

    _require_file(data)
    decoder, logits_of = _source(model, backend, trust_pickle)
    assert decoder is not None
    tokenizer = load_tokenizer(decoder.folder) if decoder.folder is not None else None
    if tokenizer is None:
        raise EvalError(f"--task {spec.task} reads text, and {model} has no tokenizer: evaluate the "
                        "checkpoint folder that holds one (or an artifact compiled from it)")
    if spec.task == "lambada":
        examples = read_cloze(data, tokenizer.encode)
        check_lengths(examples, spec.seq_len, decoder.context_length, str(data))
        correct = cloze_correct(logits_of, examples, spec.seq_len, spec.batch, progress)
        return {"accuracy": sum(correct) / len(correct), "correct": sum(correct), "examples": len(correct),
                "unscored": sum(not ex.scored(spec.seq_len) for ex in examples)}
    return _wikitext(logits_of, tokenizer, data, spec, decoder.context_length, progress)


def _require_file(data: str | Path) -> None:
    if not Path(data).is_file():
        raise EvalError(f"--data {data}: no such file")


def _wikitext(logits_of: Callable[..., Any], tokenizer: Any, data: str | Path, spec: TaskSpec,
              context_length: int | None, progress: Progress | None) -> dict[str, Any]:
    from ernie_ir.ir.inputs import read_text

    text = read_text(data, "WikiText file", EvalError)
    words = original_words(text)
    ids = tokenizer.encode(wikitext_detokenize(text))
    if words < 2 or len(ids) < 2:
        raise EvalError(f"--data {data} has {min(words, len(ids))} token(s): --task wikitext needs at "
                        "least 2 words of text (e.g. wiki.valid.tokens)")
    if context_length is not None and min(spec.seq_len, len(ids)) > context_length:
        raise EvalError(f"--seq-len {spec.seq_len} is beyond the model's {context_length} positions: "
                        "lower it")
    pad_id = _pad_id(tokenizer)
    loss, windows = summed_loss(logits_of, ids, spec.seq_len, spec.overlap, pad_id, spec.batch, progress)
    return {**perplexity_figures(loss, len(ids), words), "tokens": len(ids), "original_tokens": words,
            "windows": windows, "overlapping_eval": spec.overlap}


def _pad_id(tokenizer: Any) -> int:
    """The script's pad token: the EOS token, else `<pad>` (unknown: the unk token's id)."""
    for candidate in (tokenizer.eos_token_id, tokenizer.token_to_id("<pad>"),
                      tokenizer.token_to_id(tokenizer.special_token("unk_token") or "<unk>")):
        if candidate is not None:
            return int(candidate)
    raise EvalError("--task wikitext pads with the tokenizer's EOS, <pad> or <unk> token and this tokenizer "
                    "has none of them: evaluate a checkpoint whose tokenizer names its eos_token")
