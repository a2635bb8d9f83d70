"""Batch-1 next-token latency of the ONNX executable: wint8mix vs float32, same run.

The model: ERNIE 4.5 0.3B widths (hidden 1024, 16 heads / 2 kv heads, head
dim 128, intermediate 3072, vocab 103424 unless --vocab) with 2 layers,
seeded generated weights (the frontends' config machinery + GeneratedWeights),
lowered for cuda like `ernie-ir compile --target cuda [--quant wint8mix]`,
exported with `emit_onnx`. Per-token latency = one forward on a 1-token input
(no KV cache: a 1-token forward is what a decode step costs in weight reads),
median of --repeat runs after warm-up, onnxruntime CPU EP.

Settings (each a separate session on the same file):
  exact  ORT_ENABLE_BASIC (+ qdq_matmulnbits_accuracy_level=0): DequantizeLinear + MatMul
         kept as written, numerics equal the interpreter's (the dequantize runs every call)
  fast   ORT_ENABLE_ALL, onnxruntime's default accuracy level 4: DQ + MatMul fused into
         MatMulNBits that quantises activations to int8 (numerics change)
  nbits  the "matmulnbits" export form (what compile writes: accuracy_level 1, exact, the file
         fixes it) in onnxruntime's default session

MoE (--moe, on by default): an ERNIE-4.5-MoE-shaped model (ernie-4.5-21b-a3b's config: 64
experts top-6, 2 shared experts, every layer MoE) at --moe-hidden / --moe-inter widths (default
1024 / 768: 600 MB of float32 expert weights per layer, so the expert matmuls dominate), --moe-layers
layers (default 4), vocab --moe-vocab. Dense MoE (every expert on every token: `emit_onnx`
under `dense_moe()`, the Paddle layer with `moe_dense`) against sparse MoE (the default: only
the routed experts run), for float32 and wint8mix exact / fast ONNX sessions and the eager
Paddle layer (float32), per --moe-tokens-token forward. Goal: sparse >= 5x faster than dense at E=64, k=6.

Measured (2 cores, quiet, 1 token, 4 layers, medians, 2026-12-01, --moe-only):
  onnx float32 exact   dense   89 ms  sparse  16 ms  (5.5-5.7x)
  paddle float32       dense  167 ms  sparse  32 ms  (5.2x; eager groups the routed rows on the host)
  onnx wint8mix exact  dense 2041 ms  sparse 133 ms  (15x)
  onnx wint8mix fast   dense 2047 ms  sparse 5.1 ms (400x; 0.32x float32 sparse)
Float32 is bound by weight reads: sparse reads 6 of 64 experts plus what every token reads
(2 shared experts, attention, lm_head), an ideal ratio of about 6.7x at these widths; an
expert's If/NonZero/Gather overhead is under 1 us. Sparse wint8mix fast runs each routed expert
as MatMulNBits (int4, int8 activations); exact keeps the bf16 rounding of each dequantized
expert weight (the interpreter's numerics), so it dequantizes the routed experts' int4 weights
(DequantizeLinear + Cast) on every call, which is most of its time.

    python benchmarks/decode_latency.py [--layers 2] [--vocab 103424] [--threads 2] [--repeat 20]
                                        [--no-moe] [--moe-only] [--moe-tokens 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ernie_ir.frontends.builtins import TINY_SEED, builtin_config
from ernie_ir.frontends.config import parse_config
from ernie_ir.frontends.loader import GeneratedWeights, _finish, build_graph
from ernie_ir.ir import Graph
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.base import graph_properties
from ernie_ir.passes.pipeline import load_pipeline
from ernie_ir.passes.quant_cli import pipeline_for
from ernie_ir.runtime.onnx_backend import session
from ernie_ir.targets.emit_onnx import dense_moe, emit_onnx


def build(layers: int, vocab: int, quant: str | None) -> Graph:
    config = builtin_config("ernie-4.5-0.3b", "meta")
    config.update({"num_hidden_layers": layers, "vocab_size": vocab})
    cfg = parse_config(config, "decode_latency")
    graph = _finish(build_graph(cfg, GeneratedWeights(TINY_SEED), name="ernie-4.5-0.3b-2l"), cfg,
                    {"source": "decode_latency", "weights": "generated"})
    quant_text = pipeline_for(quant, None, None, None, None, None)
    parts = [p for p in (quant_text, "legalize-cuda{cuda_arch=80}") if p]
    run_pipeline(graph, load_pipeline(",".join(parts), initial=graph_properties(graph)))
    return graph


def build_moe(layers: int, vocab: int, hidden: int, inter: int, quant: str | None) -> Graph:
    """ernie-4.5-21b-a3b's shape (64 experts, top-6, 2 shared) at the given widths, all layers MoE."""
    config = builtin_config("ernie-4.5-21b-a3b", "meta")
    config.update({"num_hidden_layers": layers, "vocab_size": vocab, "hidden_size": hidden,
                   "num_attention_heads": hidden // 128, "num_key_value_heads": max(1, hidden // 512),
                   "head_dim": 128, "moe_intermediate_size": inter, "intermediate_size": 4 * hidden,
                   "moe_layer_start_index": 0, "moe_layer_end_index": layers - 1,
                   "num_nextn_predict_layers": 0})
    cfg = parse_config(config, "decode_latency-moe")
    graph = _finish(build_graph(cfg, GeneratedWeights(TINY_SEED), name="ernie-4.5-moe-e64k6"), cfg,
                    {"source": "decode_latency", "weights": "generated"})
    quant_text = pipeline_for(quant, None, None, None, None, None)
    parts = [p for p in (quant_text, "legalize-cuda{cuda_arch=80}") if p]
    run_pipeline(graph, load_pipeline(",".join(parts), initial=graph_properties(graph)))
    return graph


