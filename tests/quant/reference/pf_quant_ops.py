"""Reference: Paddle's quantization kernels on inputs we choose, eager on CPU.

Runs in the ``pf`` environment (only paddle is used). Never imports ernie_ir.

Usage::

    python pf_quant_ops.py SPEC OUT_DIR

SPEC (JSON object or path): ``{"inputs": "in.npz", "cases": [...]}``. Arrays
named ``*_bf16`` in in.npz are bfloat16 values given as their uint16 bits.
Each case has ``op``, ``name`` (prefix of its outputs) and arguments:

- ``weight_quantize``: x (a ``_bf16`` array [in, out]), algo, arch, group_size
  -> ``{name}_q`` (int8, Paddle's layout) and ``{name}_scale`` (float32 of the bf16 scale);
- ``fake_abs_max``: x (float32), bits, round_type -> ``{name}_out``, ``{name}_scale``
  (``_C_ops.fake_quantize_dequantize_abs_max``);
- ``fake_channel``: x, bits, round_type, quant_axis -> out, scale
  (``_C_ops.fake_channel_wise_quantize_dequantize_abs_max``);
- ``fake_mavg``: xs (a list of input names, one per training step), bits, round_type,
  rate, init [scale, accum, state], is_test -> ``{name}_out{step}``, ``{name}_scale{step}``,
  ``{name}_state{step}``, ``{name}_accum{step}``
  (``_C_ops.fake_quantize_dequantize_moving_average_abs_max``, state fed back);
- ``pact``: x, alpha -> out (PaddleSlim's PACT: x - relu(x - a) + relu(-a - x)).

Writes ``OUT_DIR/out.npz`` and ``OUT_DIR/meta.json`` (paddle version, refused cases).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np


def main() -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    if len(sys.argv) != 3:
        raise SystemExit("usage: python pf_quant_ops.py SPEC OUT_DIR")
    text = sys.argv[1]
    spec = json.loads(text if text.lstrip().startswith("{") else Path(text).read_text())
    out_dir = Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)

    import paddle
    from paddle import _C_ops

    paddle.set_device("cpu")
    inputs = dict(np.load(spec["inputs"]))
    out: dict[str, np.ndarray] = {}
    refused: dict[str, str] = {}

    def tensor(name: str) -> paddle.Tensor:
        arr = inputs[name]
        if name.endswith("_bf16"):
            f = (arr.astype(np.uint32) << 16).view(np.float32)
            return paddle.to_tensor(f).astype("bfloat16")
        return paddle.to_tensor(arr.astype(np.float32))

    for case in spec["cases"]:
        op, name = case["op"], case["name"]
        try:
            if op == "weight_quantize":
                q, s = paddle.nn.quant.weight_quantize(tensor(case["x"]), algo=case["algo"],
                                                       arch=case["arch"], group_size=case["group_size"])
                out[f"{name}_q"] = q.numpy()
                out[f"{name}_scale"] = s.astype("float32").numpy()
                out[f"{name}_scale_is_bf16"] = np.array(s.dtype == paddle.bfloat16)
            elif op == "fake_abs_max":
                o, s = _C_ops.fake_quantize_dequantize_abs_max(tensor(case["x"]), case["bits"],
                                                               case["round_type"])
                out[f"{name}_out"], out[f"{name}_scale"] = o.numpy(), s.numpy()
            elif op == "fake_channel":
                o, s = _C_ops.fake_channel_wise_quantize_dequantize_abs_max(
                    tensor(case["x"]), case["bits"], case["round_type"], case["quant_axis"])
                out[f"{name}_out"], out[f"{name}_scale"] = o.numpy(), s.numpy()
            elif op == "fake_mavg":
                scale, accum, state = (np.array([v], np.float32) for v in case["init"])
                for step, xname in enumerate(case["xs"]):
                    o, s, st, acc = _C_ops.fake_quantize_dequantize_moving_average_abs_max(
                        tensor(xname), paddle.to_tensor(scale), paddle.to_tensor(accum),
                        paddle.to_tensor(state), float(case["rate"]), case["bits"], bool(case["is_test"]),
                        case["round_type"])
                    out[f"{name}_out{step}"] = o.numpy()
                    if not case["is_test"]:
                        scale, accum, state = s.numpy(), acc.numpy(), st.numpy()
                    out[f"{name}_scale{step}"] = scale
                    out[f"{name}_state{step}"] = state
                    out[f"{name}_accum{step}"] = accum
            elif op == "pact":
                x = tensor(case["x"])
                a = paddle.to_tensor(np.array([case["alpha"]], np.float32))
                relu = paddle.nn.functional.relu
                out[f"{name}_out"] = (x - relu(x - a) + relu(-a - x)).numpy()
            else:
                raise SystemExit(f"unknown op {op!r}")
        except Exception as err:  # the CPU kernel refuses some cases: record them
            lines = [s for s in str(err).strip().splitlines() if s.strip()]
            refused[name] = f"{type(err).__name__}: {lines[-1][:300] if lines else ''}"
    np.savez(out_dir / "out.npz", **out)
    meta = {"paddle": paddle.__version__, "refused": refused}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
