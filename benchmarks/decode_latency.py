"""Batch-1 decode-step latency of the ONNX executable in every numerics mode, against float32 and
against the interpreter, in one run.

Two models, each built twice (float32 and wint8mix, lowered for cuda sm80 like `ernie-ir compile
--target cuda`), with seeded generated weights (the frontends' config machinery +
GeneratedWeights):

- dense: ERNIE 4.5 0.3B as published (hidden 1024, 16 heads / 2 kv heads, head dim 128,
  intermediate 3072, vocab --vocab, 103424, tied float32 head) with --layers layers (default 18,
  the published count: with fewer, the head that no preset quantizes is most of the bytes read);
  a 1-token forward (no KV cache: what a decode step costs in weight reads);
- MoE (--no-moe skips it): ernie-4.5-21b-a3b's shape (64 experts top-6, 2 shared, every layer
  MoE) at --moe-hidden / --moe-inter widths (default 1024 / 768: the expert matmuls dominate),
  --moe-layers layers, vocab --moe-vocab, a --moe-tokens-token forward; the float32 file also in
  its dense-MoE checking form (every expert on every token) and the eager Paddle layer (float32)
  dense and sparse, for the sparse-over-dense ratio (goal: >= 5x at E=64, k=6).

ONNX files, each in onnxruntime's default session (`InferenceSession(path)`: the file fixes its
numerics): float32, and wint8mix in each `--onnx-numerics` mode:
  weight-only  (the default) float32 activations, every quantized weight dequantized in float32
               inside a MatMulNBits (accuracy_level 1); drops the bf16 rounding of dequantized
               weights (MoE experts, kernel fallbacks) that the IR states
  exact        the interpreter's numerics bit for bit: routed experts dequantized and rounded to
               bf16 (DequantizeLinear + Cast) on every call
  fast         int8 activations (accuracy_level 4)
Each row: ms per forward (median of about --repeat calls after warm-up, the executables taking
turns in blocks of 5 calls so that the machine's load falls on all alike), the ratio to
float32, and the
logits against the interpreter on the same graph: max abs error, relative (Frobenius) error,
top-1 agreement. With --runs N the script repeats the timing N times in this process and reports
each ratio's min / median / max (the machine is noisy: compare ratios, not milliseconds).

Measured (2 cores, quiet, 2026-12-01, --runs 3 --repeat 15, min / median / max of the ratio to
ONNX float32): dense weight-only 0.86 / 0.87 / 0.92, exact 0.90 / 0.90 / 0.94, fast 0.51 / 0.53 /
0.64; MoE weight-only 0.58 / 0.64 / 0.67, exact 6.8 / 7.2 / 7.6, fast 0.46 / 0.53 / 0.57; sparse
over dense MoE: ONNX float32 4.74 / 4.75 / 4.84, Paddle float32 5.12 / 5.31 / 5.55. Errors and the
reasons: docs/targets.md ("Latency of the three numerics").

    python benchmarks/decode_latency.py [--layers 18] [--vocab 103424] [--threads 2] [--repeat 20]
                                        [--runs 1] [--no-moe] [--moe-only] [--moe-tokens 1]
                                        [--no-paddle]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ernie_ir.backends.onnx.lower import NUMERICS, dense_moe, emit_onnx
from ernie_ir.backends.onnx.session import full_sequence_feeds, session
from ernie_ir.frontends.builtins import TINY_SEED, builtin_config
from ernie_ir.frontends.config import parse_config
from ernie_ir.frontends.loader import GeneratedWeights, _finish, build_graph
from ernie_ir.ir import Graph
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.infra.base import graph_properties
from ernie_ir.passes.infra.pipeline import load_pipeline
from ernie_ir.passes.quant.cli_flags import pipeline_for
from ernie_ir.runtime import run_graph
from ernie_ir.runtime.compare import compare_logits

QUANT = "wint8mix"


def _lower(config: dict, name: str, quant: str | None) -> Graph:
    cfg = parse_config(config, name)
    graph = _finish(build_graph(cfg, GeneratedWeights(TINY_SEED), name=name), cfg,
                    {"source": "decode_latency", "weights": "generated"})
    quant_text = pipeline_for(quant, None, None, None, None, None)
    parts = [p for p in (quant_text, "legalize-cuda{cuda_arch=80}") if p]
    run_pipeline(graph, load_pipeline(",".join(parts), initial=graph_properties(graph)))
    return graph


def build(layers: int, vocab: int, quant: str | None) -> Graph:
    """ERNIE 4.5 0.3B widths with `layers` layers."""
    config = builtin_config("ernie-4.5-0.3b", "meta")
    config.update({"num_hidden_layers": layers, "vocab_size": vocab})
    return _lower(config, "ernie-4.5-0.3b-shaped", quant)


def build_moe(layers: int, vocab: int, hidden: int, inter: int, quant: str | None) -> Graph:
    """ernie-4.5-21b-a3b's shape (64 experts, top-6, 2 shared) at the given widths, all layers MoE."""
    config = builtin_config("ernie-4.5-21b-a3b", "meta")
    config.update({"num_hidden_layers": layers, "vocab_size": vocab, "hidden_size": hidden,
                   "num_attention_heads": hidden // 128, "num_key_value_heads": max(1, hidden // 512),
                   "head_dim": 128, "moe_intermediate_size": inter, "intermediate_size": 4 * hidden,
                   "moe_layer_start_index": 0, "moe_layer_end_index": layers - 1,
                   "num_nextn_predict_layers": 0})
    return _lower(config, "ernie-4.5-moe-e64k6", quant)


