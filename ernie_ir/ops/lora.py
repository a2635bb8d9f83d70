"""lora: a low-rank adapter added to the output of any linear-like layer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field

from ernie_ir.ir import Input, OpAttrs, OpDef, TensorType, register_op

from ._checks import need, need_float, need_rank, same_dim


class LoraAttrs(OpAttrs):
    scale: float
    """alpha / r (or alpha / sqrt(r) for rsLoRA)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training; the reference kernel is inference (none)."""


@register_op
class Lora(OpDef):
    """y = base + ((dropout(x) @ lora_A) @ lora_B) * scale      (paddleformers LoRALinear)

    base: float [..., N], the frozen layer's output (linear, weight_only_linear,
    fp8_linear, ...); x: float [..., K], that layer's input; lora_A [K, r];
    lora_B [r, N]. y: base.dtype, computed in float32 in the order written.
    With lora_B = 0 (its initial value) y equals base exactly. Keeping the
    base layer as its own node lets the adapter sit on any base (WINT8MIX
    LoRA: a weight_only_linear base) and lets merge fold it back.
    """

    name = "lora"
    inputs = (Input("base"), Input("x"), Input("lora_A"), Input("lora_B"))
    Attrs = LoraAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: LoraAttrs) -> list[TensorType]:
        base, x, a, b = (need(t, self.name, n) for t, n in
                         zip(types, ("base", "x", "lora_A", "lora_B"), strict=False))
        for t, n in ((base, "base"), (x, "x"), (a, "lora_A"), (b, "lora_B")):
            need_float(t, self.name, n)
        need_rank(a, 2, self.name, "lora_A")
        need_rank(b, 2, self.name, "lora_B")
        same_dim(x.shape[-1], a.shape[0], self.name, "x's last dim and lora_A's rows")
        same_dim(a.shape[1], b.shape[0], self.name, "lora_A's rank and lora_B's rows")
        same_dim(base.shape[-1], b.shape[1], self.name, "base's last dim and lora_B's columns")
        same_dim(tuple(base.shape[:-1]), tuple(x.shape[:-1]), self.name, "leading dims of base and x")
        return [base]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: LoraAttrs) -> list[np.ndarray]:
        base, x, a, b = args
        assert base is not None and x is not None and a is not None and b is not None
        delta = np.matmul(np.matmul(x, a), b) * np.float32(attrs.scale)
        return [base + delta]
