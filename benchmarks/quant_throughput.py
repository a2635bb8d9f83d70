"""Weight-only quantization throughput: ours vs Paddle's CPU kernel vs a plain copy, in one run.

    python benchmarks/quant_throughput.py [--shape 8192,7168] [--repeat 3] [--threads 2] [--no-paddle]

For a seeded bf16 weight of the given shape ([in, out], default Ernie 4.5
300B's expert up_gate_proj [8192, 7168]) it times, best of `--repeat`:

- `np.copyto` of the same bytes into a preallocated array (the bandwidth floor);
- INT8 and INT4 per-channel quantization with `ernie_ir.ops.quant_numerics.weight_quantize`
  (cache-sized row blocks, absmax on the raw bf16 bits, in-place float32 ops, `--threads`);
- the straightforward whole-array version (`weight_quantize_reference`), once, to check
  that the fast one is bit-identical;
- `paddle.nn.quant.weight_quantize(w, algo, arch=70)` on CPU, timed inside a Python of the
  `pf` reference environment ($ERNIE_IR_REFENVS/pf, default ~/.cache/ernie-ir/refenvs/pf)
  when paddle is not importable here; its int values (arch-70 layout undone) and scales are
  compared with ours.

Throughput is input bytes per second (the weight's bf16 bytes / time). The
goal: faster than Paddle's CPU kernel and within 4x of the copy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from ernie_ir.ops.quant_numerics import weight_quantize, weight_quantize_reference

PADDLE_SNIPPET = r"""
import json, sys, time
import numpy as np
import paddle
paddle.set_device("cpu")
bits = np.load(sys.argv[1])
w = paddle.to_tensor((bits.astype(np.uint32) << 16).view(np.float32)).astype("bfloat16")
out = {"paddle": paddle.__version__}
for algo in ("weight_only_int8", "weight_only_int4"):
    best = float("inf")
    for _ in range(int(sys.argv[3])):
        t = time.perf_counter()
        q, s = paddle.nn.quant.weight_quantize(w, algo=algo, arch=70, group_size=-1)
        best = min(best, time.perf_counter() - t)
    np.save(f"{sys.argv[2]}/{algo}_q.npy", q.numpy())
    np.save(f"{sys.argv[2]}/{algo}_scale.npy", s.astype("float32").numpy())
    out[algo] = best
print(json.dumps(out))
"""


def best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def undo_sm70(raw: np.ndarray, bits: int, k: int, n: int) -> np.ndarray:
    """Paddle's arch-70 bytes -> int values [k, n] (see tests/quant/_quant_testkit.py)."""
    b = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if bits == 8:
        return (b.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(k, n).astype(np.int16) - 128).astype(np.int8)
    words = b.view(np.uint32)
    nib = np.zeros((words.size, 8), np.uint8)
    for d in range(8):
        nib[:, 2 * d if d < 4 else 2 * (d - 4) + 1] = (words >> np.uint32(4 * d)) & np.uint32(0xF)
    return (nib.reshape(k, n).astype(np.int16) - 8).astype(np.int8)


def paddle_python() -> str | None:
    try:
        import paddle  # noqa: F401

        return sys.executable
    except ImportError:
        root = Path(os.environ.get("ERNIE_IR_REFENVS", Path.home() / ".cache" / "ernie-ir" / "refenvs"))
        py = root / "pf" / "bin" / "python"
        return str(py) if py.is_file() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192,7168")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--no-paddle", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    k, n = (int(x) for x in args.shape.split(","))
    w = (0.02 * np.random.default_rng(0).standard_normal((k, n), dtype=np.float32)).astype(ml_dtypes.bfloat16)
    nbytes = w.nbytes
    results: dict[str, object] = {"shape": [k, n], "bytes": nbytes, "threads": args.threads,
                                  "cpus": os.cpu_count()}
    dst = np.empty_like(w)
    np.copyto(dst, w)
    times: dict[str, float] = {"copyto": best_of(lambda: np.copyto(dst, w), args.repeat)}
    ours: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    qbuf = np.zeros((k, n), np.int8)  # preallocated, like the copy's destination
    for bits in (8, 4):
        def run(b: int = bits) -> None:
            q, s = weight_quantize(w, b, -1, threads=args.threads, out=qbuf)
            ours[b] = (q, s)
        times[f"ours_int{bits}"] = best_of(run, args.repeat)
        ours[bits] = (ours[bits][0].copy(), ours[bits][1])
        t = time.perf_counter()
        ref_q, ref_s = weight_quantize_reference(w, bits)
        times[f"reference_int{bits}"] = time.perf_counter() - t
        q, s = ours[bits]
        same_scale = np.array_equal(s.view(np.uint16), ref_s.view(np.uint16))
        results[f"bit_identical_int{bits}"] = bool(np.array_equal(q, ref_q) and same_scale)
    py = None if args.no_paddle else paddle_python()
    if py is not None:
        with tempfile.TemporaryDirectory() as tmp:
            np.save(Path(tmp) / "w.npy", w.view(np.uint16))
            proc = subprocess.run([py, "-c", PADDLE_SNIPPET, str(Path(tmp) / "w.npy"), tmp, str(args.repeat)],
                                  capture_output=True, text=True, env={**os.environ, "GLOG_minloglevel": "2"})
            if proc.returncode != 0:
                results["paddle_error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1][:300]
            else:
                info = json.loads(proc.stdout.strip().splitlines()[-1])
                results["paddle_version"] = info["paddle"]
                for bits, algo in ((8, "weight_only_int8"), (4, "weight_only_int4")):
                    times[f"paddle_int{bits}"] = info[algo]
                    pq = undo_sm70(np.load(Path(tmp) / f"{algo}_q.npy"), bits, k, n)
                    ps = np.load(Path(tmp) / f"{algo}_scale.npy")
                    q, s = ours[bits]
                    live = np.broadcast_to(s.astype(np.float32) != 0, q.shape)
                    results[f"equals_paddle_int{bits}"] = bool(
                        np.array_equal(q[live], pq[live]) and np.array_equal(s.astype(np.float32), ps))
    else:
        results["paddle_error"] = "paddle not available (no pf reference environment)"
    results["seconds"] = times
    results["gb_per_s"] = {name: nbytes / t / 1e9 for name, t in times.items()}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    gbs = results["gb_per_s"]
    assert isinstance(gbs, dict)
    print(f"weight bf16 [{k}, {n}] = {nbytes / 1e6:.0f} MB, {args.threads} thread(s), {os.cpu_count()} cpus")
    print(f"{'':24s}{'seconds':>10s}{'GB/s':>9s}{'vs copy':>9s}{'vs paddle':>11s}")
    for name, t in times.items():
        bits = name[-1]
        vs_paddle = ""
        if name.startswith("ours") and f"paddle_int{bits}" in times:
            vs_paddle = f"{times[f'paddle_int{bits}'] / t:8.1f}x"
        print(f"{name:24s}{t:10.4f}{gbs[name]:9.2f}{t / times['copyto']:8.1f}x{vs_paddle:>11s}")
    for bits in (8, 4):
        same = results[f"bit_identical_int{bits}"]
        line = f"int{bits}: bit-identical to the straightforward version: {same}"
        if f"equals_paddle_int{bits}" in results:
            line += f"; same values and scales as Paddle {results['paddle_version']}: " \
                    f"{results[f'equals_paddle_int{bits}']}"
        print(line)
    if "paddle_error" in results:
        print(f"paddle: {results['paddle_error']}")


if __name__ == "__main__":
    main()
