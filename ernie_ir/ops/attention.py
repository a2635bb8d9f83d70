"""attention: scaled dot-product attention, causal and grouped-query."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, OpError, TensorType, register_op
from ernie_ir.ir.types import broadcast_shapes

from ._checks import need, need_float, need_rank, same_dim


class AttentionAttrs(OpAttrs):
    causal: bool = True
    """Query i (of S) sees keys j <= i + (T - S): the last query sees every key."""
    scale: float | None = None
    """Multiplier of q.k; None means 1/sqrt(D)."""


@register_op
class Attention(OpDef):
    """out = softmax(scale * q k^T + mask) v, per head, heads grouped over kv heads.

    q: float [B, S, H, D]; k: [B, T, KV, D]; v: [B, T, KV, Dv], with H a
    multiple of KV (query head h reads kv head h // (H / KV)); mask:
    optional, broadcastable to [B, H, S, T], additive if float, keep-where-true
    if bool. out: q.dtype [B, S, H, Dv]. Computed in float32 with a max-shifted
    softmax; a fully masked row gives zeros.
    """

    name = "attention"
    inputs = (Input("q"), Input("k"), Input("v"), Input("mask", optional=True))
    Attrs = AttentionAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: AttentionAttrs) -> list[TensorType]:
        q, k, v = (need(t, self.name, n) for t, n in zip(types[:3], "qkv", strict=False))
        for t, n in ((q, "q"), (k, "k"), (v, "v")):
            need_float(t, self.name, n)
            need_rank(t, 4, self.name, n)
        same_dim(q.shape[0], k.shape[0], self.name, "batch of q and k")
        same_dim(k.shape[:3], v.shape[:3], self.name, "[B, T, KV] of k and v")
        same_dim(q.shape[3], k.shape[3], self.name, "head dims of q and k")
        h, kv = q.shape[2], k.shape[2]
        if isinstance(h, int) and isinstance(kv, int) and (kv == 0 or h % kv):
            raise OpError(f"attention: {h} query heads are not a multiple of {kv} kv heads")
        mask = types[3] if len(types) > 3 else None
        if mask is not None:
            if not (mask.dtype.is_float or mask.dtype == DType.BOOL):
                raise OpError(f"attention: mask must be float (additive) or bool (keep), got {mask}")
            full = (q.shape[0], h, q.shape[1], k.shape[1])
            try:
                fits = mask.rank <= 4 and broadcast_shapes(mask.shape, full) == full
            except ValueError:
                fits = False
            if not fits:
                raise OpError(f"attention: mask must broadcast to [B, H, S, T] = {list(full)}, got {mask}")
        return [TensorType(q.dtype, (*q.shape[:3], v.shape[3]))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: AttentionAttrs) -> list[np.ndarray]:
        q, k, v = args[0], args[1], args[2]
        assert q is not None and k is not None and v is not None
        mask = args[3] if len(args) > 3 else None
        b, s, h, d = q.shape
        t, kv = k.shape[1], k.shape[2]
        group = h // kv
        scale = np.float32(attrs.scale if attrs.scale is not None else 1.0 / np.sqrt(d))
        # [B, KV, group, S, D] x [B, KV, 1, D, T] -> scores [B, KV, group, S, T]
        qh = q.transpose(0, 2, 1, 3).reshape(b, kv, group, s, d)
        kh = k.transpose(0, 2, 3, 1)[:, :, None]
        scores = np.matmul(qh, kh) * scale
        scores = scores.reshape(b, h, s, t)
        keep = np.ones((1, 1, s, t), bool)
        if attrs.causal:
            keep = (np.arange(t)[None, :] <= np.arange(s)[:, None] + (t - s))[None, None]
        if mask is not None:
            if mask.dtype == np.bool_:
                keep = keep & mask
            else:
                scores = scores + mask
        scores = np.where(keep, scores, -np.inf)
        peak = np.max(scores, axis=-1, keepdims=True)
        peak = np.where(np.isfinite(peak), peak, 0)
        e = np.exp(scores - peak)
        denom = np.sum(e, axis=-1, keepdims=True)
        probs = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)
        vh = v.transpose(0, 2, 1, 3)[:, :, None]  # [B, KV, 1, T, Dv]
        out = np.matmul(probs.reshape(b, kv, group, s, t), vh)  # [B, KV, group, S, Dv]
        out = out.reshape(b, h, s, -1).transpose(0, 2, 1, 3)
        return [np.ascontiguousarray(out, dtype=np.float32)]
