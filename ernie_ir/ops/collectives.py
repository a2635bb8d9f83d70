"""Collectives: all_reduce and all_gather across the ranks of a parallel layout.

A rank graph (see `ernie_ir.ir.mapping`) holds its slice of the model and
these ops where slices meet. Both span every rank of the world. A graph
alone cannot run them: `collective(per_rank_args)` is their reference
kernel over all ranks at once, which the SPMD interpreter
(`ernie_ir.runtime.spmd`) calls with the arguments of every rank; the Paddle
executable lowers them to `paddle.distributed` calls. With `world_size` 1
they are the identity, so the ordinary interpreter runs them too.
"""

from __future__ import annotations

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
