"""`ernie-ir eval`: perplexity over a corpus, and KL statistics against a reference model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from .common import CalibDataOpt, ModelArg, TrustOpt, err, out


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
    quants: Annotated[list[str] | None, typer.Option(
        "--quant", help="Quantize MODEL (float) with this preset, as `compile --quant` does (repeat it "
        "for several: 'wint4', 'wint8mix', 'w4a8c8', 'wint2{w4_end_layer=1}'), and report each against "
        "MODEL (or --compare-to) side by side.")] = None,
    target: Annotated[str, typer.Option("--target", "-t", help="With --quant: the target compiled "
                                        "for.")] = "cuda",
    calib_data: CalibDataOpt = None,
) -> None:
    """Perplexity of a model or artifact over a corpus; with --compare-to, llama.cpp's KL statistics;
    with --quant, those of each preset of MODEL side by side."""
    import json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ernie_ir.evaluation import Scoring, evaluate, evaluate_quantized

    with Progress(TextColumn("tokens"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"),
                  TimeRemainingColumn(), console=err.get(), transient=True,
                  disable=not show_progress) as bar:
        task = bar.add_task("eval", total=None, rate="")

        def progress(done: int, total: int) -> None:
            speed = bar.tasks[0].speed
            bar.update(task, completed=done, total=total, rate=f"{speed:.0f} tok/s" if speed else "")

        if quants:
            if backend != "interpreter":
                from ernie_ir.evaluation import EvalError

                raise EvalError(f"--quant evaluates each preset's artifact with the interpreter: drop "
                                f"--backend {backend} (or compile it and eval the artifact)")
            scoring = Scoring(seq_len=seq_len, stride=stride, max_tokens=max_tokens, batch=batch)
            reports = evaluate_quantized(model, data, quants, target=target, calib_data=calib_data,
                                         compare_to=compare_to, scoring=scoring, trust_pickle=trust_pickle,
                                         progress=progress)
        else:
            if calib_data is not None:
                from ernie_ir.evaluation import EvalError

                raise EvalError("--calib-data calibrates a --quant preset (w4a8c8, fp8): give --quant")
            report = evaluate(model, data, compare_to=compare_to, seq_len=seq_len, stride=stride,
                              max_tokens=max_tokens, batch=batch, backend=backend, trust_pickle=trust_pickle,
                              progress=progress)
    if quants:
        _print_side_by_side(reports, json_out)
        return
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


def _print_side_by_side(reports: list[Any], json_out: bool) -> None:
    """One row per --quant preset: its KL statistics against the reference, and perplexities."""
    import json

    if json_out:
        print(json.dumps({"model": reports[0].model, "reference": reports[0].reference,
                          "rows": [r.as_dict() for r in reports]}))
        return
    first = reports[0].figures
    out.print(f"{reports[0].model} quantized, against {reports[0].reference}: KL(reference || model) "
              f"per token over {first['tokens_scored']} tokens (windows of {reports[0].seq_len})",
              markup=False)
    width = max(len("quant"), *(len(str(r.quant)) for r in reports))
    out.print(f"{'quant':<{width}}  {'KL mean':>9} {'+-95%':>8} {'median':>9} {'p99':>8} {'max':>8} "
              f"{'same top':>8} {'RMS dp':>8} {'perplexity':>11}", markup=False)
    for r in reports:
        f = r.figures
        lo, hi = f["kl_mean_ci95"]
        out.print(f"{r.quant:<{width}}  {f['kl_mean']:>9.4g} {(hi - lo) / 2:>8.2g} {f['kl_median']:>9.3g} "
                  f"{f['kl_p99']:>8.3g} {f['kl_max']:>8.3g} {f['top1_agreement']:>8.1%} "
                  f"{f['rms_delta_p']:>8.2g} {f['perplexity']:>11.6g}", markup=False)
    out.print(f"{'reference':<{width}}  {'':>9} {'':>8} {'':>9} {'':>8} {'':>8} {'':>8} {'':>8} "
              f"{first['perplexity_reference']:>11.6g}", markup=False)


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
