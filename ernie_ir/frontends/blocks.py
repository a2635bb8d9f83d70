"""Graph pieces the model builders share: heads, attention, SwiGLU.

Each function appends nodes to a `GraphBuilder` under the builder's current
scope and returns the result value. Scopes follow the checkpoint's module
paths: a linear layer's node carries the module name of its weight
(`ernie.layers.3.self_attn.qkv_proj`), the glue around it (reshape, split,
rope, attention, activations) the enclosing module (`...self_attn`), so a
pass selects "all qkv projections" with the same regex ERNIEKit uses on
layer names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ernie_ir.ir import GraphBuilder, Param, Value


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    style: Literal["interleaved", "half"]


def linear(b: GraphBuilder, x: Value, weight: Param, bias: Param | None, module: str) -> Value:
    """y = x @ weight (+ bias), scoped at the linear's own module name."""
    with b.scope(module):
        return b.linear(x, weight, bias) if bias is not None else b.linear(x, weight)


def split_heads(b: GraphBuilder, x: Value, heads: int, head_dim: int) -> Value:
    """[B, S, heads*head_dim] -> [B, S, heads, head_dim]"""
    return b.reshape(x, shape=(0, 0, heads, head_dim))


def merge_heads(b: GraphBuilder, x: Value, width: int) -> Value:
    """[B, S, heads, head_dim] -> [B, S, heads*head_dim]"""
    return b.reshape(x, shape=(0, 0, width))


def split_fused_qkv(
    b: GraphBuilder, mixed: Value, heads: int, kv_heads: int, head_dim: int,
    order: Literal["plain", "per_head"],
) -> tuple[Value, Value, Value]:
    """q [B,S,H,D], k and v [B,S,KV,D] from a fused projection's output.

    plain:    columns [all q heads | all k heads | all v heads]
    per_head: columns [q0 k0 v0 | q1 k1 v1 | ...] (needs heads == kv_heads)
    """
    if order == "plain":
        q, k, v = b.split(mixed, axis=-1, sizes=(heads * head_dim, kv_heads * head_dim, kv_heads * head_dim))
        return split_heads(b, q, heads, head_dim), split_heads(b, k, kv_heads, head_dim), \
            split_heads(b, v, kv_heads, head_dim)
    if heads != kv_heads:
        raise ValueError("a per-head fused qkv needs as many kv heads as query heads")
    per_head = b.reshape(mixed, shape=(0, 0, heads, 3 * head_dim))
    q, k, v = b.split(per_head, axis=-1, sizes=(head_dim, head_dim, head_dim))
    return q, k, v


def attend(
    b: GraphBuilder, q: Value, k: Value, v: Value, *, rope: RopeSpec | None,
    positions: Value | None = None,
) -> Value:
    """Causal attention of q [B,S,H,D] over k, v [B,S,KV,D] (RoPE on q and k first)."""
    if rope is not None:
        q = b.rope(q, positions, theta=rope.theta, style=rope.style)
        k = b.rope(k, positions, theta=rope.theta, style=rope.style)
    return b.attention(q, k, v, causal=True)


def swiglu(
    b: GraphBuilder, x: Value, up_gate: Param, up_gate_bias: Param | None,
    down: Param, down_bias: Param | None, inter: int,
) -> Value:
    """down(silu(x @ W[:, :I]) * (x @ W[:, I:])) with W = up_gate [H, 2I] ([gate | up])."""
    h = linear(b, x, up_gate, up_gate_bias, "up_gate_proj")
    gate, up = b.split(h, axis=-1, sizes=(inter, inter))
    act = b.mul(b.silu(gate), up)
    return linear(b, act, down, down_bias, "down_proj")
