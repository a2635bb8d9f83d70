"""Pipeline parallelism on gloo processes: per-step time and peak memory per rank of tp 4 against
tp 2 x pp 2 (with and without sequence parallelism) and pp 4, same model and data, and each
stage's measured bubble against the formula (p - 1) / (m + p - 1).

What is measured. One ERNIE 4.5 dense checkpoint (transformers layout, float32, seeded weights as
benchmarks/generate.py writes them) at the widths of the flags below (default hidden 256,
intermediate 768, 8 heads / 4 kv heads of 32, vocab 8000, 4 layers) is compiled as a LoRA training
artifact (`compile_model(folder, "cuda", mode="training", lora_rank=8, tp=, pp=, sp=,
micro_batches=M)`) in each layout:

  1 rank         the loss reference (one process, no parallelism)
  tp 4           4 processes, tensor parallel
  tp 2 x pp 2    4 processes: 2 pipeline stages of 2 tensor-parallel ranks
  tp 2 x pp 2 sp the same with sequence parallelism
  pp 4           4 pipeline stages of 1 rank (only with >= 4 layers)

and trained with `train_artifact(artifact, steps, data=<jsonl>, options={...}, save=False,
timeout_s=...)` on the same data: --batches seeded batches of --batch rows x --seq random token ids
(a jsonl of {"input_ids": [...]} rows, every token a target), cycled. The tp 2 x pp 2 artifact is
also trained with 1 and 8 micro-batches (the `micro_batches` train option; 8 only where it divides
the batch) to show the bubble falling with m, and with the other schedule (GPipe against 1F1B) to
show the micro-batches each stage keeps alive.

How. A step's wall is the difference of consecutive `StepProgress.elapsed_s` (`on_progress`); the
first --warm steps are not timed; the median of the rest is reported, and its ratio to tp 4's.
Memory per process comes from `TrainResult.rank_stats` (peak RSS, measured by each process at the
end of its run: max and mean over the ranks). For pipelined runs each process also reports its
stage's `PipelineStage.summary()` (the first training batch left out as warm-up): idle fraction =
1 - compute / schedule wall (the measured bubble, p2p included), the peak micro-batches alive at
once (1F1B: stage s of p keeps at most min(m, p - s); GPipe: m), and the ideal bubble
(p - 1) / (m + p - 1). The table gives the idle fraction per stage (the mean over the stage's
tensor-parallel ranks). Losses: the max relative difference of every step's loss against the
1-rank run (the same model, data and optimizer: it should be ~1e-6 or below; float32 sums in a
different order).

Caveats. The machine this was written on has 2 cores shared by 4 processes (1 thread each by
default, --threads): the step times and their ratios are sensitive to scheduling noise, and a
process waiting for its peer also waits for a core. The multi-rank steps are reported through the
launcher's poll (~0.1 s), so each multi-rank step time is +-0.1 s. The idle fraction includes the
p2p sends/receives and any load imbalance between stages (the first stage holds the embedding, the
last the LM head and the loss), so it is expected above the formula, which assumes equal stage
costs and free communication. Peak RSS includes the Python interpreter and paddle itself (a few
hundred MiB) beside the model's share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import generate as gen  # noqa: E402  (the checkpoint writer)

OPTIM = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "clip_norm": 1.0}
MIB = 1 << 20


def write_data(path: Path, batches: int, rows: int, seq: int, vocab: int, seed: int = 7) -> None:
    """`batches` x `rows` seeded rows of `seq` random token ids (3 .. vocab-1) as a jsonl."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(batches * rows, seq)).astype(np.int64)
    with path.open("w") as f:
        for row in ids:
            f.write(json.dumps({"input_ids": row.tolist()}) + "\n")


def compile_layout(folder: Path, work: Path, args: Any, tp: int, pp: int, sp: bool) -> tuple[Path, float]:
    from ernie_ir.targets import CompileOptions, compile_model

    art = work / f"train-tp{tp}-pp{pp}{'-sp' if sp else ''}"
    t0 = time.perf_counter()
    if not art.is_dir():
        compile_model(str(folder), "cuda", CompileOptions(mode="training", lora_rank=args.rank,
                      lora_alpha=2.0 * args.rank, tp=tp, pp=pp, sp=sp,
                      micro_batches=args.micro_batches if pp > 1 else None, out=art, force=True))
    return art, time.perf_counter() - t0


