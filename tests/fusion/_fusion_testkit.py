"""Shared helpers of the fusion tests (imported as a plain module: tests/fusion has no package).

- `tiny(name, pipeline)`: a built-in @tiny model after a pipeline, LoRA B params random
  (the lora pass starts B at zero, which would leave every adapter untested).
- `logits(graph)` / `rel(a, b)`: the interpreter's logits and max-abs error relative to max |b|.
- `parallel_block(...)`: an unfused parallel attention + FFN block written with the GraphBuilder
  (layer_norm -> q/k/v/gate/up -> attention, silu(gate) * up -> o_proj + down_proj -> residual).
- `UNFUSE` / `FUSE`: every unfusion, and every fusion (the fusions of O2).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_ir.ir import Graph, GraphBuilder, f32, tensor
from ernie_ir.ir.weights import ArraySource
from ernie_ir.load import load_input
from ernie_ir.passes import run_pipeline
from ernie_ir.runtime import Interpreter, run_graph
from ernie_ir.testing.models import randomize_lora_b

FAMILIES = ("ernie-4.5-0.3b", "ernie-4.5-21b-a3b", "ernie-4.5-300b-a47b", "ernie-3.5-se-3b", "gpt-345m")
IDS = np.array([[1, 5, 900, 77, 3, 1000, 42, 7]], dtype=np.int64)
UNFUSE = "unfuse-parallel-block,unfuse-qkv,unfuse-gate-up"
FUSE = "fuse-parallel-block,fuse-qkv,fuse-gate-up"
WINT8MIX = "quant-annotate{preset=wint8mix},weight-only-quant"
VARIANTS = {"float": "", "wint8mix": WINT8MIX, "lora": "lora{rank=4}",
            "wint8mix+lora": WINT8MIX + ",lora{rank=4}"}


def tiny(name: str, pipeline: str = "") -> Graph:
    graph = load_input(f"{name}@tiny")
    if pipeline:
        run_pipeline(graph, pipeline, evaluator=Interpreter)  # fp8 calibrates with it
    randomize_lora_b(graph)
    return graph


def logits(graph: Graph, ids: np.ndarray = IDS) -> np.ndarray:
    name = graph.inputs[0].name
    out = run_graph(graph, {name: ids})
    return out[graph.output_names[0]]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / max(float(np.abs(b).max()), 1e-30))


def ops(graph: Graph) -> list[str]:
    return [n.op for n in graph]


def parallel_block(*, hidden: int = 32, heads: int = 4, inter: int = 48, bias: bool = True,
                   kv_heads: int | None = None, residual_chain: bool = False, seed: int = 0,
                   dtype: Any = np.float32) -> Graph:
    """One unfused parallel block on input x [B, S, hidden]:

        n = layer_norm(x);  a = o(attention(rope(q(n)), rope(k(n)), v(n)));  f = down(silu(gate(n)) * up(n))
        y = x + (a + f)             (residual_chain: (x + a) + f)
    """
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    kv = kv_heads or heads

    def w(*shape: int) -> ArraySource:
        return ArraySource((rng.standard_normal(shape) * 0.2).astype(dtype))

    b = GraphBuilder("parallel_block")
    x = b.input("x", tensor(f32, "B", "S", hidden))
    with b.scope("block"):
        with b.scope("input_layernorm"):
            n = b.layer_norm(x, b.param("block.input_layernorm.weight", source=w(hidden)),
                             b.param("block.input_layernorm.bias", source=w(hidden)), eps=1e-6)

        def lin(v: Any, module: str, n_in: int, n_out: int, with_bias: bool) -> Any:
            with b.at_scope(f"block.{module}"):  # a linear's scope is its module, as frontends write it
                wt = b.param(f"block.{module}.weight", source=w(n_in, n_out))
                if with_bias:
                    return b.linear(v, wt, b.param(f"block.{module}.bias", source=w(n_out)))
                return b.linear(v, wt)

        with b.scope("self_attn"):
            q, k, v = (b.reshape(lin(n, f"self_attn.{p}_proj", hidden, nh * hd, bias), shape=(0, 0, nh, hd))
                       for p, nh in (("q", heads), ("k", kv), ("v", kv)))
            q, k = b.rope(q, theta=10000.0, style="half"), b.rope(k, theta=10000.0, style="half")
            a = b.reshape(b.attention(q, k, v, causal=True), shape=(0, 0, hidden))
            o = lin(a, "self_attn.o_proj", hidden, hidden, bias)
        with b.scope("mlp"):
            f = b.mul(b.silu(lin(n, "mlp.gate_proj", hidden, inter, bias)),
                      lin(n, "mlp.up_proj", hidden, inter, bias))
            d = lin(f, "mlp.down_proj", inter, hidden, False)
        y = b.add(b.add(x, o), d) if residual_chain else b.add(x, b.add(o, d))
    b.output(y, name="y")
    return b.graph


def block_inputs(hidden: int = 32, seed: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((2, 5, hidden)).astype(np.float32)}


def run_block(graph: Graph, inputs: dict[str, np.ndarray] | None = None) -> np.ndarray:
    hidden = graph.inputs[0].type.shape[-1]
    assert isinstance(hidden, int)
    return run_graph(graph, inputs or block_inputs(hidden))["y"]


def explain(rule: str, graph: Graph) -> Any:
    """The tracer's report for `rule` (a registered pass's rule) on `graph`."""
    from ernie_ir.passes import all_passes
    from ernie_ir.passes.infra.rewrite import RuleSet, find_rule

    (trace,) = RuleSet([find_rule(rule, all_passes())]).explain(graph)
    return trace


def rewrites(result: Any, name: str) -> int:
    """How many times pass `name` rewrote in a pipeline result (0 when it never matched)."""
    return sum(n for key, counts in result.stats.items() if key.split(":", 1)[1] == name
               for n in counts.values())
