"""C8, the int8 KV cache: quantize keys/values on write, dequantize them on read, per channel.

FastDeploy's `kv_cache_quant_type: int8` (REFERENCE 14): the checkpoint holds each channel's
abs-max a ([kv_heads * head_dim], here [KV, D]); the loader keeps, in the scale dtype T (the
model's default dtype, bf16 for ERNIE), the write scale s = T(127 / T(a)) and the read scale
o = T(T(a) / 127); the cache holds

    u8 = clip(round_half_even(s * x), -127, 127) + 128          (write)
    x' = (f32(u8) - 128) * o                                     (read)

computed here in float32 (FastDeploy's kernels multiply in float32 or in T: the same values
up to that rounding). `kv-cache` turns the pair these ops form in a full-sequence graph into
a decoder whose past/present tensors are u8 (the cache itself), reading through the dequantize.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import field_validator

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, need_float, need_min_rank, need_rank, same_dim

C8_BOUND = 127
C8_OFFSET = 128


def _scale_dtype(v: DType) -> DType:
    if not v.is_float:
        raise ValueError(f"must be a float type, not {v}")
    return v


def c8_scales(absmax: np.ndarray, scale_dtype: DType = DType.F32) -> tuple[np.ndarray, np.ndarray]:
    """(write scale, read scale) float32 arrays of a per-channel abs-max, as FastDeploy's loader
    keeps them in `scale_dtype`: s = T(127 / T(a)), o = T(T(a) / 127) (each division in float32,
    rounded to T to nearest even)."""
    t = scale_dtype.numpy

    def rt(v: np.ndarray) -> np.ndarray:
        return np.asarray(v, np.float32).astype(t).astype(np.float32)

    a = rt(np.asarray(absmax, np.float32))
    with np.errstate(divide="ignore"):
        return rt(np.float32(C8_BOUND) / a), rt(a / np.float32(C8_BOUND))


def c8_quantize(x: np.ndarray, write_scale: np.ndarray) -> np.ndarray:
    """u8 clip(rint(f32(write_scale) * x), -127, 127) + 128 (rint: half to even)."""
    v = np.rint(np.asarray(write_scale, np.float32) * np.asarray(x, np.float32))
    return (np.clip(v, -C8_BOUND, C8_BOUND) + np.float32(C8_OFFSET)).astype(np.uint8)


def c8_dequantize(q: np.ndarray, read_scale: np.ndarray) -> np.ndarray:
    """(f32(q) - 128) * f32(read_scale), float32."""
    return (np.asarray(q).astype(np.float32) - np.float32(C8_OFFSET)) * np.asarray(read_scale, np.float32)


def _check(op: str, x: TensorType, absmax: TensorType) -> None:
    need_min_rank(x, 2, op, "x")
    need_float(absmax, op, "absmax")
    need_rank(absmax, 2, op, "absmax")
    same_dim(tuple(absmax.shape), tuple(x.shape[-2:]), op, "absmax shape and x's last two dims [KV, D]")


class KvCacheQuantizeAttrs(OpAttrs):
    scale_dtype: DType = DType.F32
    """The dtype the write scale 127 / absmax is kept in (FastDeploy: the model's, bf16)."""

    @field_validator("scale_dtype")
    @classmethod
    def _float(cls, v: DType) -> DType:
        return _scale_dtype(v)


@register_op
class KvCacheQuantize(OpDef):
    """q = u8(clip(rint(s * x), -127, 127) + 128),  s = T(127 / T(absmax)) per channel

    x: float [..., KV, D] (a step's keys or values); absmax: float [KV, D], each channel's
    calibrated abs-max (FastDeploy's `cachek_matmul.activation_scale`); T = scale_dtype,
    rint rounds half to even. q: u8, x's shape (the C8 cache's element)."""

    name = "kv_cache_quantize"
    inputs = (Input("x"), Input("absmax"))
    Attrs = KvCacheQuantizeAttrs
    no_onnx = ("the C8 cache is not emitted to ONNX here (onnxruntime-genai keeps float caches); for an "
               "ONNX model compile with --quant 'w4a8c8{kv_cache=float}' (W4A8 experts, float cache)")

    def infer(self, types: Sequence[TensorType | None], attrs: KvCacheQuantizeAttrs) -> list[TensorType]:
        x, a = need(types[0], self.name, "x"), need(types[1], self.name, "absmax")
        need_float(x, self.name, "x")
        _check(self.name, x, a)
        return [x.with_dtype(DType.U8)]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: KvCacheQuantizeAttrs) -> list[np.ndarray]:
        x, a = args
        assert x is not None and a is not None
        return [c8_quantize(x, c8_scales(a, attrs.scale_dtype)[0])]

    def lower_paddle(self, layer: Any, node: Any, args: list[Any]) -> list[Any]:
        """rint via the float32 magic number 1.5 * 2^23 (exact half-to-even for |v| < 2^22)."""
        P = layer.P
        x, a = args
        s, _ = _paddle_scales(P, a, node.attrs.scale_dtype)
        v = P.clip(s * x.astype("float32"), -float(C8_BOUND), float(C8_BOUND))
        magic = P.full([], 12582912.0, dtype="float32")
        v = (v + magic) - magic
        return [(v + float(C8_OFFSET)).astype("uint8")]


