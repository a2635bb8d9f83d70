"""Error and speed of the ONNX weight-only matmuls, `--onnx-numerics exact` vs `fast`.

Every session is onnxruntime's default (`InferenceSession(path)`, ORT_ENABLE_ALL): the file fixes
its numerics (MatMulNBits accuracy_level 1 = float32, 4 = int8 activations).

1. One layer (--k x --n, default 8192 x 7168, x [1, K], random N(0, 0.02) weights), in the
   emitter's layouts: float32 MatMul; int8 exact (two 4-bit planes, level 1), int8 fast (8-bit,
   level 4); int4 exact (level 1), int4 fast (level 4). Error: max |y - y_ref| / max |y_ref|
   against float64 on the same dequantized weights (the quantization error itself excluded).
2. A model (--model-layers of ERNIE 4.5 0.3B widths, vocab --vocab, lowered for cuda sm80,
   `emit_onnx(..., numerics=...)`): 1-token forward latency and max |logit error| against the
   interpreter on the same lowered graph (2 x 8 tokens).

    python benchmarks/onnx_numerics.py [--k 8192] [--n 7168] [--threads 2] [--repeat 20]
                                       [--rounds 3] [--model-layers 2] [--vocab 4096] [--no-model]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ernie_ir.backends.onnx.lower import emit_onnx
from ernie_ir.frontends.builtins import TINY_SEED, builtin_config
from ernie_ir.frontends.config import parse_config
from ernie_ir.frontends.loader import GeneratedWeights, _finish, build_graph
from ernie_ir.ir import Graph
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.infra.base import graph_properties
from ernie_ir.passes.infra.pipeline import load_pipeline
from ernie_ir.passes.quant.cli_flags import pipeline_for
from ernie_ir.runtime.interpreter import run_graph

BLOCK = 128


def _session(path: Path, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()  # onnxruntime's defaults, but a fixed thread count
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _time(sess: ort.InferenceSession, feeds: dict[str, np.ndarray], repeat: int) -> tuple[float, np.ndarray]:
    out = sess.run(None, feeds)[0]
    for _ in range(3):
        sess.run(None, feeds)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, out


def _nbits(x: str, v: np.ndarray, zero: int, bits: int, scales: np.ndarray, level: int, tag: str,
           zero_points: np.ndarray | None = None) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    k, n = v.shape
    bt = (v + zero).astype(np.uint8).T.reshape(n, k // BLOCK, BLOCK)
    if bits == 4:
        bt = (bt[..., 0::2] | (bt[..., 1::2] << 4)).astype(np.uint8)
    inits = [numpy_helper.from_array(np.ascontiguousarray(bt), f"{tag}.B"),
             numpy_helper.from_array(scales.astype(np.float32), f"{tag}.S")]
    inputs = [x, f"{tag}.B", f"{tag}.S"]
    if zero_points is not None:
        inits.append(numpy_helper.from_array(zero_points, f"{tag}.Z"))
        inputs.append(f"{tag}.Z")
    node = helper.make_node("MatMulNBits", inputs, [f"{tag}.y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=BLOCK, accuracy_level=level)
    return node, inits


def _layer_model(kind: str, w: np.ndarray) -> tuple[onnx.ModelProto, np.ndarray]:
    """(model, the float32 weight it computes with) for kind float32 | int8-exact | int8-fast | ..."""
    k, n = w.shape
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    if kind == "float32":
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["y"]))
        inits.append(numpy_helper.from_array(w, "w"))
        deq = w
    else:
        bits = 8 if kind.startswith("int8") else 4
        bound = 127 if bits == 8 else 7
        s = (np.abs(w).max(axis=0) / bound).astype(np.float32)
        q = np.clip(np.round(w / s), -bound, bound).astype(np.int32)
        deq = (q * s).astype(np.float32)
        scales = np.ascontiguousarray(np.repeat(s[None], k // BLOCK, 0).T).reshape(-1)
        level = 1 if kind.endswith("exact") else 4
        if bits == 8 and level == 1:  # the exporter's exact int8: q = 16 * hi + lo, two 4-bit planes
            zp = np.zeros(n * ((k // BLOCK + 1) // 2), np.uint8)
            hi, hi_inits = _nbits("x", q >> 4, 8, 4, scales * np.float32(16), 1, "hi")
            lo, lo_inits = _nbits("x", q & 15, 0, 4, scales, 1, "lo", zp)
            nodes += [hi, lo, helper.make_node("Add", ["hi.y", "lo.y"], ["y"])]
            inits += hi_inits + lo_inits
        else:
            node, more = _nbits("x", q, 1 << (bits - 1), bits, scales, level, "w")
            node.output[0] = "y"
            nodes.append(node)
            inits += more
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])
    graph = helper.make_graph(nodes, "layer", [x_info], [y_info], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model, deq


def bench_layer(k: int, n: int, threads: int, repeat: int, rounds: int,
                folder: Path) -> list[dict[str, object]]:
    """Each kind timed in `rounds` interleaved rounds; the best round's median is reported (the
    least disturbed by other load on a shared machine)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    x = rng.standard_normal((1, k)).astype(np.float32)
    kinds = ("float32", "int8-exact", "int8-fast", "int4-exact", "int4-fast")
    sessions, errors = {}, {}
    for kind in kinds:
        model, deq = _layer_model(kind, w)
        path = folder / f"layer-{kind}.onnx"
        onnx.save_model(model, str(path), save_as_external_data=True, location=f"layer-{kind}.data")
        del model
        sessions[kind] = _session(path, threads)
        y = sessions[kind].run(None, {"x": x})[0]
        ref = x.astype(np.float64) @ deq.astype(np.float64)
        errors[kind] = float(np.abs(y - ref).max() / np.abs(ref).max())
    best = {kind: _time(sessions[kind], {"x": x}, repeat)[0] for kind in kinds}
    for _ in range(rounds - 1):
        for kind in kinds:
            best[kind] = min(best[kind], _time(sessions[kind], {"x": x}, repeat)[0])
    return [{"layer": f"{k}x{n}", "kind": kind, "ms": round(best[kind], 3), "rel_error": errors[kind]}
            for kind in kinds]


