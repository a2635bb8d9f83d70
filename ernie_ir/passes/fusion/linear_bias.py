"""Fuse a bias addition into the linear before it: linear(x, W) + b -> linear(x, W, b).

Checkpoints and other passes sometimes leave the bias as a separate `add`
(e.g. after a decomposition); folding it gives one node that targets map to
one kernel. Exact: the reference kernel computes x @ W + b in the same order.
"""

from __future__ import annotations

from typing import Any

from ernie_ir.ir import GraphBuilder, Value

from ..infra.registry import register_pass
from ..infra.rewrite import MatchContext, MatchResult, PatternBuilder, RewriteRule, Var, rewrite_pass


class FuseLinearBias(RewriteRule):
    """add(linear(x, W), b) -> linear(x, W, b) for a 1-D param b of length out_features."""

    name = "fuse-linear-bias"
    commute = True  # b + linear(x, W) is the same sum

    def pattern(self, op: PatternBuilder, x: Var, w: Var, b: Var) -> Any:
        return op.add(op.linear(x, w, _single_use=True), b.where(param=True, rank=1))

    def check(self, ctx: MatchContext, x: Value, w: Value, b: Value) -> MatchResult:
        if b.type.shape[0] != w.type.shape[1]:
            return ctx.fail(f"bias has {b.type.shape[0]} elements but the linear has "
                            f"{w.type.shape[1]} outputs", b)
        if b.type.dtype != x.type.dtype and not (b.type.dtype.is_float and x.type.dtype.is_float):
            return ctx.fail("bias dtype cannot be added to the activations", b)
        if ctx.root.outputs[0].type.dtype != x.type.dtype:
            return ctx.fail(f"the add promotes {x.type.dtype} to {ctx.root.outputs[0].type.dtype}; "
                            "a fused linear would not", b)
        return ctx.ok()

    def rewrite(self, op: GraphBuilder, x: Value, w: Value, b: Value) -> Value:
        return op.linear(x, w, b)


FuseLinearBiasPass = register_pass(rewrite_pass(
    "fuse-linear-bias", "Fold add(linear(x, W), b) into linear(x, W, b).", [FuseLinearBias()],
))
