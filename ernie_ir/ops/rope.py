"""rope: rotary position embedding, interleaved-pair or half-split."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from ernie_ir.ir import Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, need_float, need_int, need_rank, same_dim


class RopeAttrs(OpAttrs):
    theta: float = Field(gt=0)
    """Base of the frequencies (`rope_theta`)."""
    style: Literal["interleaved", "half"] = "interleaved"
    """interleaved: rotate pairs (x[2i], x[2i+1]) (GPT-J, ERNIE 4.5 Paddle);
    half: rotate pairs (x[i], x[i + D/2]) (GPT-NeoX / Llama)."""


def rope_angles(positions: np.ndarray, dim: int, theta: float) -> np.ndarray:
    """angle[..., i] = position * theta^(-2i/dim) for i < dim/2, in float32."""
    inv_freq = (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    return positions.astype(np.float32)[..., None] * inv_freq.astype(np.float32)


@register_op
class Rope(OpDef):
    """Rotate channel pairs of each head by position-dependent angles.

    x: float [B, S, N, D] (D even); position_ids: optional int [B, S] or [1, S]
    (default 0..S-1 for every batch row). With a_i = pos * theta^(-2i/D):
      interleaved: y[2i]   = x[2i] cos a_i - x[2i+1] sin a_i
                   y[2i+1] = x[2i+1] cos a_i + x[2i] sin a_i
      half:        y[i]       = x[i] cos a_i - x[i+D/2] sin a_i
                   y[i+D/2]   = x[i+D/2] cos a_i + x[i] sin a_i
    Angles, cos and sin are computed in float32.
    """

    name = "rope"
    inputs = (Input("x"), Input("position_ids", optional=True))
    Attrs = RopeAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: RopeAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        need_float(x, self.name, "x")
        need_rank(x, 4, self.name, "x")
        d = x.shape[3]
        if isinstance(d, int) and d % 2:
            raise OpError(f"rope: head dim must be even, got {d}")
        pos = types[1] if len(types) > 1 else None
        if pos is not None:
            need_int(pos, self.name, "position_ids")
            need_rank(pos, 2, self.name, "position_ids")
            same_dim(pos.shape[1], x.shape[1], self.name, "position_ids and x sequence lengths")
            if pos.shape[0] != 1:
                same_dim(pos.shape[0], x.shape[0], self.name, "position_ids and x batch sizes")
        return [x]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: RopeAttrs) -> list[np.ndarray]:
        x = args[0]
        assert x is not None
        b, s, _, d = x.shape
        pos = args[1] if len(args) > 1 and args[1] is not None else np.arange(s)[None, :]
        ang = rope_angles(np.broadcast_to(pos, (b, s)), d, attrs.theta)[:, :, None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        if attrs.style == "interleaved":
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        out = np.empty_like(x)
        if attrs.style == "interleaved":
            out[..., 0::2], out[..., 1::2] = r1, r2
        else:
            out[..., : d // 2], out[..., d // 2 :] = r1, r2
        return [out]
