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
  nbits  the "matmulnbits" export form (accuracy_level 0, exact) under ORT_ENABLE_BASIC

    python benchmarks/decode_latency.py [--layers 2] [--vocab 103424] [--threads 2] [--repeat 20]
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
from ernie_ir.targets.emit_onnx import emit_onnx


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


def latency(path: Path, *, fast: bool, threads: int, repeat: int) -> tuple[float, np.ndarray]:
    sess = session(path, fast=fast, threads=threads)
    feed = {sess.get_inputs()[0].name: np.array([[17]], dtype=np.int64)}
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
    args = ap.parse_args()
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
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
