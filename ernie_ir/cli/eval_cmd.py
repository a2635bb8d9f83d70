"""`ernie-ir eval`: perplexity over a corpus, and KL statistics against a reference model; `--task`:
LAMBADA cloze accuracy or WikiText perplexity."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from .common import (
    BackendOpt,
    CalibDataOpt,
    ModelArg,
    TrustOpt,
    chosen_backend,
    err,
    out,
    progress_bar,
    say_backend,
)

ProgressOpt = Annotated[bool | None, typer.Option(
    "--progress/--no-progress", help="Draw a progress bar on stderr (default: when it is a terminal; "
    "elsewhere --progress writes the last state once).")]


def eval_cmd(
    model: ModelArg,
    data: Annotated[Path, typer.Option("--data", help="Corpus: .jsonl (per line {\"text\": ...} or "
                                       "{\"input_ids\": [...]}: one document) or .txt (one document); "
                                       "--task lambada: LAMBADA's .jsonl; --task wikitext: the text file.")],
    task_name: Annotated[str, typer.Option("--task", help="perplexity (the corpus's, with KL against "
                                      "--compare-to), lambada (cloze accuracy) or wikitext (perplexity), "
                                      "the last two as PaddleNLP's wiki_lambada/eval.py scores them.")]
    = "perplexity",
    compare_to: Annotated[str | None, typer.Option("--compare-to", help="Reference MODEL (e.g. the float "
                                                   "checkpoint): KL, top-1 agreement, delta-p.")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per window.")] = 512,
    stride: Annotated[int | None, typer.Option("--stride", help="Window step (default --seq-len); each "
                                               "token is scored once, after >= seq-len - stride tokens "
                                               "of context; --task wikitext: default 32, eval.py's "
                                               "--overlapping_eval.")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="Read at most this many tokens "
                                                   "of the corpus.")] = None,
    batch: Annotated[int, typer.Option("--batch", help="Windows per forward.")] = 1,
    backend: BackendOpt = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    show_progress: ProgressOpt = None,
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
    with --quant, those of each preset of MODEL side by side. --task lambada or wikitext: LAMBADA
    cloze accuracy or WikiText perplexity, as PaddleNLP's wiki_lambada/eval.py scores them."""
    import json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ernie_ir.evaluation import Scoring, TaskSpec, evaluate, evaluate_quantized

    spec = None if task_name == "perplexity" else TaskSpec.from_flags(task_name, seq_len, stride, max_tokens,
                                                                      batch)
    unit, per_s = {"lambada": ("examples", "examples/s"),
                   "wikitext": ("windows", "windows/s")}.get(task_name, ("tokens", "tok/s"))
    note = None
    if not quants:  # --quant evaluates each preset's fresh artifact on the interpreter
        backend, note = chosen_backend(model, backend)
    with Progress(TextColumn(unit), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"),
                  TimeRemainingColumn(), console=err.get(), transient=err.is_terminal,
                  disable=not (err.is_terminal if show_progress is None else show_progress)) as bar:
        task = bar.add_task("eval", total=None, rate="")

        def progress(done: int, total: int) -> None:
            speed = bar.tasks[0].speed
            bar.update(task, completed=done, total=total, rate=f"{speed:.0f} {per_s}" if speed else "")

        if calib_data is not None and quants:
            from ernie_ir.finetune.calib_text import calibration_ids

            calib_data = calibration_ids(calib_data, model)  # text: tokenized once, the passes read ids
        if spec is not None:
            reports = _task_reports(model, data, spec, quants, compare_to, backend, target, calib_data,
                                    trust_pickle, progress)
        elif quants:
            if backend not in ("interpreter", "auto"):
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
    if spec is not None:
        say_backend(note)
        _print_tasks(reports, bool(quants), json_out)
        return
    if quants:
        _print_side_by_side(reports, json_out)
        return
    say_backend(note)
    data_out = report.as_dict()
    if json_out:
        print(json.dumps(data_out))
        return
    _print_report(report, backend)


def _print_report(report: Any, backend: str) -> None:
    """`eval`'s lines: perplexity, and with a reference its KL statistics (numbers for people)."""
    from .numbers import count, fixed

    f = report.figures
    lo, hi = f["perplexity_ci95"]
    out.print(f"{report.model}: perplexity {fixed(f['perplexity'])} (95% {fixed(lo)} .. {fixed(hi)}), mean "
              f"NLL {fixed(f['mean_nll'], 5)} over {count(f['tokens_scored'])} tokens "
              f"({count(report.documents)} documents, {count(report.windows)} windows of "
              f"{count(report.seq_len)}, stride {count(report.stride)})", markup=False)
    if report.reference is not None:
        rlo, rhi = f["perplexity_reference_ci95"]
        out.print(f"{report.reference}: perplexity {fixed(f['perplexity_reference'])} (95% {fixed(rlo)} .. "
                  f"{fixed(rhi)})", markup=False)
        out.print(f"KL(reference || model): mean {fixed(f['kl_mean'], 6)}, median "
                  f"{fixed(f['kl_median'], 6)}, p99 {fixed(f['kl_p99'], 6)}, p99.9 {fixed(f['kl_p999'], 6)}, "
                  f"max {fixed(f['kl_max'], 6)}", markup=False)
        out.print(f"same top token {f['top1_agreement']:.2%}, RMS delta-p {fixed(f['rms_delta_p'], 6)}",
                  markup=False)
    err.print(f"{fixed(report.tokens_per_s, 1)} tokens/s ({backend})", markup=False)


