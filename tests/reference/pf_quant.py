"""Reference: Paddle's weight-only quantisation and fake-quant ops, run eagerly on CPU.

Runs in the ``pf`` environment (only paddle is used). Never imports ernie_ir.

Usage::

    python pf_quant.py SPEC OUT_DIR

SPEC (defaults in brackets): seed [0], shape [[256, 128]] (weight [in, out]),
algos [["weight_only_int8", "weight_only_int4"]], archs [[70, 75, 80, 86, 89, 90]],
group_sizes [[-1, 64, 128]], fake_shape [[16, 32]], bits [[8, 4]],
round_types [[0, 1]], quant_axes [[0, 1]], moving_rate [0.9], moving_steps [3],
position_maps [true].

Calls (paddle 3.3.1, eager):
- ``paddle.nn.quant.weight_quantize(x, algo, arch, group_size) -> (out, scale)``
  (``_C_ops.weight_quantize(x, algo, arch, group_size)``), x bfloat16 [in, out];
- ``_C_ops.fake_quantize_dequantize_abs_max(x, bit_length, round_type) -> (out, scale)``;
- ``_C_ops.fake_channel_wise_quantize_dequantize_abs_max(x, bit_length, round_type, quant_axis)
  -> (out, scale)``;
- ``_C_ops.fake_quantize_dequantize_moving_average_abs_max(x, in_scale, in_accum, in_state,
  moving_rate, bit_length, is_test, round_type) -> (out, out_scale, out_state, out_accum)``.

Writes .npy files into OUT_DIR (bfloat16 arrays as their uint16 bits, names
ending in ``_bf16``) and ``meta.json`` mapping each case to its files, shapes
and dtypes, plus the cases the CPU kernel refused (with the error's last line).
Weight cases: ``wq_input_bf16.npy``; ``wq_{algo}_sm{arch}_g{gs}_{q,scale_bf16}.npy``
(``gs`` is ``m1`` for -1) and, for weight_only_int8/int4,
``wq_{algo}_sm{arch}_posmap.npy`` (see ``position_map``: which logical
element each output byte/nibble holds). Fake-quant cases: ``fq_input_b{bits}.npy`` (see ``tie_grid``);
``fq_absmax_b{bits}_r{rt}_{out,scale}.npy``;
``fq_channel_b{bits}_r{rt}_a{axis}_{out,scale}.npy``;
``fq_mavg_b{bits}_r{rt}_s{step}_{x,in_scale,in_accum,in_state,out,scale,state,accum}.npy``
(training mode, each step feeding the previous step's state back, inputs
drawn with growing spread) and ``fq_mavg_b{bits}_r{rt}_test_{x,in_scale,out}.npy``
(``is_test=True``: uses ``in_scale`` only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _refcommon as rc
import numpy as np

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "shape": [256, 128],
    "algos": ["weight_only_int8", "weight_only_int4"],
    "archs": [70, 75, 80, 86, 89, 90],
    "group_sizes": [-1, 64, 128],
    "fake_shape": [16, 32],
    "bits": [8, 4],
    "round_types": [0, 1],
    "quant_axes": [0, 1],
    "moving_rate": 0.9,
    "moving_steps": 3,
    "position_maps": True,
}


class Saver:
    """Saves arrays under OUT_DIR and remembers name -> [shape, dtype] for meta.json."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.files: dict[str, list[Any]] = {}

    def __call__(self, name: str, arr: np.ndarray) -> str:
        np.save(self.out / f"{name}.npy", arr)
        self.files[name] = [list(arr.shape), str(arr.dtype)]
        return name


