"""IR at scale: build, verify, print, parse and walk a 60,000-node graph.

Reports microseconds per node for each step and, as the figure that matters
on a noisy machine, the ratio of (print + parse) to (json.dumps + json.loads)
of the same graph as plain dicts, measured in the same run.

    python benchmarks/ir_scale.py [--nodes 60000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from typing import Any

import ernie_ir  # noqa: F401  (registers the op set)
from ernie_ir.ir import GraphBuilder, bf16, i64, tensor
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.verifier import verify

NODES_PER_LAYER = 15


def build(nodes: int) -> Any:
    """A decoder-like graph: embedding, then layers of 15 nodes each."""
    hidden, heads, head_dim, inter, vocab = 64, 4, 16, 128, 256
    b = GraphBuilder("scale")
    ids = b.input("input_ids", tensor(i64, "B", "S"))
    emb = b.param("embed.weight", tensor(bf16, vocab, hidden))
    with b.scope("embed"):
        x = b.embedding(ids, emb)
    layer = 0
    while len(b.graph) + NODES_PER_LAYER + 2 <= nodes:
        p = f"layers.{layer}"
        with b.scope(p):
            ln = b.param(f"{p}.ln.weight", tensor(bf16, hidden))
            wq = b.param(f"{p}.qkv.weight", tensor(bf16, hidden, 3 * hidden))
            wo = b.param(f"{p}.o.weight", tensor(bf16, hidden, hidden))
            wug = b.param(f"{p}.up_gate.weight", tensor(bf16, hidden, 2 * inter))
            wd = b.param(f"{p}.down.weight", tensor(bf16, inter, hidden))
            h = b.rms_norm(x, ln, eps=1e-5)
            with b.scope("self_attn"):
                qkv = b.linear(h, wq)
                q, k, v = b.split(qkv, axis=-1, sizes=(hidden, hidden, hidden))
                q = b.rope(b.reshape(q, shape=(0, 0, heads, head_dim)), theta=500000.0)
                k = b.rope(b.reshape(k, shape=(0, 0, heads, head_dim)), theta=500000.0)
                v = b.reshape(v, shape=(0, 0, heads, head_dim))
                a = b.reshape(b.attention(q, k, v), shape=(0, 0, hidden))
                x = b.add(x, b.linear(a, wo))
            with b.scope("mlp"):
                gate, up = b.split(b.linear(x, wug), axis=-1, sizes=(inter, inter))
                x = b.add(x, b.linear(b.mul(b.silu(gate), up), wd))
        layer += 1
    head = b.param("lm_head.weight", tensor(bf16, hidden, vocab))
    with b.scope("lm_head"):
        logits = b.lm_head(x, head)
    b.output(logits, name="logits")
    return b.graph


def as_dicts(graph: Any) -> dict[str, Any]:
    """The same graph as plain JSON-able dicts (the peer representation)."""
    names: dict[Any, str] = {v: v.name for v in graph.inputs}
    names.update({p: "@" + p.name for p in graph.params.values()})
    nodes = []
    for n in graph:
        outs = []
        for v in n.outputs:
            names[v] = f"%{len(names)}"
            outs.append(names[v])
        nodes.append({
            "op": n.op,
            "inputs": [names[v] if v is not None else None for v in n.inputs],
            "outputs": outs,
            "attrs": {k: (v.value if hasattr(v, "value") else v) for k, v in n.attrs.__dict__.items()},
            "types": [[str(v.type.dtype), list(v.type.shape)] for v in n.outputs],
            "scope": n.scope,
        })
    return {
        "name": graph.name,
        "inputs": [[v.name, str(v.type)] for v in graph.inputs],
        "params": [[p.name, str(p.type.dtype), list(p.type.shape)] for p in graph.params.values()],
        "nodes": nodes,
        "outputs": [names[v] for v in graph.outputs],
    }


def walk(graph: Any) -> int:
    """Touch every node, input and output (what an analysis pass does at least)."""
    count = 0
    for n in graph:
        for v in n.inputs:
            if v is not None:
                count += 1
        for v in n.outputs:
            count += v.num_uses()
    return count


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=60_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    t_build, g = timed(lambda: build(args.nodes), args.repeat)
    n = len(g)
    t_verify, _ = timed(lambda: verify(g), args.repeat)
    t_print, text = timed(lambda: print_graph(g), args.repeat)
    t_parse, g2 = timed(lambda: parse_graph(text, check_types=False), args.repeat)
    t_parse_checked, _ = timed(lambda: parse_graph(text), args.repeat)
    t_walk, _ = timed(lambda: walk(g), args.repeat)
    assert print_graph(g2) == text, "round trip changed the text"
    d = as_dicts(g)
    t_dumps, js = timed(lambda: json.dumps(d), args.repeat)
    t_loads, _ = timed(lambda: json.loads(js), args.repeat)

    us = 1e6 / n
    print(f"graph: {n} nodes, {len(g.params)} params; text {len(text) / 1e6:.1f} MB, "
          f"json {len(js) / 1e6:.1f} MB")
    print(f"{'step':<28}{'total ms':>10}{'us/node':>10}")
    for name, t in [("build (GraphBuilder)", t_build), ("verify", t_verify), ("print", t_print),
                    ("parse", t_parse), ("parse + type check", t_parse_checked),
                    ("walk", t_walk), ("json.dumps (peer)", t_dumps), ("json.loads (peer)", t_loads)]:
        print(f"{name:<28}{t * 1e3:>10.1f}{t * us:>10.2f}")
    ratio = (t_print + t_parse) / (t_dumps + t_loads)
    ratio_checked = (t_print + t_parse_checked) / (t_dumps + t_loads)
    print(f"(print + parse) / (json.dumps + json.loads) = {ratio:.2f}x "
          f"(with type checking while parsing: {ratio_checked:.2f}x; goal <= 3x)")


if __name__ == "__main__":
    main()