def build(layers: int, vocab: int, quant: str | None) -> Graph:
    config = builtin_config("ernie-4.5-0.3b", "meta")
    config.update({"num_hidden_layers": layers, "vocab_size": vocab})
    cfg = parse_config(config, "onnx_numerics")
    graph = _finish(build_graph(cfg, GeneratedWeights(TINY_SEED), name="ernie-4.5-0.3b-widths"), cfg,
                    {"source": "onnx_numerics", "weights": "generated"})
    quant_text = pipeline_for(quant, None, None, None, None, None)
    parts = [p for p in (quant_text, "legalize-cuda{cuda_arch=80}") if p]
    run_pipeline(graph, load_pipeline(",".join(parts), initial=graph_properties(graph)))
    return graph


def bench_model(layers: int, vocab: int, threads: int, repeat: int, folder: Path) -> list[dict[str, object]]:
    ids = np.random.default_rng(1).integers(0, vocab, (2, 8))
    one = ids[:1, :1]
    rows = []
    base_ms = None
    for quant in (None, "wint8mix", "wint4"):
        graph = build(layers, vocab, quant)
        ref = run_graph(graph, {"input_ids": ids})["logits"]
        for numerics in (("exact",) if quant is None else ("exact", "fast")):
            out = folder / f"model-{quant}-{numerics}"
            path, _ = emit_onnx(graph, out, numerics=numerics)
            sess = _session(path, threads)
            ms, _ = _time(sess, {"input_ids": one}, repeat)
            got = sess.run(None, {"input_ids": ids})[0]
            base_ms = ms if quant is None else base_ms
            rows.append({"model": f"0.3b widths, {layers} layers, vocab {vocab}", "quant": quant or "float32",
                         "numerics": numerics, "ms_per_token": round(ms, 2),
                         "ratio_to_fp32": round(ms / base_ms, 2) if base_ms else None,
                         "max_abs_logit_error": float(np.abs(got - ref).max()),
                         "max_abs_logit": float(np.abs(ref).max())})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--no-model", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = bench_layer(args.k, args.n, args.threads, args.repeat, args.rounds, Path(tmp))
        if not args.no_model:
            rows += bench_model(args.model_layers, args.vocab, args.threads, args.repeat, Path(tmp))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