def _print_side_by_side(reports: list[Any], json_out: bool) -> None:
    """One row per --quant preset: its KL statistics against the reference, and perplexities."""
    import json

    if json_out:
        print(json.dumps({"model": reports[0].model, "reference": reports[0].reference,
                          "rows": [r.as_dict() for r in reports]}))
        return
    from .numbers import count, sig

    first = reports[0].figures
    out.print(f"{reports[0].model} quantized, against {reports[0].reference}: KL(reference || model) "
              f"per token over {count(first['tokens_scored'])} tokens (windows of "
              f"{count(reports[0].seq_len)})", markup=False)
    width = max(len("quant"), *(len(str(r.quant)) for r in reports))
    out.print(f"{'quant':<{width}}  {'KL mean':>9} {'+-95%':>8} {'median':>9} {'p99':>8} {'max':>8} "
              f"{'same top':>8} {'RMS dp':>8} {'perplexity':>11}", markup=False)
    for r in reports:
        f = r.figures
        lo, hi = f["kl_mean_ci95"]
        out.print(f"{r.quant:<{width}}  {sig(f['kl_mean']):>9} {sig((hi - lo) / 2, 2):>8} "
                  f"{sig(f['kl_median'], 3):>9} {sig(f['kl_p99'], 3):>8} {sig(f['kl_max'], 3):>8} "
                  f"{f['top1_agreement']:>8.1%} {sig(f['rms_delta_p'], 2):>8} {sig(f['perplexity'], 6):>11}",
                  markup=False)
    out.print(f"{'reference':<{width}}  {'':>9} {'':>8} {'':>9} {'':>8} {'':>8} {'':>8} {'':>8} "
              f"{sig(first['perplexity_reference'], 6):>11}", markup=False)


def _task_reports(model: str, data: Path, spec: Any, quants: list[str] | None, compare_to: str | None,
                  backend: str, target: str, calib_data: Path | None, trust_pickle: bool,
                  progress: Any) -> list[Any]:
    """`eval --task lambada|wikitext`: one report, or with --quant one per preset."""
    from ernie_ir.evaluation import EvalError, evaluate_task, evaluate_task_quantized

    if not quants:
        if calib_data is not None:
            raise EvalError("--calib-data calibrates a --quant preset (w4a8c8, fp8): give --quant")
        return [evaluate_task(model, data, spec, compare_to=compare_to, backend=backend,
                              trust_pickle=trust_pickle, progress=progress)]
    if backend not in ("interpreter", "auto"):
        raise EvalError(f"--quant evaluates each preset's artifact with the interpreter: drop --backend "
                        f"{backend} (or compile it and eval the artifact)")
    return evaluate_task_quantized(model, data, spec, quants, target=target, calib_data=calib_data,
                                   compare_to=compare_to, trust_pickle=trust_pickle, progress=progress)


def _task_line(f: dict[str, Any], suffix: str = "") -> str:
    """A task's headline figures (those of the reference with suffix `_reference`)."""
    from .numbers import count, sig

    if "accuracy" in f:
        return (f"LAMBADA accuracy {f['accuracy' + suffix]:.2%} ({count(f['correct' + suffix])} of "
                f"{count(f['examples'])} examples correct)")
    return (f"WikiText perplexity {sig(f['perplexity' + suffix], 6)}, adjusted "
            f"{sig(f['adjusted_perplexity' + suffix], 6)} (avg loss {sig(f['avg_loss' + suffix], 6)})")


