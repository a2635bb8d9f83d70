"""Small helpers that op type rules share: argument checks with precise messages."""

from __future__ import annotations

from ernie_ir.ir import OpError, TensorType
from ernie_ir.ir.types import Dim


def need(t: TensorType | None, op: str, name: str) -> TensorType:
    """The type of a required input (OpError if absent)."""
    if t is None:
        raise OpError(f"{op}: input {name} is required")
    return t


def need_float(t: TensorType, op: str, name: str) -> None:
    if not t.dtype.is_float:
        raise OpError(f"{op}: input {name} must be a float tensor, got {t}")


def need_int(t: TensorType, op: str, name: str) -> None:
    if not t.dtype.is_int:
        raise OpError(f"{op}: input {name} must be an integer tensor, got {t}")


def need_rank(t: TensorType, rank: int | tuple[int, ...], op: str, name: str) -> None:
    ranks = (rank,) if isinstance(rank, int) else rank
    if t.rank not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise OpError(f"{op}: input {name} must have rank {want}, got {t}")


def need_min_rank(t: TensorType, rank: int, op: str, name: str) -> None:
    if t.rank < rank:
        raise OpError(f"{op}: input {name} must have rank >= {rank}, got {t}")


def same_dim(a: Dim, b: Dim, op: str, what: str) -> None:
    """Two dims that must be equal (a symbolic dim only equals itself)."""
    if a != b:
        raise OpError(f"{op}: {what} do not match ({a} vs {b})")


def norm_axis(axis: int, rank: int, op: str) -> int:
    if not -rank <= axis < rank:
        raise OpError(f"{op}: axis {axis} out of range for rank {rank}")
    return axis % rank
