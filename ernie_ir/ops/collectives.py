"""Collectives over the ranks of a layout: all_reduce, all_gather, reduce_scatter, all_gather_sequence.

A rank graph (see `ernie_ir.ir.mapping`) holds its slice of the model and
these ops where slices meet. Both span every rank of the world. A graph
alone cannot run them: `collective(per_rank_args)` is their reference
kernel over all ranks at once, which the SPMD interpreter
(`ernie_ir.runtime.spmd`) calls with the arguments of every rank; the Paddle
executable lowers them to `paddle.distributed` calls. With `world_size` 1
they are the identity, so the ordinary interpreter runs them too.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence

import numpy as np
from pydantic import Field

from ernie_ir.ir import Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, norm_axis


class AllReduceAttrs(OpAttrs):
    world_size: int = Field(ge=1)
    """How many ranks take part (all of them)."""


class AllGatherAttrs(OpAttrs):
    axis: int
    world_size: int = Field(ge=1)


class CollectiveOp(OpDef):
    """Shared by the collectives: a per-rank kernel only for a world of one."""

    def kernel(self, args: Sequence[np.ndarray | None], attrs: AllReduceAttrs) -> list[np.ndarray]:
        if attrs.world_size != 1:
            raise OpError(f"{self.name} over {attrs.world_size} ranks needs every rank's input: run the "
                          "rank graphs together (ernie-ir run ARTIFACT --backend interpreter, or "
                          "ernie_ir.runtime.spmd.run_spmd)")
        return self.collective([list(args)], attrs)[0]

    @abstractmethod
    def collective(self, per_rank: Sequence[Sequence[np.ndarray | None]],
                   attrs: AllReduceAttrs) -> list[list[np.ndarray]]:
        """Outputs of every rank from the inputs of every rank (rank order)."""


@register_op
class AllReduce(CollectiveOp):
    """y = x_0 + x_1 + ... + x_{W-1} on every rank (sum over ranks 0..W-1 in that order)

    x: float [...], the same type on every rank; y: x's type. The sum is taken in
    float32 in rank order, so every rank holds bit-identical results.
    """

    name = "all_reduce"
    inputs = (Input("x"),)
    Attrs = AllReduceAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: AllReduceAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        if not x.dtype.is_float:
            raise OpError(f"all_reduce: input x must be a float tensor, got {x}")
        return [x]

    def collective(self, per_rank: Sequence[Sequence[np.ndarray | None]],
                   attrs: AllReduceAttrs) -> list[list[np.ndarray]]:
        _check_world(self.name, per_rank, attrs.world_size)
        total = np.array(per_rank[0][0], dtype=np.float32, copy=True)
        for args in per_rank[1:]:
            total += args[0]
        return [[total] for _ in per_rank]


@register_op
class AllGather(CollectiveOp):
    """y = concatenate([x_0, x_1, ..., x_{W-1}], axis) on every rank

    x: [...] with the same type on every rank; y: x with dim `axis` times W.
    """

    name = "all_gather"
    inputs = (Input("x"),)
    Attrs = AllGatherAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: AllGatherAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        axis = norm_axis(attrs.axis, x.rank, self.name)
        dim = x.shape[axis]
        if not isinstance(dim, int):
            raise OpError(f"all_gather: the gathered dim {axis} of {x} must be static")
        shape = list(x.shape)
        shape[axis] = dim * attrs.world_size
        return [x.with_shape(shape)]

    def collective(self, per_rank: Sequence[Sequence[np.ndarray | None]],
                   attrs: AllGatherAttrs) -> list[list[np.ndarray]]:
        _check_world(self.name, per_rank, attrs.world_size)
        whole = np.concatenate([args[0] for args in per_rank], axis=attrs.axis)
        return [[whole] for _ in per_rank]


def _check_world(op: str, per_rank: Sequence[Sequence[np.ndarray | None]], world: int) -> None:
    if len(per_rank) != world:
        raise OpError(f"{op}: world_size is {world} but {len(per_rank)} ranks took part")
    shapes = {tuple(np.shape(args[0])) for args in per_rank}
    if len(shapes) != 1:
        raise OpError(f"{op}: ranks disagree on the shape ({sorted(shapes)})")


# -- sequence parallelism (Megatron / Paddle `sequence_parallel_utils`) -------------------------

SP_TOKENS = "Tsp"
"""The symbolic dim of a rank's token shard ([B*S / tp] of the flattened [B*S, H] tokens)."""


def sequence_tokens_error(tokens: int, world: int) -> str:
    """The one-line refusal of a batch whose B*S tokens do not split over the ranks."""
    return (f"sequence parallelism: {tokens} tokens (batch x sequence) do not divide into tp {world}; "
            f"use a batch and sequence length whose product is a multiple of {world} "
            "(or compile without --sp)")


class ReduceScatterAttrs(OpAttrs):
    dims: int = Field(ge=1)
    """How many leading dims are token dims (flattened before the scatter: [B, S, H] -> [B*S, H])."""
    world_size: int = Field(ge=1)


class AllGatherSequenceAttrs(OpAttrs):
    dims: int = Field(ge=1)
    """How many leading dims of `like` the gathered tokens are unflattened into."""
    world_size: int = Field(ge=1)