class KvCacheDequantizeAttrs(OpAttrs):
    dtype: DType = DType.BF16
    """The float type of the result (the attention's)."""
    scale_dtype: DType = DType.F32
    """The dtype the read scale absmax / 127 is kept in (FastDeploy: the model's, bf16)."""

    @field_validator("dtype", "scale_dtype")
    @classmethod
    def _float(cls, v: DType) -> DType:
        return _scale_dtype(v)


@register_op
class KvCacheDequantize(OpDef):
    """x = dtype((f32(q) - 128) * o),  o = T(T(absmax) / 127) per channel

    q: u8 [..., KV, D] (C8 cache entries); absmax: float [KV, D] as kv_cache_quantize's;
    T = scale_dtype. x: dtype [..., KV, D]."""

    name = "kv_cache_dequantize"
    inputs = (Input("q"), Input("absmax"))
    Attrs = KvCacheDequantizeAttrs
    no_onnx = KvCacheQuantize.no_onnx

    def infer(self, types: Sequence[TensorType | None], attrs: KvCacheDequantizeAttrs) -> list[TensorType]:
        q, a = need(types[0], self.name, "q"), need(types[1], self.name, "absmax")
        if q.dtype != DType.U8:
            raise OpError(f"{self.name}: input q must be u8 (C8 cache entries), got {q}")
        _check(self.name, q, a)
        return [q.with_dtype(attrs.dtype)]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: KvCacheDequantizeAttrs) -> list[np.ndarray]:
        q, a = args
        assert q is not None and a is not None
        x = c8_dequantize(q, c8_scales(a, attrs.scale_dtype)[1])
        return [x if attrs.dtype == DType.F32 else x.astype(attrs.dtype.numpy)]

    def lower_paddle(self, layer: Any, node: Any, args: list[Any]) -> list[Any]:
        P = layer.P
        q, a = args
        _, o = _paddle_scales(P, a, node.attrs.scale_dtype)
        x = (q.astype("float32") - float(C8_OFFSET)) * o
        if node.attrs.dtype == DType.F32:
            return [x]
        return [x.astype(_paddle_float(node.attrs.dtype)).astype("float32")]  # Paddle Layers hold f32


def _paddle_float(dtype: DType) -> str:
    return {DType.F32: "float32", DType.BF16: "bfloat16", DType.F16: "float16"}.get(dtype, "float32")


def _paddle_scales(P: Any, absmax: Any, scale_dtype: DType) -> tuple[Any, Any]:
    """c8_scales in Paddle (float32 results)."""
    t = _paddle_float(scale_dtype)

    def rt(v: Any) -> Any:
        return v.astype(t).astype("float32")

    a = rt(absmax.astype("float32"))
    return rt(float(C8_BOUND) / a), rt(a / float(C8_BOUND))
