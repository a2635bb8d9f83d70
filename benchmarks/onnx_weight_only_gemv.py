"""One decode-step matmul in onnxruntime's CPU kernels: float32 MatMul against weight-only
`com.microsoft.MatMulNBits` at each accuracy level, at the dense 0.3B model's widths.

Why this exists (issue 26): the default "weight-only" ONNX numerics must keep float32
activations and use the stored integer weights exactly, so its matmuls are MatMulNBits with
accuracy_level 1 (float32 compute; int8 weights as two 4-bit planes, because 8-bit at float32
accuracy is a slow path). Whether a quantized decode step can beat float32 then depends on that
kernel alone: this script times it, in one process, the sessions taking turns.

Rows, for x [M, K] (M = 1: one decode token) times a [K, N] weight, each session single-threaded
(--threads) at ORT_ENABLE_ALL (a bare `InferenceSession`): float32 `MatMul`; MatMulNBits 4-bit
and 8-bit with block --block at accuracy_level 1 (float32 compute, what the weight-only mode
writes), 0 (unset: float32) and 4 (int8 activations: the "fast" mode); the weight-only mode's
int8 form (two 4-bit MatMulNBits added). Each: median microseconds over --calls calls, repeated
--runs times (min / median / max of the ratio to float32).

Measured (2 cores, 2026-12-02, onnxruntime 1.32.0, K 1024 N 3072 M 1, block 128, 1 thread):
see the closing note of issue 26; the float32-compute forms are at or above float32 time, the
int8-activation form at about a third.

    python benchmarks/onnx_weight_only_gemv.py [--k 1024] [--n 3072] [--m 1] [--block 128]
                                               [--threads 1] [--calls 200] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _session(nodes: list, inits: list, k: int, n: int, m: int, threads: int):  # type: ignore[no-untyped-def]
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _nbits(name: str, out: str, k: int, n: int, bits: int, block: int, acc: int,
           rng: np.random.Generator) -> tuple[list, list]:
    from onnx import helper, numpy_helper

    blocks = -(-k // block)
    data = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
    scales = (rng.random(n * blocks, dtype=np.float32) + 0.5) * 0.01
    inits = [numpy_helper.from_array(data, f"{name}.q"), numpy_helper.from_array(scales, f"{name}.s")]
    node = helper.make_node("MatMulNBits", ["x", f"{name}.q", f"{name}.s"], [out], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=block, accuracy_level=acc)
    return [node], inits


def build(k: int, n: int, m: int, block: int, threads: int, seed: int = 0) -> dict[str, object]:
    """The sessions to compare, by row name."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n), dtype=np.float32)
    rows: dict[str, object] = {
        "float32 MatMul": _session([helper.make_node("MatMul", ["x", "w"], ["y"])],
                                   [numpy_helper.from_array(w, "w")], k, n, m, threads)}
    for bits, acc in ((4, 1), (4, 0), (8, 1), (4, 4), (8, 4)):
        nodes, inits = _nbits("b", "y", k, n, bits, block, acc, rng)
        rows[f"MatMulNBits {bits}-bit acc {acc}"] = _session(nodes, inits, k, n, m, threads)
    hi, hi_inits = _nbits("hi", "yh", k, n, 4, block, 1, rng)
    lo, lo_inits = _nbits("lo", "yl", k, n, 4, block, 1, rng)
    rows["int8 as 2 x 4-bit acc 1 (weight-only)"] = _session(
        [*hi, *lo, helper.make_node("Add", ["yh", "yl"], ["y"])], [*hi_inits, *lo_inits], k, n, m, threads)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    import onnxruntime as ort

    rows = build(args.k, args.n, args.m, args.block, args.threads)
    x = np.random.default_rng(1).standard_normal((args.m, args.k), dtype=np.float32)
    ratios: dict[str, list[float]] = {name: [] for name in rows}
    micros: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.runs):
        times: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(args.calls // 10):  # the sessions take turns, 10 calls each
            for name, sess in rows.items():
                t0 = time.perf_counter()
                for _ in range(10):
                    sess.run(None, {"x": x})  # type: ignore[attr-defined]
                times[name].append((time.perf_counter() - t0) / 10 * 1e6)
        base = statistics.median(times["float32 MatMul"])
        for name in rows:
            med = statistics.median(times[name])
            micros[name].append(med)
            ratios[name].append(med / base)
    print(f"onnxruntime {ort.__version__}: x [{args.m}, {args.k}] @ [{args.k}, {args.n}], "
          f"block {args.block}, "
          f"{args.threads} thread(s), {args.runs} run(s) of {args.calls} calls")
    print(f"{'row':42s} {'us (median)':>12s} {'x float32 min / median / max':>30s}")
    for name in rows:
        r = sorted(ratios[name])
        print(f"{name:42s} {statistics.median(micros[name]):12.1f} "
              f"{r[0]:10.2f} / {statistics.median(r):.2f} / {r[-1]:.2f}")
    print(json.dumps({"onnxruntime": ort.__version__, "k": args.k, "n": args.n, "m": args.m,
                      "ratios": {n: [min(v), statistics.median(v), max(v)] for n, v in ratios.items()}}))


if __name__ == "__main__":
    main()
