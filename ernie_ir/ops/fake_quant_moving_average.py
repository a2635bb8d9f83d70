"""fake_quant_moving_average: activation fake quantization with a moving-average abs-max scale."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from ernie_ir.ir import Input, OpAttrs, OpDef, TensorType, register_op

from ._checks import need, need_float, same_dim
from .quant_numerics import abs_max, fake_quant_dequant, moving_average_state


class MovingAverageAttrs(OpAttrs):
    bits: int = Field(default=8, ge=2, le=16)
    round_type: Literal[0, 1] = 1
    moving_rate: float = Field(default=0.9, ge=0.0, le=1.0)
    is_test: bool = False
    """True: use the stored scale and leave the state alone (inference)."""


def _scalar(t: TensorType | None, op: str, name: str) -> TensorType:
    t = need(t, op, name)
    need_float(t, op, name)
    same_dim(tuple(t.shape), (1,), op, f"shape of {name} (a [1] tensor)")
    return t


@register_op
class FakeQuantMovingAverage(OpDef):
    """Paddle's `fake_quantize_dequantize_moving_average_abs_max` (float32, bit-exact on CPU).

    Inputs x (float), scale, accum, state (f32[1] each, the layer's state:
    Paddle initialises them to 0.001, 1, 1). Outputs y, out_scale,
    out_state, out_accum (Paddle's order).
      training (is_test = false):
        state' = rate * state + 1;  accum' = rate * accum + max|x|;  s = accum' / state'
        y = fake_quant_dequant(x, s)          (round_type as in `fake_quant`)
        out_scale, out_state, out_accum = s, state', accum'
      inference (is_test = true):  y = fake_quant_dequant(x, scale); state passes through.
    The out_* values are the params' next values: a training runtime writes
    them back into the params bound to scale, state and accum after each
    step. Gradient of y: straight-through.
    """

    name = "fake_quant_moving_average"
    inputs = (Input("x"), Input("scale"), Input("accum"), Input("state"))
    Attrs = MovingAverageAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: MovingAverageAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        need_float(x, self.name, "x")
        scale = _scalar(types[1], self.name, "scale")
        accum = _scalar(types[2], self.name, "accum")
        state = _scalar(types[3], self.name, "state")
        return [x, scale, state, accum]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: MovingAverageAttrs) -> list[np.ndarray]:
        x = np.asarray(args[0], dtype=np.float32)
        scale, accum, state = (np.asarray(a, dtype=np.float32).reshape(1) for a in args[1:4])
        if attrs.is_test:
            y = fake_quant_dequant(x, scale[0], attrs.bits, attrs.round_type)
            return [y, scale, state, accum]
        s, acc, st = moving_average_state(np.float32(abs_max(x)), accum[0], state[0], attrs.moving_rate)
        y = fake_quant_dequant(x, s, attrs.bits, attrs.round_type)
        return [y, np.array([s], np.float32), np.array([st], np.float32), np.array([acc], np.float32)]