def paddle_latency(graph: Graph, *, dense: bool, ids: np.ndarray, repeat: int) -> tuple[float, np.ndarray]:
    import paddle

    from ernie_ir.runtime.paddle_layer import build_layer

    layer = build_layer(graph, device="cpu")
    layer.moe_dense = dense
    layer.eval()
    x = paddle.to_tensor(ids)
    with paddle.no_grad():
        out = layer(x).numpy()
        for _ in range(2):
            layer(x)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            layer(x).numpy()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def moe_rows(args: argparse.Namespace, tmp: str) -> dict[str, object]:
    ids = (np.arange(args.moe_tokens, dtype=np.int64)[None, :] * 37 + 17) % args.moe_vocab
    ms: dict[str, float] = {}
    outs: dict[str, np.ndarray] = {}
    for quant in (None, "wint8mix"):
        graph = build_moe(args.moe_layers, args.moe_vocab, args.moe_hidden, args.moe_inter, quant)
        label = quant or "float32"
        for form in ("dense", "sparse"):
            for setting in ("exact", "fast") if quant else ("exact",):  # the file fixes its numerics
                folder = Path(tmp) / f"moe-{label}-{form}-{setting}"
                if form == "dense":
                    with dense_moe():
                        path, _ = emit_onnx(graph, folder, numerics=setting)
                else:
                    path, _ = emit_onnx(graph, folder, numerics=setting)
                key = f"onnx {label} {setting} {form}"
                ms[key], outs[key] = latency(path, fast=False, threads=args.threads, repeat=args.moe_repeat,
                                             ids=ids)
                print(f"{key:34s} {ms[key]:9.2f} ms/forward", flush=True)
                for p in folder.iterdir():
                    p.unlink()  # free the disk before the next export
        if quant is None and not args.no_paddle:
            for form in ("dense", "sparse"):
                key = f"paddle float32 {form}"
                ms[key], outs[key] = paddle_latency(graph, dense=form == "dense", ids=ids,
                                                    repeat=args.moe_repeat)
                print(f"{key:34s} {ms[key]:9.2f} ms/forward", flush=True)
        del graph
    speedup = {k.removesuffix(" sparse"): ms[k.replace(" sparse", " dense")] / ms[k]
               for k in ms if k.endswith(" sparse")}
    agree = {k.removesuffix(" sparse"): float(np.abs(outs[k] - outs[k.replace(" sparse", " dense")]).max())
             for k in outs if k.endswith(" sparse")}
    return {"ms_per_forward": ms, "speedup_sparse_over_dense": speedup,
            "max_abs_logit_diff_sparse_vs_dense": agree,
            "logit_scale": float(np.abs(outs["onnx float32 exact dense"]).max()),
            "goal_sparse_5x_met": all(v >= 5.0 for v in speedup.values()),
            "experts": 64, "top_k": 6, "hidden": args.moe_hidden, "moe_intermediate": args.moe_inter,
            "layers": args.moe_layers, "tokens": args.moe_tokens}