def _print_tasks(reports: list[Any], quantized: bool, json_out: bool) -> None:
    """`eval --task`: the model's figures (and the reference's), or one row per --quant preset."""
    import json

    from .numbers import count

    first = reports[0]
    if json_out:
        print(json.dumps({"task": first.task, "model": first.model, "reference": first.reference,
                          "rows": [r.as_dict() for r in reports]} if quantized else first.as_dict()))
        return
    f = first.figures
    if "accuracy" in f:
        how = f"inputs of at most {count(first.seq_len)} tokens and the label"
        if f["unscored"]:
            how += f"; {count(f['unscored'])} without a label position, counted correct as eval.py does"
    else:
        windows = f"{count(f['windows'])} window{'s' if f['windows'] != 1 else ''}"
        how = (f"{count(f['tokens'])} tokens, token ratio {f['token_ratio']:.4f}, {windows} of "
               f"{count(first.seq_len)}, overlapping_eval {count(f['overlapping_eval'])}")
    width = max(len(str(r.quant)) for r in reports) if quantized else 0
    for r in reports:
        name = f"{r.model} {r.quant:<{width}}" if quantized else r.model
        out.print(f"{name}: {_task_line(r.figures)}", markup=False)
    if first.reference is not None:
        out.print(f"{first.reference} (reference): {_task_line(f, '_reference')}", markup=False)
    out.print(f"({how})", markup=False)


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
    skip_top: Annotated[int | None, typer.Option("--skip-top", help="Keep the K most sensitive units float: "
                                                 "write PaddleSlim's QAT section with them in "
                                                 "skip_tensor_map to --out.")] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="The QAT config YAML --skip-top writes "
                                                  "(compile --quant-config reads it).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    show_progress: ProgressOpt = None,
) -> None:
    """Quantize one unit at a time (a linear, or one layer's routed experts) and rank the units by cost."""
    import json
    import math

    from ernie_ir.evaluation.sensitivity import check_skip_top, sensitivity, skip_map_yaml, svg_bars
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.ir.storage import write_text_atomic

    from .numbers import count, sig
    from .tables import KeyTable

    if plot is not None and not plot.parent.is_dir():
        raise ErnieIRError(f"--plot {plot}: folder {plot.parent} does not exist")
    if (skip_top is None) != (out_file is None):
        raise ErnieIRError("--skip-top K and --out FILE.yaml go together: give both (the K most sensitive "
                           "units are written to FILE.yaml's skip_tensor_map)")
    if skip_top is not None and out_file is not None:  # checked before minutes of measuring
        check_skip_top(skip_top)
        if out_file.exists() and not force:
            raise ErnieIRError(f"--out {out_file} exists: pass --force to replace it")
        if not out_file.parent.is_dir():
            raise ErnieIRError(f"--out {out_file}: folder {out_file.parent} does not exist")
    with progress_bar(transient=err.is_terminal, show=show_progress) as progress:
        report = sensitivity(model, data, fmt=fmt, seq_len=seq_len, max_tokens=max_tokens, mode=mode,
                             skip_top=skip_top, progress=progress)
    if plot is not None:
        write_text_atomic(plot, svg_bars(report))
    skipped: list[str] = []
    if skip_top is not None and out_file is not None:
        write_text_atomic(out_file, skip_map_yaml(report, skip_top, model))
        skipped = [u.unit for u in report.units[:skip_top]]
    if json_out:
        extra = {"skipped": skipped, "out": str(out_file)} if out_file is not None else {}
        print(json.dumps({**report.as_dict(), **extra}))
        return
    figures = ("params", "KL (exact)", "output error (approx)")
    table = KeyTable("unit", "kind", *figures, numbers=figures,
                     title=f"{model}: one unit {fmt}, the rest float ({count(report.tokens)} tokens)")
    for u in report.units:
        measured = ("-" if math.isnan(v) else sig(v) for v in (u.kl, u.approx))  # nan: not measured
        table.add_row(u.unit, u.kind, count(u.params), *measured)
    out.print(table)
    if report.spearman is not None:
        out.print(f"rank agreement of approx and exact (Spearman): {report.spearman:.3f}", markup=False)
    if skipped:
        out.print(f"{out_file}: QAT (qat-int8) with the {len(skipped)} most sensitive units float "
                  f"(skip_tensor_map): {', '.join(skipped)}", markup=False)


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
    show_progress: ProgressOpt = None,
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
    with progress_bar(transient=err.is_terminal, show=show_progress) as progress:
        result = tune(model, data, budget=budget, formats=names, seq_len=seq_len, max_tokens=max_tokens,
                      progress=progress)
    config = config_for(result.formats, name=out_file.stem)
    write_text_atomic(out_file, yaml.safe_dump(config.to_dict(), sort_keys=False))
    if json_out:
        print(json.dumps(result.as_dict()))
        return
    counts: dict[str, int] = {}
    for f in result.formats.values():
        counts[f] = counts.get(f, 0) + 1
    from .numbers import count, fixed, sig

    out.print(f"{out_file}: KL {sig(result.kl)} (budget {budget:g}), weights "
              f"{fixed(result.weight_bytes / 1e6, 3)} MB of {fixed(result.float_bytes / 1e6, 3)} MB float; "
              "units "
              + ", ".join(f"{count(n)} {f}" for f, n in sorted(counts.items())), markup=False)
    for p in result.points:
        out.print(f"  {p['config']:<9} KL {sig(p['kl'])}, weights {fixed(p['weight_bytes'] / 1e6, 3)} MB",
                  markup=False)
