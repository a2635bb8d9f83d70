"""fake_quant: abs-max quantize-dequantize in float (QAT weights), tensor-wise or per channel."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from ernie_ir.ir import Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, need_float
from .quant_numerics import abs_max, fake_quant_dequant


class FakeQuantAttrs(OpAttrs):
    bits: int = Field(default=8, ge=2, le=16)
    round_type: Literal[0, 1] = 1
    """0: round half to even, then clip to [-b-1, b]; 1: clip to [-s, s], round half away from zero."""
    axes: tuple[int, ...] = ()
    """Channel axes that keep their own scale; () is tensor-wise (abs_max)."""


@register_op
class FakeQuant(OpDef):
    """y = fake_quant_dequant(x, s): Paddle's `fake_quantize_dequantize_abs_max` (axes = ()) and
    `fake_channel_wise_quantize_dequantize_abs_max` (one scale per index of `axes`).

      s      = max |x| over every axis not in `axes`           (float32)
      b      = 2^(bits-1) - 1;  inv(s) = 1/(s+1e-6) if s <= 1e-30 else 1/s
      rt 0:  y = (clip(rint((b * inv(s)) * x), -b - 1, b) * s) / b
      rt 1:  y = (round_half_away((b * inv(s)) * clip(x, -s, s)) * s) / b

    Bit-exact with Paddle 3.3.1's CPU kernels in float32. A Paddle Linear
    weight [in, out] quantized per output channel is axes = (1,) (Paddle's
    quant_axis 1); stacked expert weights [E, in, out] use axes = (0, 2).
    Gradient: straight-through (identity), as Paddle's.
    """

    name = "fake_quant"
    inputs = (Input("x"),)
    Attrs = FakeQuantAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: FakeQuantAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        need_float(x, self.name, "x")
        for a in attrs.axes:
            if not -x.rank <= a < x.rank:
                raise OpError(f"fake_quant: channel axis {a} out of range for {x}")
        if len({a % max(x.rank, 1) for a in attrs.axes}) != len(attrs.axes):
            raise OpError(f"fake_quant: repeated channel axis in {list(attrs.axes)}")
        return [x]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: FakeQuantAttrs) -> list[np.ndarray]:
        x = np.asarray(args[0], dtype=np.float32)
        keep = tuple(a % x.ndim for a in attrs.axes) if x.ndim else ()
        s = abs_max(x, keep)
        if keep:
            shape = [x.shape[i] if i in keep else 1 for i in range(x.ndim)]
            s = s.reshape(shape)
        return [fake_quant_dequant(x, s, attrs.bits, attrs.round_type)]
