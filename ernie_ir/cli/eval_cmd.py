"""`ernie-ir eval`: perplexity over a corpus, and KL statistics against a reference model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import ModelArg, TrustOpt, err, out


def eval_cmd(
    model: ModelArg,
    data: Annotated[Path, typer.Option("--data", help="Corpus: .jsonl (per line {\"text\": ...} or "
                                       "{\"input_ids\": [...]}: one document) or .txt (one document).")],
    compare_to: Annotated[str | None, typer.Option("--compare-to", help="Reference MODEL (e.g. the float "
                                                   "checkpoint): KL, top-1 agreement, delta-p.")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per window.")] = 512,
    stride: Annotated[int | None, typer.Option("--stride", help="Window step (default --seq-len); each "
                                               "token is scored once, after >= seq-len - stride tokens "
                                               "of context.")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="Read at most this many tokens "
                                                   "of the corpus.")] = None,
    batch: Annotated[int, typer.Option("--batch", help="Windows per forward.")] = 1,
    backend: Annotated[str, typer.Option("--backend", help="interpreter, or for an artifact: onnxruntime "
                                         "or paddle.")] = "interpreter",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    show_progress: Annotated[bool, typer.Option("--progress", help="Draw a progress bar (tokens/s, "
                                                "ETA) on stderr.")] = False,
    trust_pickle: TrustOpt = False,
) -> None:
    """Perplexity of a model or artifact over a corpus; with --compare-to, llama.cpp's KL statistics."""
    import json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ernie_ir.evaluation import evaluate

    with Progress(TextColumn("tokens"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"),
                  TimeRemainingColumn(), console=err.get(), transient=True,
                  disable=not show_progress) as bar:
        task = bar.add_task("eval", total=None, rate="")

        def progress(done: int, total: int) -> None:
            speed = bar.tasks[0].speed
            bar.update(task, completed=done, total=total, rate=f"{speed:.0f} tok/s" if speed else "")

        report = evaluate(model, data, compare_to=compare_to, seq_len=seq_len, stride=stride,
                          max_tokens=max_tokens, batch=batch, backend=backend, trust_pickle=trust_pickle,
                          progress=progress)
    data_out = report.as_dict()
    if json_out:
        print(json.dumps(data_out))
        return
    f = report.figures
    lo, hi = f["perplexity_ci95"]
    out.print(f"{report.model}: perplexity {f['perplexity']:.4f} (95% {lo:.4f} .. {hi:.4f}), mean NLL "
              f"{f['mean_nll']:.5f} over {f['tokens_scored']} tokens ({report.documents} documents, "
              f"{report.windows} windows of {report.seq_len}, stride {report.stride})", markup=False)
    if report.reference is not None:
        rlo, rhi = f["perplexity_reference_ci95"]
        out.print(f"{report.reference}: perplexity {f['perplexity_reference']:.4f} (95% {rlo:.4f} .. "
                  f"{rhi:.4f})", markup=False)
        out.print(f"KL(reference || model): mean {f['kl_mean']:.6f}, median {f['kl_median']:.6f}, p99 "
                  f"{f['kl_p99']:.6f}, p99.9 {f['kl_p999']:.6f}, max {f['kl_max']:.6f}", markup=False)
        out.print(f"same top token {f['top1_agreement']:.2%}, RMS delta-p {f['rms_delta_p']:.6f}",
                  markup=False)
    err.print(f"{report.tokens_per_s:.1f} tokens/s ({backend})", markup=False)