def _token_shard(x: TensorType, attrs: ReduceScatterAttrs, op: str) -> TensorType:
    """[d_0, ..., d_{k-1}, ...] -> [T / W, ...]: a rank's shard of the flattened tokens."""
    if x.rank <= attrs.dims:
        raise OpError(f"{op}: x {x} needs more than {attrs.dims} dims (tokens, then features)")
    lead = x.shape[:attrs.dims]
    local: int | str = SP_TOKENS
    if all(isinstance(d, int) for d in lead):
        total = math.prod(lead)  # type: ignore[arg-type]
        if total % attrs.world_size:
            raise OpError(sequence_tokens_error(total, attrs.world_size))
        local = total // attrs.world_size
    return x.with_shape([local, *x.shape[attrs.dims:]])


@register_op
class ReduceScatter(CollectiveOp):
    """y_r = rows [r*n, (r+1)*n) of reshape(x_0 + ... + x_{W-1}, [T, ...]) on rank r

    x: float [d_0, ..., d_{k-1}, ...] (k = dims token dims, T = d_0 * ... * d_{k-1} tokens, T
    divisible by W), the same type on every rank; y: [T / W, ...], rank r's contiguous token
    shard of the sum (taken in float32 in rank order, as all_reduce). Sequence parallelism's
    reduce-scatter after a row-parallel block (backward: the all-gather of the gradient).
    """

    name = "reduce_scatter"
    inputs = (Input("x"),)
    Attrs = ReduceScatterAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: ReduceScatterAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        if not x.dtype.is_float:
            raise OpError(f"reduce_scatter: input x must be a float tensor, got {x}")
        return [_token_shard(x, attrs, self.name)]

    def collective(self, per_rank: Sequence[Sequence[np.ndarray | None]],
                   attrs: ReduceScatterAttrs) -> list[list[np.ndarray]]:
        _check_world(self.name, per_rank, attrs.world_size)
        total = np.array(per_rank[0][0], dtype=np.float32, copy=True)
        for args in per_rank[1:]:
            total += args[0]
        flat = total.reshape(-1, *total.shape[attrs.dims:])
        tokens, world = flat.shape[0], attrs.world_size
        if tokens % world:
            raise OpError(sequence_tokens_error(tokens, world))
        n = tokens // world
        return [[flat[r * n:(r + 1) * n]] for r in range(world)]


@register_op
class AllGatherSequence(CollectiveOp):
    """y = reshape(concatenate([x_0, ..., x_{W-1}], 0), like.shape[:dims] + x.shape[1:]) on every rank

    x: [n, ...], a rank's token shard (the same type on every rank); like: any tensor whose
    first `dims` dims are the token dims (the graph's input ids [B, S]), with
    prod(like.shape[:dims]) = W * n; y: [d_0, ..., d_{k-1}, ...]. Sequence parallelism's all-gather
    before a column-parallel block (backward: the rank's token shard of the gradient; the gradient
    is summed over ranks before, where the ranks' sharded readers meet).
    """

    name = "all_gather_sequence"
    inputs = (Input("x"), Input("like"))
    Attrs = AllGatherSequenceAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: AllGatherSequenceAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        like = need(types[1], self.name, "like")
        if x.rank < 1 or like.rank < attrs.dims:
            raise OpError(f"all_gather_sequence: x {x} needs a token axis and like {like} {attrs.dims} dims")
        lead = like.shape[:attrs.dims]
        if isinstance(x.shape[0], int) and all(isinstance(d, int) for d in lead) and \
                math.prod(lead) != x.shape[0] * attrs.world_size:  # type: ignore[arg-type]
            raise OpError(f"all_gather_sequence: {attrs.world_size} shards of {x.shape[0]} tokens are not "
                          f"the {math.prod(lead)} tokens of {like}")  # type: ignore[arg-type]
        return [x.with_shape([*lead, *x.shape[1:]])]

    def collective(self, per_rank: Sequence[Sequence[np.ndarray | None]],
                   attrs: AllGatherSequenceAttrs) -> list[list[np.ndarray]]:
        _check_world(self.name, per_rank, attrs.world_size)
        x0, like = per_rank[0][0], per_rank[0][1]
        assert x0 is not None and like is not None
        whole = np.concatenate([args[0] for args in per_rank], axis=0)
        return [[whole.reshape(*like.shape[:attrs.dims], *x0.shape[1:])] for _ in per_rank]


@register_op
class ScatterSequence(CollectiveOp):
    """y_r = rows [r*n, (r+1)*n) of reshape(x, [T, ...]) on rank r (no communication)

    x: [d_0, ..., d_{k-1}, ...], replicated (the same on every rank), T = d_0 * ... * d_{k-1}
    tokens divisible by W; y: [T / W, ...]. Sequence parallelism's scatter of a whole token-shaped
    value onto the token shards (Megatron's ScatterOp; backward: the gradients of the shards
    gathered, which the "f" of the Paddle Layer does by summing the zero-padded slices).
    """

    name = "scatter_sequence"
    inputs = (Input("x"),)
    Attrs = ReduceScatterAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: ReduceScatterAttrs) -> list[TensorType]:
        return [_token_shard(need(types[0], self.name, "x"), attrs, self.name)]

    def collective(self, per_rank: Sequence[Sequence[np.ndarray | None]],
                   attrs: ReduceScatterAttrs) -> list[list[np.ndarray]]:
        _check_world(self.name, per_rank, attrs.world_size)
        x = np.asarray(per_rank[0][0])
        flat = x.reshape(-1, *x.shape[attrs.dims:])
        tokens, world = flat.shape[0], attrs.world_size
        if tokens % world:
            raise OpError(sequence_tokens_error(tokens, world))
        n = tokens // world
        return [[flat[r * n:(r + 1) * n]] for r in range(world)]
