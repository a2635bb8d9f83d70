"""Type rules of every op, through GraphBuilder: inferred output types with static and
symbolic dims, and the OpError message for each kind of wrong input."""

from __future__ import annotations

import re

import pytest

from ernie_ir.ir import (
    GraphBuilder,
    OpError,
    TensorType,
    bf16,
    boolean,
    f16,
    f32,
    i8,
    i32,
    i64,
    tensor,
)


def build(op: str, *types: TensorType | None, **attrs) -> TensorType | tuple[TensorType, ...]:
    """Apply `b.<op>` to fresh graph inputs of these types; the output type(s)."""
    b = GraphBuilder("types")
    ins = [None if t is None else b.input(f"in{i}", t) for i, t in enumerate(types)]
    out = getattr(b, op)(*ins, **attrs)
    if isinstance(out, tuple):
        return tuple(v.type for v in out)
    return out.type


T = tensor  # short: T(f32, "B", "S", 16)

OK_CASES = [
    # embedding
    ("embedding", [T(i64, "B", "S"), T(bf16, 1000, 64)], {}, T(bf16, "B", "S", 64)),
    ("embedding", [T(i32, 7), T(f32, 10, 4)], {}, T(f32, 7, 4)),
    ("embedding", [T(i64), T(f32, 10, 4)], {}, T(f32, 4)),
    # linear
    ("linear", [T(bf16, "B", "S", 16), T(bf16, 16, 32)], {}, T(bf16, "B", "S", 32)),
    ("linear", [T(f32, "B", "S", 16), T(bf16, 16, 32), T(f32, 32)], {}, T(f32, "B", "S", 32)),
    ("linear", [T(f32, 16), T(f32, 16, 8)], {}, T(f32, 8)),
    ("linear", [T(f32, "B", "K"), T(f32, "K", "N"), T(f32, "N")], {}, T(f32, "B", "N")),
    # lm_head: logits are always f32
    ("lm_head", [T(bf16, "B", "S", 16), T(bf16, 16, 100)], {}, T(f32, "B", "S", 100)),
    ("lm_head", [T(bf16, "B", "S", 16), T(bf16, 100, 16)], {"transpose_weight": True},
     T(f32, "B", "S", 100)),
    ("lm_head", [T(f16, "T", "H"), T(f16, "V", "H")], {"transpose_weight": True}, T(f32, "T", "V")),
    # norms keep the input type
    ("rms_norm", [T(bf16, "B", "S", 16), T(f32, 16)], {"eps": 1e-6}, T(bf16, "B", "S", 16)),
    ("rms_norm", [T(f32, "B", "H"), T(bf16, "H")], {"eps": 1e-5}, T(f32, "B", "H")),
    ("layer_norm", [T(f16, "B", "S", 16)], {"eps": 1e-5}, T(f16, "B", "S", 16)),
    ("layer_norm", [T(f32, "B", 16), T(f32, 16), T(f32, 16)], {"eps": 1e-5}, T(f32, "B", 16)),
    ("layer_norm", [T(f32, "B", 16), None, T(f32, 16)], {"eps": 1e-5}, T(f32, "B", 16)),
    # rope
    ("rope", [T(bf16, "B", "S", 8, 64)], {"theta": 10000.0}, T(bf16, "B", "S", 8, 64)),
    ("rope", [T(f32, "B", "S", 8, 64), T(i64, "B", "S")], {"theta": 1e4, "style": "half"},
     T(f32, "B", "S", 8, 64)),
    ("rope", [T(f32, "B", "S", 8, 64), T(i32, 1, "S")], {"theta": 1e4}, T(f32, "B", "S", 8, 64)),
    ("rope", [T(f32, 2, 5, "N", "D")], {"theta": 1e4}, T(f32, 2, 5, "N", "D")),
    # attention (GQA: 8 query heads over 2 kv heads; Dv may differ from D)
    ("attention", [T(bf16, "B", "S", 8, 64), T(bf16, "B", "T", 2, 64), T(bf16, "B", "T", 2, 32)], {},
     T(bf16, "B", "S", 8, 32)),
    ("attention", [T(f32, "B", "S", 8, 64), T(f32, "B", "T", 2, 64), T(f32, "B", "T", 2, 64),
                   T(boolean, "B", 1, "S", "T")], {"causal": False}, T(f32, "B", "S", 8, 64)),
    ("attention", [T(f32, 2, 3, 4, 16), T(f32, 2, 5, 4, 16), T(f32, 2, 5, 4, 16), T(f32, 3, 5)],
     {"scale": 0.5}, T(f32, 2, 3, 4, 16)),
    ("attention", [T(f32, 2, 3, 4, 16), T(f32, 2, 5, 4, 16), T(f32, 2, 5, 4, 16), T(f16, 1, 4, 1, 5)],
     {}, T(f32, 2, 3, 4, 16)),
    ("attention", [T(f32, "B", "S", "H", 64), T(f32, "B", "S", "KV", 64), T(f32, "B", "S", "KV", 64)],
     {}, T(f32, "B", "S", "H", 64)),
    # activations
    ("silu", [T(bf16, "B", "S", 64)], {}, T(bf16, "B", "S", 64)),
    ("gelu", [T(f32, "B", 64)], {"approximate": "tanh"}, T(f32, "B", 64)),
    ("gelu", [T(f16)], {}, T(f16)),
    ("softmax", [T(f32, "B", "S", 10)], {}, T(f32, "B", "S", 10)),
    ("softmax", [T(f32, "B", "S", 10)], {"axis": 1}, T(f32, "B", "S", 10)),
    ("softmax", [T(f32, "B", "S", 10)], {"axis": -3}, T(f32, "B", "S", 10)),
    # elementwise broadcasting and dtype promotion
    ("add", [T(f32, "B", "S", 16), T(f32, 16)], {}, T(f32, "B", "S", 16)),
    ("add", [T(bf16, "B", 1, 4), T(f16, "S", 4)], {}, T(f32, "B", "S", 4)),
    ("add", [T(i64, "B"), T(i64)], {}, T(i64, "B")),
    ("mul", [T(bf16, "B", "S", 16), T(bf16, "B", "S", 1)], {}, T(bf16, "B", "S", 16)),
    ("mul", [T(f32, 1, "S"), T(f32, "B", 1)], {}, T(f32, "B", "S")),
    # moe
    ("moe_gate", [T(bf16, "B", "S", 16), T(f32, 16, 8)], {"top_k": 2},
     (T(f32, "B", "S", 2), T(i64, "B", "S", 2))),
    ("moe_gate", [T(f32, "T", 16), T(f32, 16, 8), T(f32, 8)], {"top_k": 8}, (T(f32, "T", 8), T(i64, "T", 8))),
    ("moe_gate", [T(f32, "T", 16), T(f32, 16, 8), T(f32, 1, 8)], {"top_k": 1},
     (T(f32, "T", 1), T(i64, "T", 1))),
    ("moe_gate", [T(f32, "T", 16), T(f32, 16, "E")], {"top_k": 4}, (T(f32, "T", 4), T(i64, "T", 4))),
    ("moe_experts", [T(bf16, "T", 16), T(f32, "T", 2), T(i64, "T", 2), T(bf16, 8, 16, 64),
                     T(bf16, 8, 32, 16)], {}, T(bf16, "T", 16)),
    ("moe_experts", [T(f32, "B", "S", 16), T(f32, "B", "S", 3), T(i32, "B", "S", 3), T(f32, "E", 16, 8),
                     T(f32, "E", 4, 16)], {}, T(f32, "B", "S", 16)),
    # split / concat
    ("split", [T(f32, "B", "S", 96)], {"axis": -1, "sizes": (32, 32, 32)},
     (T(f32, "B", "S", 32),) * 3),
    ("split", [T(f32, 6, "B")], {"axis": 0, "sizes": (2, 4)}, (T(f32, 2, "B"), T(f32, 4, "B"))),
    ("split", [T(bf16, "B", 8)], {"axis": 1, "sizes": (8,)}, T(bf16, "B", 8)),
    ("split", [T(f32, "B", 8)], {"axis": 1, "sizes": (0, 8)}, (T(f32, "B", 0), T(f32, "B", 8))),
    ("concat", [T(f32, "B", "S", 4), T(f32, "B", "S", 6)], {"axis": 2}, T(f32, "B", "S", 10)),
    ("concat", [T(f32, "B", "S", 4), T(f32, "B", "S", 6), T(f32, "B", "S", 1)], {"axis": -1},
     T(f32, "B", "S", 11)),
    ("concat", [T(i64, 3, "S")], {"axis": 0}, T(i64, 3, "S")),
    # reshape: 0 copies a dim, -1 is inferred symbolically
    ("reshape", [T(f32, "B", "S", 64)], {"shape": (0, 0, 4, -1)}, T(f32, "B", "S", 4, 16)),
    ("reshape", [T(f32, "B", "S", 32)], {"shape": (-1, 32)}, T(f32, "B*S", 32)),
    ("reshape", [T(f32, "B*S", 32)], {"shape": (-1, 4, 8)}, T(f32, "B*S", 4, 8)),
    ("reshape", [T(f32, "B", "S", 4, 16)], {"shape": (0, 0, -1)}, T(f32, "B", "S", 64)),
    ("reshape", [T(f32, "B", "S", 4, 16)], {"shape": (0, 0, 64)}, T(f32, "B", "S", 64)),
    ("reshape", [T(f32, 2, "S", 6)], {"shape": (-1, 6)}, T(f32, "2*S", 6)),
    ("reshape", [T(f32, "S", "B", 8)], {"shape": (-1, 2)}, T(f32, "4*B*S", 2)),
    ("reshape", [T(f32, 6, 4)], {"shape": (3, 8)}, T(f32, 3, 8)),
    ("reshape", [T(f32, 6, 4)], {"shape": (-1,)}, T(f32, 24)),
    # transpose
    ("transpose", [T(f32, "B", "S", 8, 64)], {"perm": (0, 2, 1, 3)}, T(f32, "B", 8, "S", 64)),
    ("transpose", [T(f32, "B", 3)], {"perm": (1, 0)}, T(f32, 3, "B")),
    # cast (dtype given as a DType or by its short name)
    ("cast", [T(f32, "B", "S")], {"dtype": bf16}, T(bf16, "B", "S")),
    ("cast", [T(bf16, "B", "S")], {"dtype": "i8"}, T(i8, "B", "S")),
]