def tie_grid(rng: np.random.Generator, shape: tuple[int, int], bnt: int) -> np.ndarray:
    """Float32 [rows, cols] test input whose every row and column has abs-max exactly ``bnt``.

    With scale == bnt, x / scale * bnt == x exactly, so the half-integer entries
    (about half of them) are exact rounding ties: they tell round_type 0 (half to
    even) from 1 (half away from zero). The other rows are N(0, (bnt/3)^2).
    """
    rows, cols = shape
    x = (bnt / 3 * rng.standard_normal(shape)).astype(np.float32)
    x[: rows // 2] = rng.integers(-2 * bnt + 1, 2 * bnt, size=(rows // 2, cols)) / 2
    x = np.clip(x, -bnt + 0.5, bnt - 0.5).astype(np.float32)
    for i in range(max(rows, cols)):
        x[i % rows, i % cols] = bnt if i % 2 == 0 else -bnt
    return x


def position_map(
    quantize: Any, to_bf16: Any, algo: str, arch: int, shape: tuple[int, int], rng: np.random.Generator
) -> np.ndarray:
    """Where ``weight_quantize`` puts each logical value, found with probes (per-channel only).

    Probes are integer weights in [-qmax, qmax] with every column's abs-max equal
    to qmax, so scale == 1 and the logical quantised weight is ``w.T`` exactly.
    Returns int64 ``m`` with one entry per output byte (int8) or per output
    nibble (int4, ``[out/2, in, 2]``, low nibble first) such that
    ``byte == logical.ravel()[m] + 128`` (int8) or ``nibble == logical.ravel()[m] + 8`` (int4),
    where ``logical`` is the [out, in] int array.
    """
    k, n = shape
    int4 = algo == "weight_only_int4"
    qmax, base, bias = (7, 16, 8) if int4 else (127, 256, 128)
    probes = 12 if int4 else 6  # base**probes == 2**48 keys
    key_l = np.zeros(n * k, np.int64)
    key_o = np.zeros(n * k, np.int64)
    out_shape: tuple[int, ...] = ()
    for _ in range(probes):
        v = rng.integers(-qmax, qmax + 1, size=(k, n))
        v[rng.integers(0, k, size=n), np.arange(n)] = qmax
        q, s = quantize(to_bf16(v.astype(np.float32)), algo=algo, arch=arch, group_size=-1)
        if not np.all(s.astype("float32").numpy() == 1.0):
            raise RuntimeError("probe scale is not 1")
        b = q.numpy().view(np.uint8)
        o = np.stack([b & 0xF, b >> 4], axis=-1) if int4 else b
        out_shape = o.shape
        key_l = key_l * base + (v.T.ravel() + bias)
        key_o = key_o * base + o.ravel()
    order = np.argsort(key_l, kind="stable")
    if np.any(np.diff(key_l[order]) == 0):
        raise RuntimeError("probe keys collide; use another seed")
    idx = np.clip(np.searchsorted(key_l[order], key_o), 0, n * k - 1)
    if not np.array_equal(key_l[order][idx], key_o):
        raise RuntimeError(f"{algo} sm{arch}: output is not a permutation of logical + {bias}")
    return order[idx].reshape(out_shape)


def last_line(err: Exception) -> str:
    lines = [s.strip() for s in str(err).strip().splitlines() if s.strip()]
    return f"{type(err).__name__}: {lines[-1][:300] if lines else ''}"


def main() -> None:
    rc.quiet_env()
    spec, out = rc.parse_args()
    p = {**DEFAULTS, **{k: v for k, v in spec.items() if k in DEFAULTS}}
    timer = rc.Timer()

    import paddle
    from paddle import _C_ops

    paddle.set_device("cpu")
    timer.lap("import")
    save = Saver(out)
    rng = np.random.default_rng(p["seed"])
    refused: dict[str, str] = {}
    cases: dict[str, dict[str, Any]] = {}

    # weight-only quantisation of a bfloat16 [in, out] weight
    bits = rc.bf16_bits(rng.standard_normal(tuple(p["shape"])).astype(np.float32))
    save("wq_input_bf16", bits)
    w = paddle.to_tensor(rc.bits_to_f32(bits)).astype("bfloat16")
    prng = np.random.default_rng(p["seed"] + 99)

    def to_bf16(a: np.ndarray) -> Any:
        return paddle.to_tensor(rc.bits_to_f32(rc.bf16_bits(a))).astype("bfloat16")

    for algo in p["algos"]:
        for arch in p["archs"]:
            if algo == "llm.int8" and arch == 70:
                refused[f"{algo}/sm70"] = "skipped: corrupts the heap and hangs on paddle 3.3.1 CPU"
                continue
            if p["position_maps"] and algo in ("weight_only_int8", "weight_only_int4"):
                tag = f"wq_{algo}_sm{arch}_posmap"
                pmap = position_map(
                    paddle.nn.quant.weight_quantize, to_bf16, algo, arch, tuple(p["shape"]), prng
                )
                cases[tag] = {"algo": algo, "arch": arch, "map": save(tag, pmap)}
            for gs in p["group_sizes"]:
                tag = f"wq_{algo}_sm{arch}_g{'m1' if gs == -1 else gs}"
                try:
                    q, s = paddle.nn.quant.weight_quantize(w, algo=algo, arch=arch, group_size=gs)
                except Exception as err:  # the CPU kernel refuses some cases
                    refused[tag] = last_line(err)
                    continue
                scale = s.astype("float32").numpy()
                scale_name = f"{tag}_scale_bf16" if s.dtype == paddle.bfloat16 else f"{tag}_scale"
                scale_arr = rc.bf16_bits(scale) if s.dtype == paddle.bfloat16 else s.numpy()
                cases[tag] = {
                    "algo": algo,
                    "arch": arch,
                    "group_size": gs,
                    "q": save(f"{tag}_q", q.numpy()),
                    "scale": save(scale_name, scale_arr),
                    "scale_dtype": str(s.dtype),
                }
    timer.lap("weight_quantize")

    # fake quant-dequant (float32)
    for b in p["bits"]:
        fx = tie_grid(rng, tuple(p["fake_shape"]), 2 ** (b - 1) - 1)
        in_name = save(f"fq_input_b{b}", fx)
        x = paddle.to_tensor(fx)
        for rt in p["round_types"]:
            tag = f"fq_absmax_b{b}_r{rt}"
            o, s = _C_ops.fake_quantize_dequantize_abs_max(x, b, rt)
            cases[tag] = {
                "bits": b,
                "round_type": rt,
                "x": in_name,
                "out": save(f"{tag}_out", o.numpy()),
                "scale": save(f"{tag}_scale", s.numpy()),
            }
            for axis in p["quant_axes"]:
                tag = f"fq_channel_b{b}_r{rt}_a{axis}"
                try:
                    o, s = _C_ops.fake_channel_wise_quantize_dequantize_abs_max(x, b, rt, axis)
                except Exception as err:
                    refused[tag] = last_line(err)
                    continue
                cases[tag] = {
                    "bits": b,
                    "round_type": rt,
                    "quant_axis": axis,
                    "x": in_name,
                    "out": save(f"{tag}_out", o.numpy()),
                    "scale": save(f"{tag}_scale", s.numpy()),
                }
            # moving-average abs-max, training mode: feed the state back
            rate = float(p["moving_rate"])
            in_scale = np.array([0.0], np.float32)
            in_accum = np.array([0.0], np.float32)
            in_state = np.array([0.0], np.float32)
            mrng = np.random.default_rng(p["seed"] + 7)
            for step in range(int(p["moving_steps"])):
                tag = f"fq_mavg_b{b}_r{rt}_s{step}"
                xs = ((1.0 + step) * mrng.standard_normal(tuple(p["fake_shape"]))).astype(np.float32)
                o, s, st, acc = _C_ops.fake_quantize_dequantize_moving_average_abs_max(
                    paddle.to_tensor(xs),
                    paddle.to_tensor(in_scale),
                    paddle.to_tensor(in_accum),
                    paddle.to_tensor(in_state),
                    rate,
                    b,
                    False,
                    rt,
                )
                arrays = {
                    "x": xs,
                    "in_scale": in_scale,
                    "in_accum": in_accum,
                    "in_state": in_state,
                    "out": o.numpy(),
                    "scale": s.numpy(),
                    "state": st.numpy(),
                    "accum": acc.numpy(),
                }
                cases[tag] = {"bits": b, "round_type": rt, "moving_rate": rate, "is_test": False}
                cases[tag].update({k: save(f"{tag}_{k}", v) for k, v in arrays.items()})
                in_scale, in_accum, in_state = s.numpy(), acc.numpy(), st.numpy()
            tag = f"fq_mavg_b{b}_r{rt}_test"
            t_scale = np.array([0.75 * float(np.abs(fx).max())], np.float32)
            o, _, _, _ = _C_ops.fake_quantize_dequantize_moving_average_abs_max(
                x,
                paddle.to_tensor(t_scale),
                None,
                None,
                rate,
                b,
                True,
                rt,
            )
            cases[tag] = {
                "bits": b,
                "round_type": rt,
                "is_test": True,
                "x": in_name,
                "in_scale": save(f"{tag}_in_scale", t_scale),
                "out": save(f"{tag}_out", o.numpy()),
            }
    timer.lap("fake_quant")

    for name, (_shape, dtype) in save.files.items():
        if dtype.startswith("float"):
            rc.check_finite(name, np.load(out / f"{name}.npy"))
    rc.write_meta(
        out,
        {
            "library": {"paddle": paddle.__version__},
            "params": p,
            "cases": cases,
            "files": save.files,
            "refused": refused,
            "timing_s": timer.laps,
        },
    )


if __name__ == "__main__":
    main()
