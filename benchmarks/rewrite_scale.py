"""One rewrite over a 60,000-node graph: ernie-ir rules vs the onnxscript rewriter.

The same computation is built twice: as our IR (linear -> add(bias param) ->
silu, repeated) and as an onnx_ir model (MatMul -> Add(bias initializer) ->
Sigmoid). Each tool applies its equivalent of "fuse the bias add into the
matmul" to a fixed point; only the rewrite is timed (no serialization), in
CPU time of this process (the machine is shared: wall time would measure the
neighbours). The ratio is what to compare: both ran in this process, on this
machine, now. Without onnxscript our figure is still printed (exit code 1).

    pip install onnxscript   # benchmark-only dependency
    python benchmarks/rewrite_scale.py [--nodes 60000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import numpy as np

import ernie_ir  # noqa: F401
from ernie_ir.ir import GraphBuilder, f32, tensor
from ernie_ir.ir.verifier import verify
from ernie_ir.passes.fusion.linear_bias import FuseLinearBias
from ernie_ir.passes.infra.rewrite import RuleSet

HIDDEN = 16


def build_ours(blocks: int) -> Any:
    b = GraphBuilder("bench")
    x = b.input("x", tensor(f32, "B", HIDDEN))
    for i in range(blocks):
        w = b.param(f"l{i}.weight", tensor(f32, HIDDEN, HIDDEN))
        bias = b.param(f"l{i}.bias", tensor(f32, HIDDEN))
        with b.scope(f"l{i}"):
            x = b.silu(b.add(b.linear(x, w), bias))
    b.output(x, name="y")
    return b.graph


def build_onnx(blocks: int) -> Any:
    import onnx_ir as ir

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["B", HIDDEN]))
    nodes = []
    inits = []
    cur = x
    w_data = np.zeros((HIDDEN, HIDDEN), np.float32)
    b_data = np.zeros((HIDDEN,), np.float32)
    for i in range(blocks):
        w = ir.Value(name=f"l{i}.weight", type=ir.TensorType(ir.DataType.FLOAT),
                     shape=ir.Shape([HIDDEN, HIDDEN]), const_value=ir.tensor(w_data))
        bias = ir.Value(name=f"l{i}.bias", type=ir.TensorType(ir.DataType.FLOAT),
                        shape=ir.Shape([HIDDEN]), const_value=ir.tensor(b_data))
        inits += [w, bias]
        mm = ir.Node("", "MatMul", [cur, w], name=f"l{i}.mm")
        add = ir.Node("", "Add", [mm.outputs[0], bias], name=f"l{i}.add")
        act = ir.Node("", "Sigmoid", [add.outputs[0]], name=f"l{i}.act")
        nodes += [mm, add, act]
        cur = act.outputs[0]
    cur.name = "y"
    graph = ir.Graph([x], [cur], nodes=nodes, initializers=inits, opset_imports={"": 21, "bench": 1})
    return ir.Model(graph, ir_version=10)


def onnx_rule() -> Any:
    from onnxscript.rewriter import pattern

    def target(op: Any, x: Any, w: Any, b: Any) -> Any:
        return op.Add(op.MatMul(x, w), b)

    def condition(context: Any, x: Any, w: Any, b: Any, **_: Any) -> bool:
        return b.const_value is not None and len(b.shape) == 1 and b.shape[0] == w.shape[1]

    def replacement(op: Any, x: Any, w: Any, b: Any, **_: Any) -> Any:
        return op.LinearBias(x, w, b, _domain="bench")

    return pattern.RewriteRule(target, replacement, condition)


def best_of(repeat: int, setup: Any, fn: Any) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        obj = setup()
        gc.collect()
        t0 = time.process_time()
        result = fn(obj)
        best = min(best, time.process_time() - t0)
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=60_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    blocks = args.nodes // 3

    rules = RuleSet([FuseLinearBias()])
    t_ours, n_ours = best_of(args.repeat, lambda: build_ours(blocks), rules.apply)
    g = build_ours(blocks)
    rules.apply(g)
    verify(g)
    assert len(g) == 2 * blocks and n_ours == blocks, (len(g), n_ours)

    print(f"graph: {3 * blocks} nodes, {blocks} rewrites each (best of {args.repeat}, CPU seconds)")
    print(f"{'tool':<36}{'seconds':>10}{'us/node':>10}")
    print(f"{'ernie-ir RuleSet.apply':<36}{t_ours:>10.3f}{t_ours / (3 * blocks) * 1e6:>10.2f}")
    try:
        from onnxscript.rewriter import pattern
    except ImportError:
        print("onnxscript is not installed (pip install onnxscript): no ratio")
        raise SystemExit(1) from None
    rule_set = pattern.RewriteRuleSet([onnx_rule()])
    t_onnx, n_onnx = best_of(args.repeat, lambda: build_onnx(blocks), rule_set.apply_to_model)
    assert n_onnx == blocks, n_onnx
    print(f"{'onnxscript RewriteRuleSet.apply':<36}{t_onnx:>10.3f}{t_onnx / (3 * blocks) * 1e6:>10.2f}")
    print(f"ernie-ir / onnxscript time = {t_ours / t_onnx:.2f}x (goal <= 1.0x)")


if __name__ == "__main__":
    main()
