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

Measured (see docs and the closing note of issue 22 for the figures of a given day).
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


def batches(n: int, rows: int, seq: int, vocab: int, seed: int = 7) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, vocab, size=(rows, seq)).astype(np.int64)
        out.append((ids, ids.copy()))
    return out


def ours(folder: Path, work: Path, tp: int, data: list[tuple[np.ndarray, np.ndarray]], args: Any,
         dp: int = 1, sharding: str | None = None) -> dict:
    from ernie_ir.targets.compile import CompileOptions, compile_model
    from ernie_ir.training.loop import StepProgress, TrainHooks, train_artifact

    art = work / f"train-tp{tp}-dp{dp}"
    t0 = time.perf_counter()
    if not art.is_dir():  # the dp 2 artifact serves the three sharding runs
        compile_model(str(folder), "cuda", CompileOptions(mode="training", lora_rank=args.rank,
                      lora_alpha=2.0 * args.rank, lora_targets=TARGETS, tp=tp, dp=dp, out=art, force=True))
    compile_s = time.perf_counter() - t0
    data_file = work / "data.jsonl"
    with data_file.open("w") as f:
        for ids, _ in data:
            for row in ids:
                f.write(json.dumps({"input_ids": row.tolist()}) + "\n")
    marks: list[float] = []

    def on_progress(p: StepProgress) -> None:
        marks.append(p.elapsed_s)

    options = {"lr": OPTIM["lr"], "beta1": OPTIM["beta1"], "beta2": OPTIM["beta2"], "eps": OPTIM["eps"],
               "weight_decay": OPTIM["weight_decay"], "clip_norm": OPTIM["clip"], "batch_size": args.batch,
               "grad_accum": 1, "dp": dp, "sharding": sharding}
    result = train_artifact(art, args.steps, data_file, options=options, save=False,
                            hooks=TrainHooks(on_progress=on_progress))
    losses = list(getattr(result, "losses", result))
    step_s = [b - a for a, b in zip([0.0, *marks[:-1]], marks, strict=True)]
    return {"step_s": step_s, "losses": losses, "compile_s": compile_s, "ranks": result.rank_stats}


def reference(folder: Path, work: Path, data: list[tuple[np.ndarray, np.ndarray]], args: Any) -> dict:
    py = gen.refenvs_root() / "pf" / "bin" / "python"
    if not py.is_file():
        raise SystemExit(f"reference environment 'pf' not found at {py.parent.parent} "
                         "(tests/reference/install_envs.sh)")
    arrays = {}
    for i, (ids, labels) in enumerate(data):
        arrays[f"ids{i}"], arrays[f"labels{i}"] = ids, labels
    np.savez(work / "batches.npz", **arrays)
    spec = {"steps": args.steps, "threads": args.threads, "r": args.rank, "lora_alpha": 2 * args.rank,
            "targets": TARGETS, **OPTIM}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)})
    out = work / "ref.json"
    linked = gen.links_folder(folder, work / "pf-model")
    with (work / "ref.log").open("w") as log:
        subprocess.run([str(py), str(HERE / "_train_ref.py"), str(linked), str(work / "batches.npz"),
                        json.dumps(spec), str(out)], check=True, stdout=log, stderr=log, env=env, cwd=HERE)
    return json.loads(out.read_text())


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
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    gen.WIDTHS.update(WIDTHS)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ernie-ir-train-bench-") as tmp:
        work = Path(tmp)
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
    print(f"goal tp 1 >= {GOAL:.1f}x paddleformers: {'met' if ratio >= GOAL else 'MISSED'} ({ratio:.2f}x); "
          f"wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
