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


def sensitivity_cmd(
    model: ModelArg,
    data: Annotated[Path, typer.Option("--data", help="Calibration corpus (.jsonl or .txt, as eval reads).")],
    fmt: Annotated[str, typer.Option("--format", help="int4 or int8: what each unit is quantized "
                                     "to.")] = "int4",
    mode: Annotated[str, typer.Option("--mode", help="exact (KL end to end, one forward per unit), approx "
                                      "(each unit's output error, one forward) or both.")] = "both",
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per calibration window.")] = 128,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Calibration tokens read.")] = 512,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write an SVG bar chart of the costs.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Quantize one unit at a time (a linear, or one layer's routed experts) and rank the units by cost."""
    import json

    from rich.table import Table

    from ernie_ir.evaluation.sensitivity import sensitivity, svg_bars
    from ernie_ir.ir import ErnieIRError

    if plot is not None and not plot.parent.is_dir():
        raise ErnieIRError(f"--plot {plot}: folder {plot.parent} does not exist")
    report = sensitivity(model, data, fmt=fmt, seq_len=seq_len, max_tokens=max_tokens, mode=mode)
    if plot is not None:
        from ernie_ir.ir.storage import write_text_atomic

        write_text_atomic(plot, svg_bars(report))
    if json_out:
        print(json.dumps(report.as_dict()))
        return
    table = Table(title=f"{model}: one unit {fmt}, the rest float ({report.tokens} tokens)")
    for col in ("unit", "kind", "params", "KL (exact)", "output error (approx)"):
        table.add_column(col, justify="left" if col in ("unit", "kind") else "right")
    for u in report.units:
        table.add_row(u.unit, u.kind, str(u.params), f"{u.kl:.4g}", f"{u.approx:.4g}")
    out.print(table)
    if report.spearman is not None:
        out.print(f"rank agreement of approx and exact (Spearman): {report.spearman:.3f}", markup=False)


def tune_cmd(
    model: ModelArg,
    data: Annotated[Path, typer.Option("--data", help="Calibration corpus (.jsonl or .txt, as eval reads).")],
    budget: Annotated[float, typer.Option("--budget", help="The mean KL per token (nats) allowed.")],
    out_file: Annotated[Path, typer.Option("--out", help="The quant config YAML to write (compile "
                                           "--quant-config reads it).")],
    formats: Annotated[str, typer.Option("--formats", help="Formats a unit may take: int4, int8, float.")]
    = "int4,int8,float",
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per calibration window.")] = 128,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Calibration tokens read.")] = 512,
    force: Annotated[bool, typer.Option("--force", help="Replace --out.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Choose per-unit formats meeting a KL budget with the fewest weight bytes; write a quant config."""
    import json

    import yaml

    from ernie_ir.evaluation.sensitivity import config_for, tune
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.ir.storage import write_text_atomic

    if out_file.exists() and not force:
        raise ErnieIRError(f"--out {out_file} exists: pass --force to replace it")
    if not out_file.parent.is_dir():
        raise ErnieIRError(f"--out {out_file}: folder {out_file.parent} does not exist")
    names = [f.strip() for f in formats.split(",") if f.strip()]
    result = tune(model, data, budget=budget, formats=names, seq_len=seq_len, max_tokens=max_tokens)
    config = config_for(result.formats, name=out_file.stem)
    write_text_atomic(out_file, yaml.safe_dump(config.to_dict(), sort_keys=False))
    if json_out:
        print(json.dumps(result.as_dict()))
        return
    counts: dict[str, int] = {}
    for f in result.formats.values():
        counts[f] = counts.get(f, 0) + 1
    out.print(f"{out_file}: KL {result.kl:.4g} (budget {budget:g}), weights "
              f"{result.weight_bytes / 1e6:.3f} MB of {result.float_bytes / 1e6:.3f} MB float; units "
              + ", ".join(f"{n} {f}" for f, n in sorted(counts.items())), markup=False)
    for p in result.points:
        out.print(f"  {p['config']:<9} KL {p['kl']:.4g}, weights {p['weight_bytes'] / 1e6:.3f} MB",
                  markup=False)
