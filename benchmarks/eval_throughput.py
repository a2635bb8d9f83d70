"""What `eval --compare-to` and `sensitivity` cost over the forwards they need, in one run.

Model: the larger generated MoE of benchmarks/quant_damage.py (hidden 256, 4 layers, 32 experts
top-4, vocabulary 4096), float, and its wint4 artifact (cuda, sm70 layout). Corpus: --docs
documents of --tokens random ids, windows of --seq-len.

- eval: tokens/s of `evaluate(artifact, data, compare_to=float)`'s scoring loop (the interpreter
  running both models as decoders with an empty past, then the statistics in float64; its
  setup, verifying and loading the artifact, is not counted) against the same windows through
  both models' plain forwards alone (`Interpreter.run` on fresh interpreters, no statistics),
  timed in turns, --rounds times; goal: overhead <= 1.2x.
- sensitivity: wall time of `--mode approx` (one forward) against `--mode exact` (one forward
  per unit).

Measured (2 cores, 2026-12-01, defaults, --rounds 5): eval 543 tokens/s against 597 for the two
forwards alone, overhead min / median / max 0.93 / 1.15 / 1.42 (the machine was shared with
another benchmark); sensitivity over 22 units: approx 0.5 s, exact 3.1 s (6.5x).

    python benchmarks/eval_throughput.py [--docs 4] [--tokens 256] [--seq-len 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from quant_damage import larger_moe

from ernie_ir.evaluation import evaluate, windows
from ernie_ir.evaluation.sensitivity import sensitivity
from ernie_ir.load import load_input
from ernie_ir.runtime import Interpreter
from ernie_ir.targets.compile import CompileOptions, compile_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eval-throughput-"))
    model = larger_moe(work / "float")
    art = compile_model(model, "cuda", CompileOptions(quant="wint4", cuda_arch=70, out=work / "wint4")).out
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 4096, args.tokens).tolist() for _ in range(args.docs)]
    data = work / "c.jsonl"
    data.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    jobs = [np.asarray([w], np.int64) for d in docs for w, _ in windows(d, args.seq_len, args.seq_len)]
    graphs = [load_input(model), load_input(art)]

    def forwards_alone() -> float:
        t0 = time.perf_counter()
        plain = [Interpreter(g) for g in graphs]  # as evaluate: each model's weights read once per run
        for ids in jobs:
            for it in plain:
                it.run({"input_ids": ids})
        return time.perf_counter() - t0

    def eval_run() -> tuple[int, float]:
        report = evaluate(art, data, compare_to=model, seq_len=args.seq_len)
        return int(report.tokens_scored), report.seconds  # the scoring loop (setup: verify, load)

    tokens, _ = eval_run()  # warm-up (and the token count)
    forwards_alone()
    t_eval, t_alone = [], []
    for _ in range(args.rounds):
        t_eval.append(eval_run()[1])
        t_alone.append(forwards_alone())
    ratios = sorted(e / a for e, a in zip(t_eval, t_alone, strict=True))
    t0 = time.perf_counter()
    approx = sensitivity(model, data, seq_len=args.seq_len, max_tokens=args.tokens, mode="approx")
    t_approx = time.perf_counter() - t0
    t0 = time.perf_counter()
    sensitivity(model, data, seq_len=args.seq_len, max_tokens=args.tokens, mode="exact")
    t_exact = time.perf_counter() - t0
    report = {
        "tokens": tokens, "eval_tokens_per_s": tokens / statistics.median(t_eval),
        "forwards_alone_tokens_per_s": tokens / statistics.median(t_alone),
        "eval_over_forwards": {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]},
        "units": len(approx.units), "sensitivity_approx_s": t_approx, "sensitivity_exact_s": t_exact,
        "exact_over_approx": t_exact / t_approx,
    }
    print(f"eval --compare-to: {report['eval_tokens_per_s']:.1f} tokens/s; both forwards alone "
          f"{report['forwards_alone_tokens_per_s']:.1f} tokens/s; overhead min/median/max "
          f"{ratios[0]:.3f} / {statistics.median(ratios):.3f} / {ratios[-1]:.3f} (goal <= 1.2)")
    print(f"sensitivity over {len(approx.units)} units: approx {t_approx:.1f} s, exact {t_exact:.1f} s "
          f"({t_exact / t_approx:.1f}x)")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