def latency(path: Path, *, fast: bool, threads: int, repeat: int,
            ids: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    sess = session(path, fast=fast, threads=threads)
    feed = {sess.get_inputs()[0].name: np.array([[17]], dtype=np.int64) if ids is None else ids}
    out = sess.run(None, feed)[0]
    for _ in range(3):
        sess.run(None, feed)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=103424)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--no-moe", action="store_true", help="skip the dense vs sparse MoE comparison")
    ap.add_argument("--moe-only", action="store_true", help="only the dense vs sparse MoE comparison")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--moe-hidden", type=int, default=1024)
    ap.add_argument("--moe-inter", type=int, default=768)
    ap.add_argument("--moe-vocab", type=int, default=8192)
    ap.add_argument("--moe-tokens", type=int, default=1)
    ap.add_argument("--moe-repeat", type=int, default=10)
    ap.add_argument("--no-paddle", action="store_true", help="MoE: skip the Paddle layer rows")
    args = ap.parse_args()
    if args.moe_only:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps({"moe": moe_rows(args, tmp)}, indent=2))
        return
    rows: dict[str, float] = {}
    outs: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for quant in (None, "wint8mix"):
            graph = build(args.layers, args.vocab, quant)
            label = quant or "float32"
            forms = ("qdq", "matmulnbits") if quant else ("qdq",)
            for form in forms:
                path, data = emit_onnx(graph, Path(tmp) / f"{label}-{form}", form=form)
                settings = (("exact", False), ("fast", True)) if form == "qdq" else (("nbits", False),)
                for setting, fast in settings:
                    key = f"{label} {setting}"
                    rows[key], outs[key] = latency(path, fast=fast, threads=args.threads, repeat=args.repeat)
                    mib = data.stat().st_size / 2**20
                    print(f"{key:18s} {rows[key]:9.2f} ms/token   ({mib:.0f} MiB weights)", flush=True)
    ref = outs["float32 exact"]
    scale = float(np.abs(ref).max())
    report = {
        "ms_per_token": rows,
        "ratio_wint8mix_over_float32": {
            s: rows[f"wint8mix {s}"] / rows[f"float32 {t}"]
            for s, t in (("exact", "exact"), ("fast", "fast"), ("nbits", "exact"))},
        "fast_vs_exact_max_abs_logit_diff": {
            "float32": float(np.abs(outs["float32 fast"] - ref).max()),
            "wint8mix": float(np.abs(outs["wint8mix fast"] - outs["wint8mix exact"]).max()),
            "wint8mix nbits": float(np.abs(outs["wint8mix nbits"] - outs["wint8mix exact"]).max()),
        },
        "logit_scale": scale,
        "threads": args.threads, "layers": args.layers, "vocab": args.vocab,
    }
    if not args.no_moe:
        with tempfile.TemporaryDirectory() as tmp:
            report["moe"] = moe_rows(args, tmp)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
