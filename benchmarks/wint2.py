"""WINT2 (FastDeploy's 2-bit CCQ experts): encoder speed, error against plain 2-bit and int4, and
what each preset leaves of ERNIE-4.5-300B-A47B, in one run.

    python benchmarks/wint2.py [--repeat 2] [--threads 2] [--big] [--json]

1. **Codebooks**: each of `DEFAULT_CODEBOOKS` as a vector quantizer of unit Gaussian 4-vectors
   (65,536, seeded) at its best scale (a grid, then a finer grid around the best): mean squared
   error per weight, against the uniform 4-level scalar grid {-1.5, -0.5, 0.5, 1.5} x step at
   its best step (the plain 2-bit grid). The encoder's docstring quotes these numbers.
2. **Encoder throughput**: `wint2_encode` (refine 1, the default, and 0) of seeded bf16
   weights (0.02 x Gaussian): a stack of 4 experts [1024, 1024], ERNIE-4.5-21B-A3B's expert
   up_gate_proj [2560, 3072] and down_proj [1536, 2560] (with --big also the 300B's
   up_gate_proj [8192, 7168]), best of --repeat; throughput is the input's bf16 bytes per
   second. Peers in the same run: `np.copyto` of the bytes (the bandwidth floor) and
   `weight_quantize(w, 4)` (wint4's per-channel int4, the path the early MoE layers take). The
   last line projects the time to encode the 300B's 2-bit experts at the measured rate.
3. **Reconstruction error** (relative Frobenius, ||W' - W|| / ||W||) of [1536, 2560] weights
   drawn from a Gaussian, a Student-t(4) and a Laplace distribution, and of each routed expert
   stack of the tiny ERNIE-4.5-21B-A3B built with hidden and expert width 128 (generated
   weights; the built-in @tiny has K = 80, which WINT2 cannot pack): WINT2 (refine 1 and 0)
   against plain 2-bit at the same bits (`plain2_sym`: symmetric 4-level with WINT2's scale
   format), GPTQ's RTN asymmetric 2-bit per 64 rows (`rtn2_asym`, 0.5 more bits per weight)
   and wint4 (per-channel int4, `weight_quantize` + `weight_dequantize`). Then that model's
   logits (2 x 12 seeded token ids) against float for wint8mix and for wint2 with one and with
   both MoE layers 2-bit.
4. **Bytes per parameter** of `ernie-4.5-300b-a47b@meta` (no weights: params carry types) after
   each preset's pipeline: the sum of every param's storage bytes / the float params of the
   source graph, overall, for the routed experts (`.mlp.experts.`) and for the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from ernie_ir.frontends import GeneratedWeights, build_graph, parse_config
from ernie_ir.frontends.builtins import TINY_SEED, builtin_config
from ernie_ir.ir import DType, Graph
from ernie_ir.load import load_input
from ernie_ir.ops.quant_numerics import weight_dequantize, weight_quantize
from ernie_ir.ops.wint2 import wint2_codebook
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.quant.wint2_encoder import (
    DEFAULT_CODEBOOKS,
    nearest_codes,
    plain2_sym,
    rtn2_asym,
    wint2_encode,
)
from ernie_ir.runtime.interpreter import run_graph

BF16 = ml_dtypes.bfloat16
META = "ernie-4.5-300b-a47b"
PRESETS = (("float", ""), ("wint8mix", "wint8mix"), ("wint4", "wint4"), ("w4a8c8", "w4a8c8,wint8"),
           ("wint2", "wint2,wint8mix"))
K128 = {"hidden_size": 128, "moe_intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4}
ROUTED = ".mlp.experts."


def best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def rel(x: np.ndarray, w: np.ndarray) -> float:
    a, b = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# -- 1. codebooks -------------------------------------------------------------------------------


def _best_over_scales(mse_at: Callable[[float], float], lo: float, hi: float) -> tuple[float, float]:
    """(min mse, its scale): a 21-point grid on [lo, hi], then 21 points around the best."""
    grid = np.linspace(lo, hi, 21)
    best = min((mse_at(float(s)), float(s)) for s in grid)
    step = grid[1] - grid[0]
    fine = np.linspace(best[1] - step, best[1] + step, 21)
    return min(best, *((mse_at(float(s)), float(s)) for s in fine))


def codebook_quality(vectors: int = 65536, threads: int | None = None) -> list[dict[str, Any]]:
    v = np.random.default_rng(0).standard_normal((vectors, 4)).astype(np.float32)
    rows = []
    for cs, zp in DEFAULT_CODEBOOKS:
        points = wint2_codebook(np.float32(cs), np.float32(zp)).astype(np.float32)

        def mse(s: float, points: np.ndarray = points, book: tuple[float, float] = (cs, zp)) -> float:
            codes = nearest_codes(v / np.float32(s), book, threads)
            return float(np.square(v - np.float32(s) * points[codes]).mean(dtype=np.float64))

        err, scale = _best_over_scales(mse, 0.03, 0.10)
        rows.append({"codebook": f"({cs:g}, {zp:g})", "mse": err, "scale": scale,
                     "distinct_points": len(np.unique(points, axis=0))})

    def uniform(step: float) -> float:
        lv = np.clip(np.floor(v / np.float32(step)), -2, 1) + np.float32(0.5)
        return float(np.square(v - lv * np.float32(step)).mean(dtype=np.float64))

    err, step = _best_over_scales(uniform, 0.7, 1.3)
    rows.append({"codebook": "uniform 4-level (plain 2-bit)", "mse": err, "scale": step,
                 "distinct_points": 256})
    return rows


# -- 2. throughput ------------------------------------------------------------------------------


def throughput(repeat: int, threads: int, big: bool) -> list[dict[str, Any]]:
    shapes = [("4 experts x [1024, 1024]", (4, 1024, 1024)), ("21B up_gate_proj [2560, 3072]", (2560, 3072)),
              ("21B down_proj [1536, 2560]", (1536, 2560))]
    if big:
        shapes.append(("300B up_gate_proj [8192, 7168]", (8192, 7168)))
    rows = []
    rng = np.random.default_rng(1)
    for label, shape in shapes:
        w = (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(BF16)
        dst = np.empty_like(w)
        qbuf = np.empty(shape, np.int8)
        times = {
            "copyto": best_of(lambda w=w, dst=dst: np.copyto(dst, w), max(3, repeat)),
            "wint4": best_of(lambda w=w, q=qbuf: weight_quantize(w, 4, -1, threads=threads, out=q), repeat),
            "wint2": best_of(lambda w=w: wint2_encode(w, threads=threads), repeat),
            "wint2 refine=0": best_of(lambda w=w: wint2_encode(w, refine=0, threads=threads), repeat),
        }
        rows.append({"weight": label, "params": int(w.size), "bytes": int(w.nbytes), "seconds": times})
        print(f"# throughput {label}: wint2 {times['wint2']:.2f} s", flush=True)
    return rows


# -- 3. error -----------------------------------------------------------------------------------


def errors_of(w: np.ndarray, threads: int) -> dict[str, float]:
    q, s = weight_quantize(w, 4)
    return {"wint2": wint2_encode(w, threads=threads).relative_error,
            "wint2 refine=0": wint2_encode(w, refine=0, threads=threads).relative_error,
            "plain2_sym": rel(plain2_sym(w), w), "rtn2_asym": rel(rtn2_asym(w), w),
            "wint4": rel(weight_dequantize(q, s), w)}


def build_k128() -> Graph:
    """The tiny ERNIE-4.5-21B-A3B with hidden and expert width 128 (as tests/quant/test_wint2.py)."""
    cfg = {**builtin_config("ernie-4.5-21b-a3b", "tiny"), **K128}
    return build_graph(parse_config(cfg, "ernie-4.5-21b-a3b@tiny+k128"), GeneratedWeights(TINY_SEED),
                       name="ernie-4.5-21b-a3b")


def reconstruction(threads: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rng = np.random.default_rng(2)
    shape = (1536, 2560)
    draws = {"gaussian [1536, 2560]": rng.standard_normal(shape),
             "student-t(4) [1536, 2560]": rng.standard_t(4, size=shape),
             "laplace [1536, 2560]": rng.laplace(size=shape)}
    rows = []
    for label, w in draws.items():
        rows.append({"weight": label, **errors_of((0.02 * w).astype(BF16), threads)})
        print(f"# error {label}: done", flush=True)
    g = build_k128()
    for name, p in g.params.items():
        if ROUTED in name and name.endswith(".weight"):
            w = np.asarray(p.read())
            rows.append({"weight": f"h128 model {name.removeprefix('ernie.')} {list(w.shape)}",
                         **errors_of(w, threads)})
    ids = np.random.default_rng(0).integers(0, 1024, size=(2, 12))
    base = run_graph(g, {"input_ids": ids})["logits"]
    ends = []
    for label, pipeline in (("wint8mix (int4 experts)", "wint8mix"),
                            ("wint2, layer 2 2-bit", "wint2{w4_end_layer=1},wint8mix"),
                            ("wint2, layers 1-2 2-bit", "wint2{w4_end_layer=0},wint8mix")):
        q = build_k128()
        run_pipeline(q, pipeline)
        out = run_graph(q, {"input_ids": ids})["logits"]
        ends.append({"config": label, "pipeline": pipeline, "logits_rel": rel(out, base),
                     "top1": float(np.mean(out.argmax(-1) == base.argmax(-1)))})
    return rows, ends


# -- 4. bytes per parameter ---------------------------------------------------------------------


def preset_bytes() -> list[dict[str, Any]]:
    rows = []
    source: dict[str, int] = {}
    for label, pipeline in PRESETS:
        g = load_input(META, meta=True)
        if not source:
            source = {"all": 0, "routed": 0}
            for name, p in g.params.items():
                if p.type.dtype.is_float:
                    source["all"] += int(p.type.numel())
                    source["routed"] += int(p.type.numel()) if ROUTED in name else 0
        t = time.perf_counter()
        if pipeline:
            run_pipeline(g, pipeline)
        seconds = time.perf_counter() - t
        total = routed = 0
        for name, p in g.params.items():
            nbytes = p.type.nbytes()
            total += nbytes
            routed += nbytes if ROUTED in name else 0
        rows.append({"preset": label, "pipeline": pipeline or "(none)", "bytes": total,
                     "routed_bytes": routed,
                     "params": source["all"], "routed_params": source["routed"], "pipeline_s": seconds,
                     "wint2": g.metadata.get("wint2")})
    return rows


# -- report -------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> None:
    print("\n## 1. codebooks: MSE per unit-variance weight (65,536 Gaussian 4-vectors, best scale)\n")
    print("| codebook (code_scale, code_zp) | MSE | best scale | distinct points | vs plain 2-bit |\n"
          "|---|---|---|---|---|")
    plain = results["codebooks"][-1]["mse"]
    for r in results["codebooks"]:
        print(f"| {r['codebook']} | {r['mse']:.4f} | {r['scale']:.4f} | {r['distinct_points']} | "
              f"{r['mse'] / plain:.3f} |")

    print(f"\n## 2. encoder throughput (bf16 input bytes / s; best of {results['repeat']}, "
          f"{results['threads']} thread(s), {os.cpu_count()} cpus)\n")
    print("| weight | MB | copyto GB/s | wint4 GB/s | wint2 GB/s | wint2 refine=0 GB/s | wint2 / wint4 time "
          "| Mparams/s |\n|---|---|---|---|---|---|---|---|")
    rate = []
    for r in results["throughput"]:
        t, b = r["seconds"], r["bytes"]
        rate.append(r["params"] / t["wint2"])
        print(f"| {r['weight']} | {b / 1e6:.1f} | {b / t['copyto'] / 1e9:.2f} | {b / t['wint4'] / 1e9:.3f} | "
              f"{b / t['wint2'] / 1e9:.4f} | {b / t['wint2 refine=0'] / 1e9:.4f} | "
              f"{t['wint2'] / t['wint4']:.0f}x | {r['params'] / t['wint2'] / 1e6:.2f} |")
    w2 = next(r for r in results["bytes"] if r["preset"] == "wint2")
    meta = w2["wint2"] or {}
    # the 2-bit experts' float params: each u8 code holds 4 of them
    n2 = 4 * results["w2_code_bytes"]
    slowest = min(rate)
    print(f"\nThe 300B's 2-bit experts (layers {meta.get('w2_start_layer')}-{meta.get('w2_end_layer')}, "
          f"{n2 / 1e9:.1f} B params) at {slowest / 1e6:.2f} Mparams/s (the slowest row): "
          f"{n2 / slowest / 3600:.1f} h on {results['threads']} thread(s).")

    print("\n## 3. reconstruction error ||W' - W||_F / ||W||_F\n")
    cols = ("wint2", "wint2 refine=0", "plain2_sym", "rtn2_asym", "wint4")
    print("| weight | " + " | ".join(cols) + " | wint2 / plain2 | wint2 / wint4 |\n|---|"
          + "---|" * (len(cols) + 2))
    for r in results["errors"]:
        print(f"| {r['weight']} | " + " | ".join(f"{r[c]:.4f}" for c in cols)
              + f" | {r['wint2'] / r['plain2_sym']:.3f} | {r['wint2'] / r['wint4']:.2f} |")
    print("\n(bits per weight, K input rows: wint2 2 + 4/64 + 80/K (2.11 at K = 1536), plain2_sym "
          "2 + 4/64 + 16/K, rtn2_asym 2 + 32/64, wint4 4 + 16/K)")
    print("\n| h128 model, end to end | pipeline | logits rel error vs float | top-1 agreement |\n"
          "|---|---|---|---|")
    for r in results["end_to_end"]:
        print(f"| {r['config']} | `{r['pipeline']}` | {r['logits_rel']:.4f} | {r['top1']:.3f} |")

    rows = results["bytes"]
    fl, mix = rows[0], next(r for r in rows if r["preset"] == "wint8mix")
    print(f"\n## 4. {META}@meta: storage bytes per float parameter of the source graph "
          f"({fl['params'] / 1e9:.1f} B params, {fl['routed_params'] / 1e9:.1f} B in routed experts)\n")
    print("| preset | pipeline | GB | GiB | bytes / param | routed experts bits / param | rest bits / param "
          "| vs float | vs wint8mix |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rest_params = r["params"] - r["routed_params"]
        print(f"| {r['preset']} | `{r['pipeline']}` | {r['bytes'] / 1e9:.1f} | {r['bytes'] / 2 ** 30:.1f} | "
              f"{r['bytes'] / r['params']:.4f} | {8 * r['routed_bytes'] / r['routed_params']:.3f} | "
              f"{8 * (r['bytes'] - r['routed_bytes']) / rest_params:.3f} | {r['bytes'] / fl['bytes']:.3f} | "
              f"{r['bytes'] / mix['bytes']:.3f} |")
    if meta:
        print(f"\n(wint2: MoE layers up to {meta['w4_end_layer']} INT4, layers {meta['w2_start_layer']}-"
              f"{meta['w2_end_layer']} 2-bit, as FastDeploy's published split; REFERENCE 14: WINT2 fits one "
              f"141 GB card, W4A8 needs 4 x 80 GB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2, help="timed rounds per encoder case (best of)")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--big", action="store_true", help="also time a 300B expert [8192, 7168] (slow)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results: dict[str, Any] = {"repeat": args.repeat, "threads": args.threads}
    results["bytes"] = preset_bytes()
    g = load_input(META, meta=True)
    run_pipeline(g, "wint2")
    results["w2_code_bytes"] = sum(p.type.nbytes() for n, p in g.params.items()
                                   if n.endswith(".quant_weight") and p.type.dtype == DType.U8)
    results["codebooks"] = codebook_quality(threads=args.threads)
    print("# codebooks: done", flush=True)
    results["throughput"] = throughput(args.repeat, args.threads, args.big)
    results["errors"], results["end_to_end"] = reconstruction(args.threads)
    report(results)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