@pytest.mark.parametrize(("op", "types", "attrs", "expect"), OK_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(OK_CASES)])
def test_inferred_type(op, types, attrs, expect):
    assert build(op, *types, **attrs) == expect


ERROR_CASES = [
    # embedding
    ("embedding", [T(f32, "B", "S"), T(f32, 10, 4)], {},
     "embedding: input ids must be an integer tensor, got f32[B,S]"),
    ("embedding", [T(i64, "B"), T(i64, 10, 4)], {},
     "embedding: input table must be a float tensor, got i64[10,4]"),
    ("embedding", [T(i64, "B"), T(f32, 10, 4, 2)], {},
     "embedding: input table must have rank 2, got f32[10,4,2]"),
    # linear
    ("linear", [T(f32, "B", 16), T(f32, 8, 32)], {},
     "linear: x's last dim and weight's in_features do not match (16 vs 8)"),
    ("linear", [T(f32, "B", "K"), T(f32, "N", 4)], {}, "do not match (K vs N)"),
    ("linear", [T(f32, "B", 16), T(f32, 16)], {}, "linear: input weight must have rank 2, got f32[16]"),
    ("linear", [T(f32, "B", 16), T(f32, 16, 32), T(f32, 16)], {},
     "linear: bias size and out_features do not match (16 vs 32)"),
    ("linear", [T(f32, "B", 16), T(f32, 16, 32), T(f32, 1, 32)], {}, "linear: input bias must have rank 1"),
    ("linear", [T(i32, "B", 16), T(f32, 16, 32)], {},
     "linear: input x must be a float tensor, got i32[B,16]"),
    ("linear", [T(f32), T(f32, 16, 32)], {}, "linear: input x must have rank 1, got f32[]"),
    ("linear", [T(f32, "B", 16)], {}, "op linear takes (x, weight, bias?) but got 1 inputs"),
    ("linear", [T(f32, "B", 16), None], {}, "op linear: input weight is required"),
    # lm_head
    ("lm_head", [T(f32, "B", 16), T(f32, 32, 100)], {},
     "lm_head: x's last dim and weight's hidden size do not match (16 vs 32)"),
    ("lm_head", [T(f32, "B", 16), T(f32, 16, 100)], {"transpose_weight": True}, "do not match (16 vs 100)"),
    ("lm_head", [T(f32), T(f32, 16, 100)], {}, "lm_head: input x must have rank >= 1, got f32[]"),
    ("lm_head", [T(i64, "B", 16), T(f32, 16, 100)], {}, "lm_head: input x must be a float tensor"),
    ("lm_head", [T(f32, "B", 16), T(f32, 16, 100, 1)], {}, "lm_head: input weight must have rank 2"),
    # rms_norm / layer_norm
    ("rms_norm", [T(f32, "B", 16), T(f32, 8)], {"eps": 1e-6},
     "rms_norm: weight size and x's last dim do not match (8 vs 16)"),
    ("rms_norm", [T(f32, "B", "H"), T(f32, "D")], {"eps": 1e-6}, "do not match (D vs H)"),
    ("rms_norm", [T(f32, "B", 16), T(f32, 1, 16)], {"eps": 1e-6}, "rms_norm: input weight must have rank 1"),
    ("rms_norm", [T(i8, "B", 16), T(f32, 16)], {"eps": 1e-6}, "rms_norm: input x must be a float tensor"),
    ("rms_norm", [T(f32), T(f32, 16)], {"eps": 1e-6}, "rms_norm: input x must have rank >= 1, got f32[]"),
    ("rms_norm", [T(f32, "B", 16), T(f32, 16)], {}, "op rms_norm: attribute eps: Field required"),
    ("layer_norm", [T(f32, "B", 16), T(f32, 16), T(f32, 12)], {"eps": 1e-6},
     "layer_norm: bias size and x's last dim do not match (12 vs 16)"),
    ("layer_norm", [T(f32, "B", 16), T(f32, 15)], {"eps": 1e-6},
     "layer_norm: weight size and x's last dim do not match (15 vs 16)"),
    ("layer_norm", [T(f32), T(f32, 1)], {"eps": 1e-6}, "layer_norm: input x must have rank >= 1"),
    # rope
    ("rope", [T(f32, "B", "S", 64)], {"theta": 1e4}, "rope: input x must have rank 4, got f32[B,S,64]"),
    ("rope", [T(f32, "B", "S", 8, 63)], {"theta": 1e4}, "rope: head dim must be even, got 63"),
    ("rope", [T(i64, "B", "S", 8, 64)], {"theta": 1e4}, "rope: input x must be a float tensor"),
    ("rope", [T(f32, "B", "S", 8, 64), T(f32, "B", "S")], {"theta": 1e4},
     "rope: input position_ids must be an integer tensor, got f32[B,S]"),
    ("rope", [T(f32, "B", "S", 8, 64), T(i64, "S")], {"theta": 1e4},
     "rope: input position_ids must have rank 2, got i64[S]"),
    ("rope", [T(f32, "B", "S", 8, 64), T(i64, "B", "T")], {"theta": 1e4},
     "rope: position_ids and x sequence lengths do not match (T vs S)"),
    ("rope", [T(f32, 2, "S", 8, 64), T(i64, 3, "S")], {"theta": 1e4},
     "rope: position_ids and x batch sizes do not match (3 vs 2)"),
    ("rope", [T(f32, "B", "S", 8, 64), T(i64, "C", "S")], {"theta": 1e4},
     "batch sizes do not match (C vs B)"),
    ("rope", [T(f32, "B", "S", 8, 64)], {}, "op rope: attribute theta: Field required"),
    # attention
    ("attention", [T(f32, 1, 3, 6, 16), T(f32, 1, 3, 4, 16), T(f32, 1, 3, 4, 16)], {},
     "attention: 6 query heads are not a multiple of 4 kv heads"),
    ("attention", [T(f32, 1, 3, 4, 64), T(f32, 1, 3, 2, 32), T(f32, 1, 3, 2, 32)], {},
     "attention: head dims of q and k do not match (64 vs 32)"),
    ("attention", [T(f32, "B", 3, 4, 16), T(f32, "C", 3, 2, 16), T(f32, "C", 3, 2, 16)], {},
     "attention: batch of q and k do not match (B vs C)"),
    ("attention", [T(f32, 1, 3, 4, 16), T(f32, 1, 5, 2, 16), T(f32, 1, 4, 2, 16)], {},
     "attention: [B, T, KV] of k and v do not match"),
    ("attention", [T(f32, 1, 3, 64), T(f32, 1, 3, 2, 32), T(f32, 1, 3, 2, 32)], {},
     "attention: input q must have rank 4, got f32[1,3,64]"),
    ("attention", [T(f32, 1, 3, 4, 16), T(i8, 1, 3, 2, 16), T(f32, 1, 3, 2, 16)], {},
     "attention: input k must be a float tensor"),
    ("attention", [T(f32, 1, 3, 4, 16), T(f32, 1, 5, 2, 16), T(f32, 1, 5, 2, 16), T(i32, 3, 5)], {},
     "attention: mask must be float (additive) or bool (keep), got i32[3,5]"),
    ("attention", [T(f32, 1, 3, 4, 16), T(f32, 1, 5, 2, 16), T(f32, 1, 5, 2, 16), T(boolean, 5, 3)], {},
     "attention: mask must broadcast to [B, H, S, T] = [1, 4, 3, 5], got bool[5,3]"),
    ("attention", [T(f32, 1, 3, 4, 16), T(f32, 1, 5, 2, 16), T(f32, 1, 5, 2, 16),
                   T(f32, 1, 1, 1, 3, 5)], {}, "attention: mask must broadcast to [B, H, S, T]"),
    # activations
    ("silu", [T(i64, "B")], {}, "silu: input x must be a float tensor, got i64[B]"),
    ("gelu", [T(i32, "B")], {}, "gelu: input x must be a float tensor"),
    ("softmax", [T(f32, "B", "S", 10)], {"axis": 3}, "softmax: axis 3 out of range for rank 3"),
    ("softmax", [T(f32, "B", "S", 10)], {"axis": -4}, "softmax: axis -4 out of range for rank 3"),
    ("softmax", [T(i64, "B")], {}, "softmax: input x must be a float tensor"),
    # elementwise
    ("add", [T(f32, "B", 4), T(f32, "S", 4)], {}, "add: shapes ['B', 4] and ['S', 4] do not broadcast"),
    ("mul", [T(f32, 3, 4), T(f32, 2, 4)], {}, "mul: shapes [3, 4] and [2, 4] do not broadcast"),
    ("add", [T(i64, "B"), T(f32, "B")], {}, "add: cannot combine i64 and f32; cast one of them first"),
    ("mul", [T(i32, "B"), T(i64, "B")], {}, "mul: cannot combine i32 and i64"),
    # moe_gate
    ("moe_gate", [T(f32, "T", 16), T(f32, 16, 8)], {"top_k": 9}, "moe_gate: top_k 9 exceeds the 8 experts"),
    ("moe_gate", [T(f32, "T", 16), T(f32, 12, 8)], {"top_k": 2},
     "moe_gate: x's last dim and router in-dim do not match (16 vs 12)"),
    ("moe_gate", [T(f32, "T", 16), T(f32, 16, 8), T(f32, 7)], {"top_k": 2},
     "moe_gate: bias size and expert count do not match (7 vs 8)"),
    ("moe_gate", [T(f32, "T", 16), T(f32, 16, 8), T(f32, 2, 8)], {"top_k": 2},
     "moe_gate: bias leading dim do not match (2 vs 1)"),
    ("moe_gate", [T(f32, "T", 16), T(f32, 16, 8), T(f32, 1, 1, 8)], {"top_k": 2},
     "moe_gate: input bias must have rank 1 or 2"),
    ("moe_gate", [T(i64, "T", 16), T(f32, 16, 8)], {"top_k": 2}, "moe_gate: input x must be a float tensor"),
    ("moe_gate", [T(f32), T(f32, 16, 8)], {"top_k": 2}, "moe_gate: input x must have rank >= 1"),
    ("moe_gate", [T(f32, "T", 16), T(f32, 16, 8)], {}, "op moe_gate: attribute top_k: Field required"),
    # moe_experts
    ("moe_experts", [T(f32, "T", 16), T(f32, "T", 2), T(i64, "T", 3), T(f32, 8, 16, 64), T(f32, 8, 32, 16)],
     {}, "moe_experts: shapes of weights and indices do not match"),
    ("moe_experts", [T(f32, "T", 16), T(f32, "T", 2), T(f32, "T", 2), T(f32, 8, 16, 64), T(f32, 8, 32, 16)],
     {}, "moe_experts: input indices must be an integer tensor"),
    ("moe_experts", [T(f32, "T", 16), T(f32, "U", 2), T(i64, "U", 2), T(f32, 8, 16, 64), T(f32, 8, 32, 16)],
     {}, "moe_experts: token dims of weights and x do not match"),
    ("moe_experts", [T(f32, "T", 16), T(f32, "T", 2), T(i64, "T", 2), T(f32, 8, 16, 60), T(f32, 8, 32, 16)],
     {}, "moe_experts: up_gate has 60 columns, expected 2 x 32 ([gate | up])"),
    ("moe_experts", [T(f32, "T", 16), T(f32, "T", 2), T(i64, "T", 2), T(f32, 8, 16, 64), T(f32, 4, 32, 16)],
     {}, "moe_experts: expert counts of up_gate and down do not match (8 vs 4)"),
    ("moe_experts", [T(f32, "T", 16), T(f32, "T", 2), T(i64, "T", 2), T(f32, 8, 12, 64), T(f32, 8, 32, 16)],
     {}, "moe_experts: up_gate in-dim and x's last dim do not match (12 vs 16)"),
    ("moe_experts", [T(f32, "T", 16), T(f32, "T", 2), T(i64, "T", 2), T(f32, 8, 16, 64), T(f32, 8, 32, 12)],
     {}, "moe_experts: down out-dim and x's last dim do not match (12 vs 16)"),
    ("moe_experts", [T(f32, "T", 16), T(f32, "T", 2), T(i64, "T", 2), T(f32, 16, 64), T(f32, 8, 32, 16)],
     {}, "moe_experts: input up_gate must have rank 3"),
    # split
    ("split", [T(f32, "B", "S", 96)], {"axis": 2, "sizes": (32, 32)},
     "split: sizes [32, 32] do not add up to dim 2 of f32[B,S,96]"),
    ("split", [T(f32, "B", "S", 4)], {"axis": 1, "sizes": (2, 2)},
     "split: sizes [2, 2] do not add up to dim 1 of f32[B,S,4]"),
    ("split", [T(f32, "B", 4)], {"axis": 1, "sizes": (6, -2)}, "split: sizes [6, -2] do not add up"),
    ("split", [T(f32, "B", 4)], {"axis": 2, "sizes": (4,)}, "split: axis 2 out of range for rank 2"),
    ("split", [T(f32)], {"axis": 0, "sizes": (1,)}, "split: axis 0 out of range for rank 0"),
    # concat
    ("concat", [T(f32, "B", "S", 4), T(bf16, "B", "S", 6)], {"axis": 2},
     "concat: xs[1] is bf16[B,S,6], expected f32 of rank 3"),
    ("concat", [T(f32, "B", "S", 4), T(f32, "B", 6)], {"axis": -1},
     "concat: xs[1] is f32[B,6], expected f32 of rank 3"),
    ("concat", [T(f32, "B", "S", 4), T(f32, "B", "T", 6)], {"axis": 2},
     "concat: xs[1] is f32[B,T,6], dim 1 differs from xs[0] f32[B,S,4]"),
    ("concat", [T(f32, "B", "S", 4), T(f32, "B", "S", 4)], {"axis": 1},
     "concat: dim 1 of xs[0] is symbolic (S)"),
    ("concat", [T(f32, "B", 4)], {"axis": 2}, "concat: axis 2 out of range for rank 2"),
    ("concat", [T(f32), T(f32)], {"axis": 0}, "concat: axis 0 out of range for rank 0"),
    ("concat", [], {"axis": 0}, "concat: needs at least one input"),
    # reshape
    ("reshape", [T(f32, "B", "S", 64)], {"shape": (-1, -1)}, "reshape: at most one -1 in shape [-1, -1]"),
    ("reshape", [T(f32, 6, 4)], {"shape": (5, 5)},
     "reshape: cannot reshape [6, 4] (24 elements) into [5, 5]"),
    ("reshape", [T(f32, "B", 4)], {"shape": (8,)},
     "reshape: cannot reshape ['B', 4] (4*B elements) into [8]"),
    ("reshape", [T(f32, "B", "S", 6)], {"shape": (0, 0, 4, -1)},
     "reshape: cannot reshape ['B', 'S', 6] into [0, 0, 4, -1]"),
    ("reshape", [T(f32, "B", "S")], {"shape": (0, 0, 0)},
     "reshape: 0 at position 2 but the input has rank 2"),
    ("reshape", [T(f32, 6, 4)], {"shape": (-2, 12)}, "reshape: invalid dim -2 in shape [-2, 12]"),
    ("reshape", [T(f32, "B", 6)], {"shape": (4, -1)}, "reshape: cannot reshape ['B', 6] into [4, -1]"),
    # transpose
    ("transpose", [T(f32, "B", "S", 8)], {"perm": (0, 0, 1)},
     "transpose: perm [0, 0, 1] is not a permutation of rank 3"),
    ("transpose", [T(f32, "B", "S", 8)], {"perm": (1, 0)},
     "transpose: perm [1, 0] is not a permutation of rank 3"),
    ("transpose", [T(f32, "B", "S")], {"perm": (-1, 0)}, "is not a permutation of rank 2"),
    # cast
    ("cast", [T(f32, "B")], {"dtype": "f12"}, "op cast: attribute dtype:"),
    ("cast", [T(f32, "B")], {}, "op cast: attribute dtype: Field required"),
]


@pytest.mark.parametrize(("op", "types", "attrs", "message"), ERROR_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(ERROR_CASES)])
def test_type_error_message(op, types, attrs, message):
    with pytest.raises(OpError, match=re.escape(message)):
        build(op, *types, **attrs)


def test_every_op_has_type_cases():
    names = {c[0] for c in OK_CASES} & {c[0] for c in ERROR_CASES}
    expected = {
        "embedding", "linear", "lm_head", "rms_norm", "layer_norm", "rope", "attention", "silu", "gelu",
        "softmax", "add", "mul", "moe_gate", "moe_experts", "split", "concat", "reshape", "transpose",
        "cast",
    }
    assert expected <= names


def test_builder_binds_inputs_by_name():
    b = GraphBuilder("kw")
    x = b.input("x", tensor(f32, "B", 16))
    w = b.input("w", tensor(f32, 16, 4))
    bias = b.input("bias", tensor(f32, 4))
    y = b.linear(x, weight=w, bias=bias)
    assert y.type == tensor(f32, "B", 4)
    assert y.producer.input("bias") is bias
    with pytest.raises(OpError, match="input weight given twice"):
        b.linear(x, w, weight=w)
