"""Mixture of experts: the router (moe_gate) and the grouped expert FFN (moe_experts)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from pydantic import Field

from ernie_ir.ir import Input, OpAttrs, OpDef, OpError, TensorType, f32, i64, register_op

from ._checks import need, need_float, need_int, need_min_rank, need_rank, same_dim


class MoeGateAttrs(OpAttrs):
    top_k: int = Field(ge=1)
    normalize: bool = True
    """Renormalise the chosen probabilities to sum to 1."""
    norm_min: float = Field(default=1e-12, gt=0)
    """Floor of the renormalising sum."""


@register_op
class MoeGate(OpDef):
    """Top-k softmax router with ERNIE 4.5's score-correction bias.

    x: float [..., H]; weight: [H, E]; bias: optional [E] or [1, E].
      p       = softmax(f32(x) @ f32(weight))            (over E, in float32)
      chosen  = top_k indices of (p + bias), best first (ties: lower index)
      w       = p[chosen]                                 (the unbiased probabilities)
      w       = w / max(sum(w), norm_min)                 (if normalize)
    Outputs: weights f32 [..., k], indices i64 [..., k]. The bias only
    chooses experts; it never scales them.
    """

    name = "moe_gate"
    num_outputs = 2  # (weights, indices)
    inputs = (Input("x"), Input("weight"), Input("bias", optional=True))
    Attrs = MoeGateAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: MoeGateAttrs) -> list[TensorType]:
        x, w = need(types[0], self.name, "x"), need(types[1], self.name, "weight")
        need_float(x, self.name, "x")
        need_min_rank(x, 1, self.name, "x")
        need_rank(w, 2, self.name, "weight")
        same_dim(x.shape[-1], w.shape[0], self.name, "x's last dim and router in-dim")
        experts = w.shape[1]
        bias = types[2] if len(types) > 2 else None
        if bias is not None:
            need_rank(bias, (1, 2), self.name, "bias")
            same_dim(bias.shape[-1], experts, self.name, "bias size and expert count")
            if bias.rank == 2:
                same_dim(bias.shape[0], 1, self.name, "bias leading dim")
        if isinstance(experts, int) and attrs.top_k > experts:
            raise OpError(f"moe_gate: top_k {attrs.top_k} exceeds the {experts} experts")
        lead = x.shape[:-1]
        return [TensorType(f32, (*lead, attrs.top_k)), TensorType(i64, (*lead, attrs.top_k))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: MoeGateAttrs) -> list[np.ndarray]:
        x, w = args[0], args[1]
        assert x is not None and w is not None
        bias = args[2] if len(args) > 2 else None
        logits = np.matmul(x.astype(np.float32), w.astype(np.float32))
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = e / e.sum(axis=-1, keepdims=True)
        scores = probs if bias is None else probs + bias.reshape(-1).astype(np.float32)
        # A stable sort of -scores puts the best first and breaks ties by lower index.
        idx = np.argsort(-scores, axis=-1, kind="stable")[..., : attrs.top_k]
        weights = np.take_along_axis(probs, idx, axis=-1)
        if attrs.normalize:
            total = np.maximum(weights.sum(axis=-1, keepdims=True), np.float32(attrs.norm_min))
            weights = weights / total
        return [weights.astype(np.float32), idx.astype(np.int64)]



class LocalExpertsAttrs(OpAttrs):
    first: int = Field(ge=0)
    """Global index of the first expert this rank holds."""
    count: int = Field(ge=1)
    """How many consecutive experts it holds."""


@register_op
class MoeLocalExperts(OpDef):
    """Route to the experts one rank holds (expert parallelism, global indices kept).

    weights: f32 [..., k]; indices: int [..., k] (global expert ids).
      held        = first <= indices < first + count
      weights_out = where(held, weights, 0)
      indices_out = where(held, indices - first, 0)
    so that moe_experts over the rank's `count` stacked experts adds exactly
    its experts' share (a slot routed elsewhere is weighted 0); the sum of
    every rank's share (all_reduce) is the whole MoE output.
    """

    name = "moe_local_experts"
    num_outputs = 2  # (weights, indices)
    inputs = (Input("weights"), Input("indices"))
    Attrs = LocalExpertsAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: LocalExpertsAttrs) -> list[TensorType]:
        w, idx = need(types[0], self.name, "weights"), need(types[1], self.name, "indices")
        need_float(w, self.name, "weights")
        need_int(idx, self.name, "indices")
        same_dim(w.shape, idx.shape, self.name, "shapes of weights and indices")
        return [w, idx]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: LocalExpertsAttrs) -> list[np.ndarray]:
        w, idx = args
        assert w is not None and idx is not None
        local = idx - attrs.first
        held = (local >= 0) & (local < attrs.count)
        return [np.where(held, w, np.zeros_like(w)), np.where(held, local, np.zeros_like(local))]


@register_op
class MoeExperts(OpDef):
    """Grouped SwiGLU experts over stacked weights, combined by routing weights.

    x: float [..., H]; weights: f32 [..., k]; indices: int [..., k];
    up_gate: [E, H, 2I] with columns [gate | up]; down: [E, I, H].
      out[t] = sum_j weights[t, j] * FFN_{indices[t, j]}(x[t])
      FFN_e(v) = (silu(v @ up_gate[e][:, :I]) * (v @ up_gate[e][:, I:])) @ down[e]
    out: x.dtype [..., H]. Tokens are grouped by expert so each expert runs
    one matmul; accumulation is in float32.
    """

    name = "moe_experts"
    inputs = (
        Input("x"),
        Input("weights"),
        Input("indices"),
        Input("up_gate"),
        Input("down"),
    )

    def infer(self, types: Sequence[TensorType | None], attrs: OpAttrs) -> list[TensorType]:
        x, wts, idx, ug, dn = (
            need(t, self.name, n)
            for t, n in zip(types, ("x", "weights", "indices", "up_gate", "down"), strict=False)
        )
        need_float(x, self.name, "x")
        need_min_rank(x, 1, self.name, "x")
        need_float(wts, self.name, "weights")
        need_int(idx, self.name, "indices")
        need_rank(ug, 3, self.name, "up_gate")
        need_rank(dn, 3, self.name, "down")
        same_dim(wts.shape, idx.shape, self.name, "shapes of weights and indices")
        same_dim(wts.shape[:-1], x.shape[:-1], self.name, "token dims of weights and x")
        same_dim(ug.shape[0], dn.shape[0], self.name, "expert counts of up_gate and down")
        same_dim(ug.shape[1], x.shape[-1], self.name, "up_gate in-dim and x's last dim")
        same_dim(dn.shape[2], x.shape[-1], self.name, "down out-dim and x's last dim")
        inter = dn.shape[1]
        if isinstance(inter, int) and ug.shape[2] != 2 * inter:
            raise OpError(
                f"moe_experts: up_gate has {ug.shape[2]} columns, expected 2 x {inter} ([gate | up])"
            )
        return [x]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: OpAttrs) -> list[np.ndarray]:
        x, wts, idx, ug, dn = args
        assert x is not None and wts is not None and idx is not None
        assert ug is not None and dn is not None
        inter = dn.shape[1]

        def ffn(e: int, v: np.ndarray) -> np.ndarray:
            return np.matmul(swiglu(np.matmul(v, ug[e]), inter), dn[e])

        return [combine_experts(self.name, x, wts, idx, ug.shape[0], ffn)]


def swiglu(h: np.ndarray, inter: int) -> np.ndarray:
    """silu(h[:, :I]) * h[:, I:] for the fused [gate | up] projection."""
    gate, up = h[:, :inter], h[:, inter:]
    return gate / (np.float32(1) + np.exp(-gate)) * up


def combine_experts(op: str, x: np.ndarray, weights: np.ndarray, indices: np.ndarray,
                    num_experts: int, ffn: Callable[[int, np.ndarray], np.ndarray]) -> np.ndarray:
    """out[t] = sum_j weights[t, j] * ffn(indices[t, j], x[t]), with tokens grouped by expert
    so each expert's ffn runs once on all its rows; accumulated in float32."""
    hidden = x.shape[-1]
    tokens = x.reshape(-1, hidden)
    flat_idx = indices.reshape(tokens.shape[0], -1)
    flat_w = weights.reshape(tokens.shape[0], -1).astype(np.float32)
    if flat_idx.size and (flat_idx.min() < 0 or flat_idx.max() >= num_experts):
        raise OpError(f"{op}: expert index outside [0, {num_experts})")
    out = np.zeros_like(tokens, dtype=np.float32)
    for e in np.unique(flat_idx):
        rows, slots = np.nonzero(flat_idx == e)
        y = ffn(int(e), tokens[rows])
        np.add.at(out, rows, y * flat_w[rows, slots][:, None])
    return out.reshape(x.shape)
