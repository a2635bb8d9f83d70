"""Every fusion rule says why it did not match, through the tracer and `ernie-ir explain`.

The rules match by walking the dataflow from an attention (or a mul for gate/up); each step that
holds counts towards the best partial match, and the first step that fails gives the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
from _fusion_testkit import explain, parallel_block, tiny

from ernie_ir.ir import Graph, GraphBuilder, f32, tensor
from ernie_ir.ir.weights import ArraySource
from ernie_ir.passes import run_pipeline


def scaled_norm() -> Graph:
    """rms_norm(x) * x: a mul that is no gated FFN."""
    b = GraphBuilder("scaled")
    x = b.input("x", tensor(f32, "B", 8))
    y = b.mul(b.rms_norm(x, b.param("w", source=ArraySource(np.ones(8, np.float32))), eps=1e-6), x)
    b.output(y, name="y")
    return b.graph


RULES = ["fuse-parallel-block", "unfuse-parallel-block", "fuse-qkv", "unfuse-qkv", "fuse-gate-up",
         "unfuse-gate-up"]

REFUSALS = [
    ("fuse-qkv", lambda: tiny("ernie-4.5-0.3b"), "q is a column piece of a split: q, k and v are one fused"),
    ("fuse-qkv", lambda: tiny("gpt-345m"), "per-head split: q, k and v are one fused projection already"),
    ("unfuse-qkv", lambda: tiny("ernie-3.5-se-3b"), "parallel block): use unfuse-parallel-block"),
    ("unfuse-gate-up", lambda: tiny("ernie-3.5-se-3b"), "parallel block): use unfuse-parallel-block"),
    ("fuse-parallel-block", lambda: tiny("ernie-4.5-0.3b", "unfuse-qkv,unfuse-gate-up"),
     "no gated FFN (act(gate(x)) * up(x)) reads the attention's input"),
    ("fuse-parallel-block", lambda: parallel_block(kv_heads=2), "need as many kv heads as heads"),
    ("unfuse-parallel-block", lambda: tiny("ernie-4.5-0.3b"), "not ERNIE-3.5-SE's per-head layout"),
    ("unfuse-parallel-block", lambda: tiny("gpt-345m"), "not a parallel block (use unfuse-qkv)"),
    ("fuse-gate-up", lambda: tiny("ernie-4.5-0.3b"), "comes from split"),
    ("fuse-gate-up", lambda: scaled_norm(), "neither input of the mul is silu or gelu"),
]


@pytest.mark.parametrize(("rule", "graph", "reason"), REFUSALS, ids=[f"{r}-{i}" for i, (r, _, _) in
                                                                       enumerate(REFUSALS)])
def test_refusals_name_the_failing_step(rule: str, graph, reason: str) -> None:  # type: ignore[no-untyped-def]
    trace = explain(rule, graph())
    assert trace.matches == 0 and trace.candidates > 0
    assert trace.best is not None and reason in trace.best.reason, trace.summary()


def test_best_partial_match_goes_deepest() -> None:
    graph = tiny("ernie-3.5-se-3b", "unfuse-parallel-block,quant-annotate{preset=wint8},weight-only-quant")
    trace = explain("fuse-parallel-block", graph)
    assert trace.best.matched == trace.best.total - 1  # everything held but the row fusion's scales
    assert trace.best.node.scope in ("ernie.layers.1.self_attn", "ernie.layers.2.self_attn")
    q_only = explain("fuse-qkv", graph)
    assert q_only.matches == 3  # the same graph's q/k/v still fuse


def test_matches_are_listed() -> None:
    graph = tiny("ernie-3.5-se-3b")
    assert explain("unfuse-parallel-block", graph).matches == 2
    assert explain("fuse-qkv", graph).matches == 1 and explain("fuse-gate-up", graph).matches == 1
    run_pipeline(graph, "unfuse-parallel-block")
    assert explain("fuse-parallel-block", graph).matches == 2


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from ernie_ir.cli import common
    from ernie_ir.cli.app import main

    saved = common.out._width
    common.out._width = 240  # rich lays tables out at 80 columns in process
    capsys.readouterr()
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    finally:
        common.out._width = saved
    return code, capsys.readouterr().out


def test_explain_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = cli(capsys, "explain", "fuse-parallel-block", "ernie-3.5-se-3b@tiny")
    assert code == 0 and "fuse-parallel-block: 0 match(es) among 3 candidate node(s)" in out
    code, out = cli(capsys, "explain", "fuse-parallel-block", "ernie-3.5-se-3b@tiny",
                    "--pipeline", "unfuse-parallel-block")
    assert code == 0 and "2 match(es)" in out and "match: attention at ernie.layers.1.self_attn" in out


def test_passes_and_the_o2_preset_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = cli(capsys, "passes")
    assert code == 0
    for name in RULES:
        assert name in out
    assert "O2" in out and "fuse-parallel-block,fuse-qkv,fuse-gate-up" in out
