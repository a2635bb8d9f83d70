"""moe_experts_lora: the grouped expert FFN with a LoRA adapter on each expert's projections."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ernie_ir.ir import Input, OpError, TensorType, register_op

from ._checks import need, need_float, need_rank, same_dim
from .lora import LoraAttrs
from .moe import MoeExperts, combine_experts, swiglu


@register_op
class MoeExpertsLora(MoeExperts):
    """moe_experts where every expert's up_gate and/or down projection carries a LoRA adapter.

    Inputs as moe_experts (x, weights, indices, up_gate [E, H, 2I], down [E, I, H]),
    then up_gate_A [E, H, r], up_gate_B [E, r, 2I], down_A [E, I, r],
    down_B [E, r, H] (each pair optional, both or neither):
      h_e(v)   = v @ up_gate[e] + ((dropout(v) @ up_gate_A[e]) @ up_gate_B[e]) * scale
      a_e(v)   = silu(h_e(v)[:, :I]) * h_e(v)[:, I:]
      FFN_e(v) = a_e(v) @ down[e] + ((dropout(a_e(v)) @ down_A[e]) @ down_B[e]) * scale
      out[t]   = sum_j weights[t, j] * FFN_{indices[t, j]}(x[t])
    Each expert has its own adapter, as ERNIEKit's per-expert LoRALinear
    layers; with the B matrices zero the result equals moe_experts exactly.
    up_gate / down may be dequantize results (LoRA over a weight-only base).
    """

    name = "moe_experts_lora"
    inputs = (
        Input("x"), Input("weights"), Input("indices"), Input("up_gate"), Input("down"),
        Input("up_gate_A", optional=True), Input("up_gate_B", optional=True),
        Input("down_A", optional=True), Input("down_B", optional=True),
    )
    Attrs = LoraAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: LoraAttrs) -> list[TensorType]:
        out = super().infer(list(types[:5]), attrs)
        ug, dn = need(types[3], self.name, "up_gate"), need(types[4], self.name, "down")
        padded = list(types) + [None] * (9 - len(types))
        pairs = (("up_gate", ug, padded[5], padded[6]), ("down", dn, padded[7], padded[8]))
        if all(a is None and b is None for _, _, a, b in pairs):
            raise OpError("moe_experts_lora: no adapter (give up_gate_A/B, down_A/B or both)")
        for name, w, a, b in pairs:
            if (a is None) != (b is None):
                raise OpError(f"moe_experts_lora: {name}_A and {name}_B come together")
            if a is None or b is None:
                continue
            for t, n in ((a, f"{name}_A"), (b, f"{name}_B")):
                need_float(t, self.name, n)
                need_rank(t, 3, self.name, n)
                same_dim(t.shape[0], w.shape[0], self.name, f"expert counts of {n} and {name}")
            same_dim(a.shape[1], w.shape[1], self.name, f"{name}_A rows and {name} in-dim")
            same_dim(a.shape[2], b.shape[1], self.name, f"{name}_A rank and {name}_B rows")
            same_dim(b.shape[2], w.shape[2], self.name, f"{name}_B columns and {name} out-dim")
        return out

    def kernel(self, args: Sequence[np.ndarray | None], attrs: LoraAttrs) -> list[np.ndarray]:
        padded = list(args) + [None] * (9 - len(args))
        x, wts, idx, ug, dn, ug_a, ug_b, dn_a, dn_b = padded
        assert x is not None and wts is not None and idx is not None and ug is not None and dn is not None
        scale = np.float32(attrs.scale)
        inter = dn.shape[1]

        def ffn(e: int, v: np.ndarray) -> np.ndarray:
            h = np.matmul(v, ug[e])
            if ug_a is not None and ug_b is not None:
                h = h + np.matmul(np.matmul(v, ug_a[e]), ug_b[e]) * scale
            act = swiglu(h, inter)
            y = np.matmul(act, dn[e])
            if dn_a is not None and dn_b is not None:
                y = y + np.matmul(np.matmul(act, dn_a[e]), dn_b[e]) * scale
            return y

        return [combine_experts(self.name, x, wts, idx, ug.shape[0], ffn)]