def train(art: Path, data: Path, args: Any, pp: int, micro_batches: int | None = None,
          schedule: str | None = None) -> dict[str, Any]:
    from ernie_ir.training.loop import StepProgress, TrainHooks, train_artifact

    marks: list[float] = []

    def on_progress(p: StepProgress) -> None:
        marks.append(p.elapsed_s)

    options: dict[str, Any] = {**OPTIM, "batch_size": args.batch, "grad_accum": 1}
    if pp > 1:
        options["micro_batches"] = micro_batches or args.micro_batches
        options["pipeline_schedule"] = schedule or args.schedule
    t0 = time.perf_counter()
    result = train_artifact(art, args.steps, data, options=options, save=False,
                            hooks=TrainHooks(on_progress=on_progress), timeout_s=args.timeout)
    wall = time.perf_counter() - t0
    step_s = [b - a for a, b in zip([0.0, *marks[:-1]], marks, strict=True)]
    return {"step_s": step_s, "losses": list(result.losses), "ranks": list(result.rank_stats), "wall_s": wall}


def stage_view(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per stage (in order): the mean idle fraction and the max peak in-flight over its ranks, and
    the schedule's figures (the same on every rank)."""
    pipes = [r["pipeline"] for r in ranks if r.get("pipeline")]
    if not pipes:
        return None
    stages = int(pipes[0]["stages"])
    idle: list[list[float]] = [[] for _ in range(stages)]
    peak = [0] * stages
    compute: list[list[float]] = [[] for _ in range(stages)]
    for p in pipes:
        idle[int(p["stage"])].append(float(p["idle_fraction"]))
        compute[int(p["stage"])].append(float(p["compute_s"]) / max(int(p["batches"]), 1))
        peak[int(p["stage"])] = max(peak[int(p["stage"])], int(p["peak_in_flight"]))
    m = int(pipes[0]["micro_batches"])
    kind = str(pipes[0]["schedule"])
    bound = [min(m, stages - s) if kind == "1f1b" else m for s in range(stages)]
    return {"stages": stages, "micro_batches": m, "schedule": kind,
            "ideal_bubble": float(pipes[0]["ideal_bubble"]),
            "formula": (stages - 1) / (m + stages - 1),
            "idle": [statistics.fmean(x) if x else float("nan") for x in idle],
            "compute_s": [statistics.fmean(x) if x else float("nan") for x in compute],
            "peak_in_flight": peak, "peak_bound": bound, "timed_batches": int(pipes[0]["batches"])}


def rel_diff(losses: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=2, help="distinct batches in the data (cycled)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warm", type=int, default=1, help="first steps not timed")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a training run may take")
    ap.add_argument("--no-sweep", action="store_true",
                    help="skip the tp 2 x pp 2 runs at other micro-batch counts and the other schedule")
    args = ap.parse_args()
    if args.batch % args.micro_batches:
        raise SystemExit(f"--micro-batches {args.micro_batches} must divide --batch {args.batch}")
    if args.steps <= args.warm:
        raise SystemExit(f"--steps {args.steps} must exceed --warm {args.warm}")
    for name, n in (("--heads", args.heads), ("--kv-heads", args.kv_heads)):
        if n % 4:
            raise SystemExit(f"{name} {n}: tp 4 needs a multiple of 4")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    gen.WIDTHS.update({"hidden_size": args.hidden, "intermediate_size": args.intermediate,
                       "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
                       "head_dim": args.head_dim, "vocab_size": args.vocab})
    start = time.perf_counter()
    other = "gpipe" if args.schedule == "1f1b" else "1f1b"
    # name -> (tp, pp, sp, micro-batches override, schedule override)
    plan: dict[str, tuple[int, int, bool, int | None, str | None]] = {
        "1 rank": (1, 1, False, None, None),
        "tp 4": (4, 1, False, None, None),
        "tp 2 x pp 2": (2, 2, False, None, None),
        "tp 2 x pp 2 sp": (2, 2, True, None, None),
    }
    if args.layers >= 4:
        plan["pp 4"] = (1, 4, False, None, None)
    if not args.no_sweep:
        for m in (1, 8):
            if m != args.micro_batches and args.batch % m == 0:
                plan[f"tp 2 x pp 2 m={m}"] = (2, 2, False, m, None)
        plan[f"tp 2 x pp 2 {other}"] = (2, 2, False, None, other)
    runs: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="ernie-ir-pipeline-bench-") as tmp:
        work = Path(tmp)
        folder = work / "model"
        size = gen.write_checkpoint(folder, args.layers)
        data = work / "data.jsonl"
        write_data(data, args.batches, args.batch, args.seq, args.vocab)
        for name, (tp, pp, sp, m, kind) in plan.items():
            print(f"[{time.perf_counter() - start:6.0f} s] {name} ...", flush=True)
            try:
                art, compile_s = compile_layout(folder, work, args, tp, pp, sp)
                run = train(art, data, args, pp, m, kind)
            except Exception as e:  # report the layout as failed and go on with the others
                failures[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                print(f"    FAILED: {failures[name]}", flush=True)
                continue
            run.update({"tp": tp, "pp": pp, "sp": sp, "compile_s": compile_s,
                        "stages": stage_view(run["ranks"])})
            runs[name] = run
    report(runs, failures, args, size, time.perf_counter() - start)


def report(runs: dict[str, dict[str, Any]], failures: dict[str, str], args: Any, size: dict[str, Any],
           wall: float) -> None:
    ref = runs.get("1 rank")
    base = runs.get("tp 4")
    med = {n: statistics.median(r["step_s"][args.warm:]) for n, r in runs.items()}
    print()
    print(f"ERNIE 4.5 dense, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"heads {args.heads}/{args.kv_heads}x{args.head_dim}, vocab {args.vocab}: "
          f"{size['params'] / 1e6:.1f} M params; LoRA rank {args.rank}")
    print(f"batch {args.batch} x {args.seq}, {args.micro_batches} micro-batches, schedule {args.schedule}; "
          f"{args.steps} steps, {args.warm} untimed; {args.threads} thread(s) a process; "
          f"{os.cpu_count()} cores")
    print()
    head = (f"{'layout':22s} {'procs':>5s} {'step s':>7s} {'x tp4':>6s} {'RSS max':>8s} {'RSS mean':>8s} "
            f"{'loss rel diff':>13s}")
    print(head)
    print("-" * len(head))
    for name, r in runs.items():
        ratio = f"{med[name] / med['tp 4']:6.2f}" if base else f"{'-':>6s}"
        rss = [x["peak_rss_bytes"] / MIB for x in r["ranks"]]
        diff = (f"{rel_diff(r['losses'], ref['losses']):13.2e}" if ref and name != "1 rank"
                else f"{'(ref)':>13s}")
        print(f"{name:22s} {len(r['ranks']):5d} {med[name]:7.3f} {ratio} {max(rss):8.0f} "
              f"{statistics.fmean(rss):8.0f} {diff}")
    print("(step s: median step wall; x tp4: step time / tp 4's; RSS: peak resident MiB per process)")
    print()
    head = (f"{'pipelined layout':22s} {'sched':>5s} {'p':>2s} {'m':>2s} {'formula':>7s} "
            f"{'idle per stage (measured)':>26s} {'compute s/batch per stage':>26s} "
            f"{'in flight / bound':>18s}")
    print(head)
    print("-" * len(head))
    for name, r in runs.items():
        s = r["stages"]
        if not s:
            continue
        idle = " ".join(f"{x:.3f}" for x in s["idle"])
        comp = " ".join(f"{x:.3f}" for x in s["compute_s"])
        flight = " ".join(f"{a}/{b}" for a, b in zip(s["peak_in_flight"], s["peak_bound"], strict=True))
        print(f"{name:22s} {s['schedule']:>5s} {s['stages']:2d} {s['micro_batches']:2d} {s['formula']:7.3f} "
              f"{idle:>26s} {comp:>26s} {flight:>18s}")
    print("(formula: (p-1)/(m+p-1); idle: 1 - compute/schedule wall per stage, mean over its tp ranks, "
          "p2p and imbalance included;\n compute s/batch: the stage's own compute a timed batch, mean "
          "over its tp ranks; in flight: peak micro-batches alive per stage / 1F1B min(m, p-s) "
          "or GPipe m)")
    for name, err in failures.items():
        print(f"FAILED {name}: {err}")
    print(f"wall {wall:.0f} s")
    summary = {
        "layers": args.layers, "hidden": args.hidden, "batch": args.batch, "seq": args.seq,
        "micro_batches": args.micro_batches, "schedule": args.schedule, "steps": args.steps,
        "wall_s": round(wall, 1), "failed": failures,
        "runs": {n: {"step_s": round(med[n], 4),
                     "x_tp4": round(med[n] / med["tp 4"], 3) if base else None,
                     "rss_max_mib": round(max(x["peak_rss_bytes"] for x in r["ranks"]) / MIB, 1),
                     "rss_mean_mib": round(statistics.fmean(x["peak_rss_bytes"] for x in r["ranks"]) / MIB,
                                           1),
                     "loss_rel_diff": (None if not ref or n == "1 rank"
                                       else float(f"{rel_diff(r['losses'], ref['losses']):.3e}")),
                     **({"idle": [round(x, 4) for x in r["stages"]["idle"]],
                         "formula": round(r["stages"]["formula"], 4),
                         "peak_in_flight": r["stages"]["peak_in_flight"]} if r["stages"] else {})}
                 for n, r in runs.items()},
    }
    print(json.dumps(summary, separators=(",", ":")))


if __name__ == "__main__":
    main()