def _interleaved_ms(runners: dict[str, Callable[[], object]], repeat: int,
                    block: int = 5) -> dict[str, float]:
    """Median ms per call of each runner, the runners taking turns in blocks of `block` calls, so
    that a change of load on this shared machine falls on all of them alike (their ratios are
    what we report). Blocks, not single calls: an onnxruntime session's threads spin for a while
    after its call and would slow whichever session runs next; the median drops that first call."""
    for run in runners.values():
        run()
        run()
    times: dict[str, list[float]] = {key: [] for key in runners}
    for _ in range(max(1, -(-repeat // block))):
        for key, run in runners.items():
            for _ in range(block):
                t0 = time.perf_counter()
                run()
                times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def _onnx_runner(path: Path, ids: np.ndarray, threads: int) -> tuple[Callable[[], np.ndarray], np.ndarray]:
    sess = session(path, threads=threads)
    feed = full_sequence_feeds(sess, ids)  # a decoder (compile's form) gets a mask, positions, an empty past

    def run() -> np.ndarray:
        return sess.run(None, feed)[0]

    return run, run()


def _paddle_runners(graph: Graph, ids: np.ndarray) -> dict[str, Callable[[], np.ndarray]]:
    """The eager Paddle layer's MoE sparse and dense (one layer: the form is chosen per call)."""
    import paddle

    from ernie_ir.backends.paddle.layer import build_layer

    layer = build_layer(graph, device="cpu")
    layer.eval()
    x = paddle.to_tensor(ids)

    def runner(dense: bool) -> Callable[[], np.ndarray]:
        def run() -> np.ndarray:
            layer.moe_dense = dense
            with paddle.no_grad():
                return layer(x).numpy()
        return run

    return {"paddle float32 dense-moe": runner(True), "paddle float32 sparse": runner(False)}


def _accuracy(out: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    c = compare_logits(out, ref)
    return {"max_abs_error": c.max_abs_error, "rel_error": c.rel_error, "top1_agreement": c.top1_agreement}


def measure(name: str, graphs: dict[str, Graph], ids: np.ndarray, tmp: Path, args: argparse.Namespace, *,
            moe: bool) -> dict[str, object]:
    """Every executable of one model: its runners timed --runs times, its logits judged once."""
    runners: dict[str, Callable[[], np.ndarray]] = {}
    accuracy: dict[str, dict[str, float]] = {}
    for label, graph in graphs.items():
        ref = run_graph(graph, {"input_ids": ids})["logits"]
        modes = NUMERICS if label == QUANT else ("weight-only",)  # float32: no quantized weight
        for mode in modes:
            key = f"onnx {label}" + (f" {mode}" if label == QUANT else "")
            path, _ = emit_onnx(graph, tmp / f"{name}-{label}-{mode}", numerics=mode)
            runners[key], out = _onnx_runner(path, ids, args.threads)
            accuracy[key] = _accuracy(out, ref)
        if moe and label == "float32":
            with dense_moe():
                path, _ = emit_onnx(graph, tmp / f"{name}-{label}-dense")
            runners["onnx float32 dense-moe"], out = _onnx_runner(path, ids, args.threads)
            accuracy["onnx float32 dense-moe"] = _accuracy(out, ref)
            if not args.no_paddle:
                for key, run in _paddle_runners(graph, ids).items():
                    runners[key] = run
                    accuracy[key] = _accuracy(run(), ref)
    runs: list[dict[str, float]] = []
    for r in range(args.runs):
        ms = _interleaved_ms(runners, args.repeat)
        runs.append(ms)
        print(f"{name} run {r + 1}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), flush=True)
    ratios: dict[str, list[float]] = {
        f"{key} / onnx float32": [ms[key] / ms["onnx float32"] for ms in runs]
        for key in runners if key.startswith(f"onnx {QUANT}")}
    if moe:
        ratios["onnx float32: dense-moe / sparse"] = [ms["onnx float32 dense-moe"] / ms["onnx float32"]
                                                      for ms in runs]
        if not args.no_paddle:
            ratios["paddle float32: dense-moe / sparse"] = [
                ms["paddle float32 dense-moe"] / ms["paddle float32 sparse"] for ms in runs]
    spread = {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in ratios.items()}
    return {"ms_per_forward_median_of_runs": {k: statistics.median(ms[k] for ms in runs) for k in runners},
            "ratios": spread, "versus_interpreter": accuracy, "tokens": int(ids.size), "runs": args.runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--vocab", type=int, default=103424)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--runs", type=int, default=1, help="timing runs (ratios: min / median / max)")
    ap.add_argument("--no-moe", action="store_true", help="skip the MoE model")
    ap.add_argument("--moe-only", action="store_true", help="only the MoE model")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--moe-hidden", type=int, default=1024)
    ap.add_argument("--moe-inter", type=int, default=768)
    ap.add_argument("--moe-vocab", type=int, default=8192)
    ap.add_argument("--moe-tokens", type=int, default=1)
    ap.add_argument("--no-paddle", action="store_true", help="MoE: skip the Paddle layer rows")
    args = ap.parse_args()
    report: dict[str, object] = {"threads": args.threads, "quant": QUANT}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.moe_only:
            graphs = {label: build(args.layers, args.vocab, q)
                      for label, q in (("float32", None), (QUANT, QUANT))}
            report["dense"] = measure("dense", graphs, np.array([[17]], dtype=np.int64), Path(tmp), args,
                                      moe=False)
            del graphs
        if not args.no_moe:
            ids = (np.arange(args.moe_tokens, dtype=np.int64)[None, :] * 37 + 17) % args.moe_vocab
            graphs = {label: build_moe(args.moe_layers, args.moe_vocab, args.moe_hidden, args.moe_inter, q)
                      for label, q in (("float32", None), (QUANT, QUANT))}
            report["moe"] = measure("moe", graphs, ids, Path(tmp), args, moe=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
