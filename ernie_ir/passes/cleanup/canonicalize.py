"""Canonicalization: fold reshape and transpose chains, drop identity ops.

Rules (each exact, so the interpreter's results do not change by a bit):
- reshape(reshape(x, a), b) -> reshape(x, b o a)   (0 entries of b resolved through a)
- reshape(x, s) -> x                  when the result type equals x's type
- transpose(transpose(x, p), q) -> transpose(x, p[q])   (or x when that is the identity)
- transpose(x, identity) -> x
- cast(x, dtype) -> x                 when x already has that dtype
- split(x, [n]) -> x                  (a single piece)
"""

from __future__ import annotations

from typing import Any

from ernie_ir.ir import GraphBuilder, Value

from ..infra.registry import register_pass
from ..infra.rewrite import MatchContext, MatchResult, PatternBuilder, RewriteRule, Var, rewrite_pass


class FoldReshapeChain(RewriteRule):
    """reshape(reshape(x, a), b) -> reshape(x, b')"""

    name = "fold-reshape-chain"

    def pattern(self, op: PatternBuilder, x: Var) -> Any:
        inner = op.reshape(x, shape=op.attr("inner"), _single_use=True)
        return op.reshape(inner, shape=op.attr("outer"))

    def check(self, ctx: MatchContext, x: Value, inner: tuple[int, ...], outer: tuple[int, ...]
              ) -> MatchResult:
        for i, d in enumerate(outer):
            if d == 0 and (i >= len(inner) or inner[i] == -1):
                return ctx.fail(f"outer dim {i} copies a dim the inner reshape infers")
        return ctx.ok()

    def rewrite(self, op: GraphBuilder, x: Value, inner: tuple[int, ...], outer: tuple[int, ...]
                ) -> Value:
        shape = tuple(inner[i] if d == 0 else d for i, d in enumerate(outer))
        return op.reshape(x, shape=shape)


class IdentityReshape(RewriteRule):
    """reshape(x) -> x when nothing changes"""

    name = "identity-reshape"

    def pattern(self, op: PatternBuilder, x: Var) -> Any:
        return op.reshape(x)

    def check(self, ctx: MatchContext, x: Value) -> MatchResult:
        if ctx.root.outputs[0].type != x.type:
            return ctx.fail(f"reshape changes {x.type} into {ctx.root.outputs[0].type}")
        return ctx.ok()

    def rewrite(self, op: GraphBuilder, x: Value) -> Value:
        return x


class FoldTransposeChain(RewriteRule):
    """transpose(transpose(x, p), q) -> transpose(x, p[q])"""

    name = "fold-transpose-chain"

    def pattern(self, op: PatternBuilder, x: Var) -> Any:
        inner = op.transpose(x, perm=op.attr("p"), _single_use=True)
        return op.transpose(inner, perm=op.attr("q"))

    def rewrite(self, op: GraphBuilder, x: Value, p: tuple[int, ...], q: tuple[int, ...]) -> Value:
        perm = tuple(p[i] for i in q)
        if perm == tuple(range(len(perm))):
            return x
        return op.transpose(x, perm=perm)


class IdentityTranspose(RewriteRule):
    """transpose(x, [0, 1, ..., n-1]) -> x"""

    name = "identity-transpose"

    def pattern(self, op: PatternBuilder, x: Var) -> Any:
        return op.transpose(x, perm=lambda p: tuple(p) == tuple(range(len(p))))

    def rewrite(self, op: GraphBuilder, x: Value) -> Value:
        return x


class IdentityCast(RewriteRule):
    """cast(x, dtype) -> x when x already has that dtype"""

    name = "identity-cast"

    def pattern(self, op: PatternBuilder, x: Var) -> Any:
        return op.cast(x, dtype=op.attr("dtype"))

    def check(self, ctx: MatchContext, x: Value, dtype: Any) -> MatchResult:
        if x.type.dtype != dtype:
            return ctx.fail(f"cast changes {x.type.dtype} to {dtype}")
        return ctx.ok()

    def rewrite(self, op: GraphBuilder, x: Value, dtype: Any) -> Value:
        return x


class SinglePieceSplit(RewriteRule):
    """split(x, sizes=[n]) -> x"""

    name = "single-piece-split"

    def pattern(self, op: PatternBuilder, x: Var) -> Any:
        return op.split(x, sizes=lambda s: len(s) == 1)

    def rewrite(self, op: GraphBuilder, x: Value) -> Value:
        return x


CANONICAL_RULES: tuple[RewriteRule, ...] = (
    FoldReshapeChain(),
    IdentityReshape(),
    FoldTransposeChain(),
    IdentityTranspose(),
    IdentityCast(),
    SinglePieceSplit(),
)

Canonicalize = register_pass(rewrite_pass(
    "canonicalize",
    "Fold reshape/transpose chains and remove identity reshapes, transposes, casts and splits.",
    CANONICAL_RULES,
))
