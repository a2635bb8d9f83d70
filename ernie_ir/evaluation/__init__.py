"""Measuring a model's quality as users measure it: perplexity over a corpus and, against a
reference model, the KL divergence of their next-token distributions (llama.cpp's statistics).

    from ernie_ir.evaluation import evaluate
    report = evaluate("art/cuda-wint4", "wiki.jsonl", compare_to="/data/ERNIE-4.5-0.3B-Paddle")
    report.perplexity, report.kl_mean, report.top1_agreement
    rows = evaluate_quantized("model/", "wiki.jsonl", ["wint4", "wint8mix", "w4a8c8", "wint2"])
    [(r.quant, r.kl_mean) for r in rows]     # each preset's artifact against the float model
    evaluate_task("model/", "lambada_test.jsonl", TaskSpec("lambada")).figures["accuracy"]

Layer (docs/architecture.md): beside `generation`: it runs models with `runtime` (artifacts on
their backends), reads text with the frontends' tokenizers and MODEL arguments with `load`.
"""

from __future__ import annotations

from .corpus import Corpus, EvalError, read_corpus, windows
from .evaluate import EvalReport, Scoring, evaluate, evaluate_quantized
from .statistics import TokenStats, summarize, token_stats
from .tasks import TaskReport, TaskSpec, evaluate_task, evaluate_task_quantized

__all__ = ["Corpus", "EvalError", "EvalReport", "Scoring", "TaskReport", "TaskSpec", "TokenStats", "evaluate",
           "evaluate_quantized", "evaluate_task", "evaluate_task_quantized", "read_corpus", "summarize",
           "token_stats", "windows"]
