"""LoRA training throughput (issue 22): tokens/s of an ernie-ir LoRA step on one rank and on two
gloo ranks (tp 2) against paddleformers' `LoRAModel` + AdamW on the same model and data, one run;
and (issue 27) data parallelism: dp 2 on two gloo ranks without sharding, with stage 1 and with
stage 2, with each rank's memory (optimizer state and gradient bytes measured from the tensors
the rank holds, peak RSS) beside dp 1's.

The model: an ERNIE 4.5 dense checkpoint (transformers layout, float32, seeded weights as
benchmarks/generate.py writes them) at the widths below, --layers (4) layers. The data: --batches
(2) seeded batches of --batch (4) rows x --seq (128) random token ids, every token a target,
cycled. LoRA: rank --rank (8), alpha 2 x rank, ERNIEKit's four target patterns (qkv, o, up_gate,
down). Optimizer: AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, no decay), global-norm clip 1.0, the
same call on both sides. Threads: --threads (2) everywhere (the two ranks get 1 each: the machine
has two cores).

Ours: `compile_model(folder, "cuda", mode="training", lora_rank=R, lora_alpha=2R)` at tp 1,
tp 2 and dp 2, then `train_artifact(..., save=False)` (the dp 2 artifact three times: sharding
none, stage1, stage2, given as the `sharding` option), timing each step as it is reported
(`on_progress`: a step's wall = the difference of `elapsed_s`; the multi-rank steps arrive
through the launcher's 0.1 s poll, so each of their step times is +-0.1 s). dp 2 splits each
global batch of --batch rows into two halves, one per replica: the same tokens a step as dp 1.
Memory per rank (`TrainResult.rank_stats`, measured in each rank at the end of its run): the
optimizer's state tensors (AdamW moments and beta powers), the gradients held at the last step
(after the data-parallel reduce) and the process's peak RSS (dp 1: the calling process, which
also compiled the model and holds the reference's data). The reference: benchmarks/_train_ref.py in the
`pf` environment (paddleformers, loaded once). Each side runs --steps (6) steps; the first
--warm (2) are not timed (allocation, the first backward). tokens/s = real target tokens of a step
/ its median wall; xpf = ours / paddleformers'. Step-1 losses are printed for both: LoRA's B
starts at zero, so both equal the base model's loss on batch 0 (a check that the two sides train
the same model on the same data).

Goal (issue 22): tp 1 tokens/s >= 1.0x paddleformers'.

Full-parameter rows (--no-full skips them, --no-lora runs only them): ERNIE-4.5-0.3B's widths
(generate.py's: hidden 1024, intermediate 3072, 16/2 heads, head_dim 128, vocabulary 103424, tied
embeddings) with --full-layers (2) layers: 134.2 M params, all trainable (the tied table is 106 M
of them; a layer is 14 M, so the vocabulary dominates a step either way). Same batches, batch and
seq; AdamW as above but weight decay 0.01, skipping params whose name holds "bias" or "norm" on
both sides (ernie-ir's NO_DECAY; _train_ref.py's `apply_decay_param_fun`); --full-steps (4) steps,
the first --warm-full (1) untimed. Ours: `compile_model(..., mode="training")` (the full-param
pass) and `train_artifact` in this process; paddleformers: _train_ref.py with "full": no
LoRAModel, every param trainable. Memory: the dp 2 artifact trained --mem-steps (2) steps
unsharded / stage1 / stage2 (batch / 2 rows a replica); per rank, the peak RSS it reports
(rank_stats) minus its RSS when it first reads its rank graph (after importing Paddle, before any
param exists: a sitecustomize audit hook, RSS_HOOK, put on the ranks' PYTHONPATH), against
`plan_memory(folder, "cuda", CompileOptions(mode="training", dp=2, sharding=S),
PlanRequest(seq_len, batch / 2, reserve=0))`'s per-rank total.

Measured 2026-12-06, 2 cores, --no-lora (defaults otherwise; wall 374 s):
- tokens/s, full-parameter, tp 1: ernie-ir 15.9, paddleformers 15.9: 1.00x (median step 31.90 s
  vs 31.94 s); the four losses equal to 5 digits (12.06140, 12.05606, 8.69857, 9.69464). Both
  sides' first step takes ~11 s and every later one ~32 s (forward 2.4 -> 11 s, backward 5 -> 22
  s in paddleformers alone: the params hold no denormals; the same Paddle CPU kernels on both
  sides, not investigated further).
- peak RSS - RSS before the params (base 315 MiB a rank), MiB, against the plan: unsharded 3691 /
  3701 vs 2193 (+68%); stage1 3576 / 3408 vs 1681 (+113% / +103%); stage2 3544 / 2988 vs 1425
  (+149% / +110%). Goal (within 15%) missed: the plan sizes a device's tensors, and a CPU
  rank's RSS also holds the rank graph's memory-mapped weights file (512 MiB of file pages, read
  once to build the params; on a device they are host memory), Paddle's whole-model transients
  (the dense [V, H] embedding gradient beside the tied head's, the flat gradient buffer of the dp
  reduce, the clipped gradient copies) and the CPU allocator's freed-but-kept pages; sharding
  lowers the RSS less than the plan's moments / gradients (-115 to -290 MiB against -512 / -768).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import generate as gen  # noqa: E402  (the checkpoint writer and the reference-env lookup)

WIDTHS = {"hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 12,
          "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000}
TARGETS = [".*qkv_proj.*", ".*o_proj.*", ".*up_gate_proj.*", ".*down_proj.*"]
OPTIM = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "clip": 1.0}
GOAL = 1.0
WIDTHS_03B = dict(gen.WIDTHS)  # ERNIE-4.5-0.3B's (generate.py's): the full-parameter rows
OPTIM_FULL = {**OPTIM, "weight_decay": 0.01}  # decay on: both sides skip biases and norm weights
GOAL_RSS = 0.15
RSS_HOOK = '''"""benchmarks/train_throughput.py's probe: a rank's RSS before its params exist."""
import json, os, sys
_DIR = os.environ.get("ERNIE_IR_BENCH_RSS_DIR")
_done = []


def _status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024


def _hook(event, args):
    if _done or event != "open" or "PADDLE_TRAINER_ID" not in os.environ:
        return
    try:
        path = os.fsdecode(args[0])
    except TypeError:
        return
    if path.endswith(("graph.ir", "weights.safetensors")):  # the rank graph's first read
        _done.append(path)
        out = os.path.join(_DIR, "base.rank%s.json" % os.environ["PADDLE_TRAINER_ID"])
        with open(out, "w") as f:
            json.dump({"pid": os.getpid(), "rss_bytes": _status("VmRSS:"), "hwm_bytes": _status("VmHWM:")}, f)


if _DIR:
    sys.addaudithook(_hook)
'''


def batches(n: int, rows: int, seq: int, vocab: int, seed: int = 7) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, vocab, size=(rows, seq)).astype(np.int64)
        out.append((ids, ids.copy()))
    return out


def ours(folder: Path, work: Path, tp: int, data: list[tuple[np.ndarray, np.ndarray]], args: Any,
         dp: int = 1, sharding: str | None = None, full: bool = False, steps: int | None = None) -> dict:
    from ernie_ir.targets.compile import CompileOptions, compile_model
    from ernie_ir.training.loop import StepProgress, TrainHooks, train_artifact

    art = work / f"train-{'full' if full else 'lora'}-tp{tp}-dp{dp}"
    t0 = time.perf_counter()
    if not art.is_dir():  # the dp 2 artifact serves the three sharding runs
        lora = {} if full else {"lora_rank": args.rank, "lora_alpha": 2.0 * args.rank,
                                "lora_targets": TARGETS}
        compile_model(str(folder), "cuda", CompileOptions(mode="training", tp=tp, dp=dp, out=art, force=True,
                                                          **lora))
    compile_s = time.perf_counter() - t0
    data_file = work / "data.jsonl"
    with data_file.open("w") as f:
        for ids, _ in data:
            for row in ids:
                f.write(json.dumps({"input_ids": row.tolist()}) + "\n")
    marks: list[float] = []

    def on_progress(p: StepProgress) -> None:
        marks.append(p.elapsed_s)

    optim = OPTIM_FULL if full else OPTIM
    options = {"lr": optim["lr"], "beta1": optim["beta1"], "beta2": optim["beta2"], "eps": optim["eps"],
               "weight_decay": optim["weight_decay"], "clip_norm": optim["clip"], "batch_size": args.batch,
               "grad_accum": 1, "dp": dp, "sharding": sharding}
    result = train_artifact(art, steps or args.steps, data_file, options=options, save=False,
                            hooks=TrainHooks(on_progress=on_progress))
    losses = list(getattr(result, "losses", result))
    step_s = [b - a for a, b in zip([0.0, *marks[:-1]], marks, strict=True)]
    return {"step_s": step_s, "losses": losses, "compile_s": compile_s, "ranks": result.rank_stats}


def reference(folder: Path, work: Path, data: list[tuple[np.ndarray, np.ndarray]], args: Any,
              full: bool = False) -> dict:
    py = gen.refenvs_root() / "pf" / "bin" / "python"
    if not py.is_file():
        raise SystemExit(f"reference environment 'pf' not found at {py.parent.parent} "
                         "(tests/reference/install_envs.sh)")
    arrays = {}
    for i, (ids, labels) in enumerate(data):
        arrays[f"ids{i}"], arrays[f"labels{i}"] = ids, labels
    np.savez(work / "batches.npz", **arrays)
    spec = {"steps": args.full_steps if full else args.steps, "threads": args.threads, "full": full,
            "r": args.rank, "lora_alpha": 2 * args.rank, "targets": TARGETS,
            **(OPTIM_FULL if full else OPTIM)}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)})
    out = work / "ref.json"
    linked = gen.links_folder(folder, work / "pf-model")
    with (work / f"ref{'-full' if full else ''}.log").open("w") as log:
        subprocess.run([str(py), str(HERE / "_train_ref.py"), str(linked), str(work / "batches.npz"),
                        json.dumps(spec), str(out)], check=True, stdout=log, stderr=log, env=env, cwd=HERE)
    return json.loads(out.read_text())


def dp_memory(folder: Path, work: Path, data: list[tuple[np.ndarray, np.ndarray]], args: Any,
              sharding: str | None) -> dict:
    """ours() at dp 2 full-parameter, each rank's RSS before its params exist (RSS_HOOK, through
    PYTHONPATH: sitecustomize) beside its peak (rank_stats), and the planner's figure."""
    from ernie_ir.planning import PlanRequest, plan_memory
    from ernie_ir.targets import CompileOptions

    probe = work / f"rss-{sharding or 'none'}"
    hook = work / "rss-hook"
    probe.mkdir()
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(RSS_HOOK)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "ERNIE_IR_BENCH_RSS_DIR")}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(hook), *filter(None, [saved["PYTHONPATH"]])])
    os.environ["ERNIE_IR_BENCH_RSS_DIR"] = str(probe)
    try:
        run = ours(folder, work, 1, data, args, dp=2, sharding=sharding, full=True, steps=args.mem_steps)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    layout = CompileOptions(mode="training", dp=2, sharding=sharding or "none")
    request = PlanRequest(seq_len=args.seq, batch=args.batch // 2, reserve=0)
    plan = plan_memory(str(folder), "cuda", layout, request)
    run["plan_bytes"] = plan.per_rank[0].total_bytes
    run["plan"] = plan.per_rank[0].by_category
    for r, stats in enumerate(run["ranks"]):
        base = json.loads((probe / f"base.rank{r}.json").read_text())
        stats["base_rss_bytes"] = base["rss_bytes"]
    return run


def lora_rows(work: Path, args: Any) -> None:
    """The LoRA rows (issues 22 and 27): WIDTHS, --layers layers."""
    gen.WIDTHS.update(WIDTHS)
    folder = work / "model"
    size = gen.write_checkpoint(folder, args.layers)
    data = batches(args.batches, args.batch, args.seq, WIDTHS["vocab_size"])
    tokens = args.batch * (args.seq - 1)
    runs = {"paddleformers": reference(folder, work, data, args),
            "ernie-ir tp 1": ours(folder, work, 1, data, args),
            "ernie-ir tp 2 (2 gloo ranks)": ours(folder, work, 2, data, args)}
    if not args.no_dp:
        for sharding in (None, "stage1", "stage2"):
            runs[f"ernie-ir dp 2 {sharding or 'unsharded'}"] = ours(folder, work, 1, data, args, dp=2,
                                                                    sharding=sharding)
    ref_tps = tokens / statistics.median(runs["paddleformers"]["step_s"][args.warm:])
    print(f"ERNIE 4.5 dense, {args.layers} layers, {size['params'] / 1e6:.1f} M params; "
          f"LoRA rank {args.rank}; "
          f"batch {args.batch} x {args.seq}; {tokens} target tokens a step; {args.steps} steps, "
          f"{args.warm} untimed")
    print(f"{'run':30s} {'step s':>8s} {'tokens/s':>9s} {'xpf':>6s} {'loss@1':>9s} {'loss@last':>9s}")
    for name, run in runs.items():
        med = statistics.median(run["step_s"][args.warm:])
        tps = tokens / med
        print(f"{name:30s} {med:8.3f} {tps:9.1f} {tps / ref_tps:6.2f} {run['losses'][0]:9.5f} "
              f"{run['losses'][-1]:9.5f}")
    first = [run["losses"][0] for run in runs.values()]
    print(f"step-1 losses agree to {max(first) - min(first):.2e} (B = 0 at init: the base model's loss)")
    ratio = tokens / statistics.median(runs["ernie-ir tp 1"]["step_s"][args.warm:]) / ref_tps
    print("memory per rank (MiB): optimizer state / gradients held at the last step / peak RSS")
    mib = 1 << 20
    for name, run in runs.items():
        if run.get("ranks"):
            cells = [f"{r['optimizer_state_bytes'] / mib:.2f} / {r['gradient_bytes'] / mib:.2f} / "
                     f"{r['peak_rss_bytes'] / mib:.0f}" for r in run["ranks"]]
            print(f"{name:30s} " + "   ".join(f"rank {i}: {c}" for i, c in enumerate(cells)))
    print(f"goal tp 1 >= {GOAL:.1f}x paddleformers: {'met' if ratio >= GOAL else 'MISSED'} ({ratio:.2f}x)")



def full_rows(work: Path, args: Any) -> None:
    """The full-parameter rows: ERNIE-4.5-0.3B widths, --full-layers layers."""
    gen.WIDTHS.update(WIDTHS_03B)
    folder = work / "model-full"
    size = gen.write_checkpoint(folder, args.full_layers)
    data = batches(args.batches, args.batch, args.seq, WIDTHS_03B["vocab_size"])
    tokens = args.batch * (args.seq - 1)
    runs = {"paddleformers full": reference(folder, work, data, args, full=True),
            "ernie-ir full tp 1": ours(folder, work, 1, data, args, full=True, steps=args.full_steps)}
    print(f"\nfull-parameter: ERNIE 4.5 0.3B widths, {args.full_layers} layers, {size['params'] / 1e6:.1f} M "
          f"params, all trainable (pf: {runs['paddleformers full'].get('trainable', 0) / 1e6:.1f} M); AdamW "
          f"weight decay {OPTIM_FULL['weight_decay']} but biases and norms; batch {args.batch} x {args.seq}; "
          f"{args.full_steps} steps, {args.warm_full} untimed")
    print(f"{'run':30s} {'step s':>8s} {'tokens/s':>9s} {'xpf':>6s} " + " ".join(
        f"{'loss@' + str(i + 1):>9s}" for i in range(args.full_steps)))
    tps = {}
    for name, run in runs.items():
        med = statistics.median(run["step_s"][args.warm_full:])
        tps[name] = tokens / med
        print(f"{name:30s} {med:8.3f} {tps[name]:9.1f} {tps[name] / tps['paddleformers full']:6.2f} "
              + " ".join(f"{x:9.5f}" for x in run["losses"]))
    ratio = tps["ernie-ir full tp 1"] / tps["paddleformers full"]
    print(f"goal full tp 1 >= {GOAL:.1f}x paddleformers: {'met' if ratio >= GOAL else 'MISSED'} "
          f"({ratio:.2f}x)")
    if args.no_dp:
        return
    mib = 1 << 20
    print(f"dp 2 full-parameter, {args.mem_steps} steps, batch {args.batch // 2} x {args.seq} a replica: "
          "per rank, peak RSS - RSS before the params (MiB) against plan (reserve 0)")
    worst = 0.0
    for sharding in (None, "stage1", "stage2"):
        run = dp_memory(folder, work, data, args, sharding)
        cells = []
        for r, st in enumerate(run["ranks"]):
            used = st["peak_rss_bytes"] - st["base_rss_bytes"]
            diff = used / run["plan_bytes"] - 1
            worst = max(worst, abs(diff))
            cells.append(f"rank {r}: {used / mib:.0f} ({st['peak_rss_bytes'] / mib:.0f} - "
                         f"{st['base_rss_bytes'] / mib:.0f}) {diff:+.1%}")
        plan = " + ".join(f"{k} {v / mib:.0f}" for k, v in run["plan"].items() if v)
        print(f"  {sharding or 'unsharded':9s} plan {run['plan_bytes'] / mib:.0f} ({plan}); "
              + "; ".join(cells))
    print(f"goal RSS within {GOAL_RSS:.0%} of plan: {'met' if worst <= GOAL_RSS else 'MISSED'} "
          f"(worst {worst:.1%})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-dp", action="store_true", help="skip the data-parallel runs")
    ap.add_argument("--full-layers", type=int, default=2)
    ap.add_argument("--full-steps", type=int, default=4)
    ap.add_argument("--warm-full", type=int, default=1)
    ap.add_argument("--mem-steps", type=int, default=2)
    ap.add_argument("--no-lora", action="store_true", help="only the full-parameter rows")
    ap.add_argument("--no-full", action="store_true", help="only the LoRA rows")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ernie-ir-train-bench-") as tmp:
        if not args.no_lora:
            lora_rows(Path(tmp), args)
        if not args.no_full:
            full_rows(Path(tmp), args)
    print(f"wall {time.perf_counter() - start:.0f} s")

if __name__ == "__main__":
    main()
