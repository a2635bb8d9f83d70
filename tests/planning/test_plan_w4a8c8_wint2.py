"""`plan --quant w4a8c8` and `--quant wint2` (issue 28) reproduce FastDeploy's published minimum
device counts for ERNIE-4.5-300B-A47B (REFERENCE.md sections 13 and 14): WINT2 on 2 x 80 GB and on
one 141 GB card, W4A8 on 4 x 80 GB (and 4 x 64 GB). The plan reads the param types the two passes
give the full-size @meta graph; the bytes per parameter of the experts are checked here against
the formats' layouts computed from the config's shapes alone.

Planned with FastDeploy's engine defaults and `--max-model-len 32768` (its launch examples), as
docs/planning.md section 7's table.
"""

from __future__ import annotations

import json

import pytest
from _cli_kit import cli

from ernie_ir.frontends import load_model
from ernie_ir.ir import Graph
from ernie_ir.passes import run_pipeline
from ernie_ir.planning import PlanRequest, plan_memory
from ernie_ir.targets import CompileOptions

MODEL = "ernie-4.5-300b-a47b"
GiB = 1024 ** 3
HIDDEN, MOE_INTER, EXPERTS, LAYERS, KV_HEADS, HEAD_DIM = 8192, 3584, 64, 54, 8, 128
MOE_LAYERS = range(3, 54)  # moe_layer_start_index 3 .. end 53
W2_LAYERS = range(7, 54)  # FastDeploy's moe_w2_quant_config: layers 7-53 (0-6 wint4)
STACKS = {"up_gate_proj": (HIDDEN, 2 * MOE_INTER), "down_proj": (MOE_INTER, HIDDEN)}  # (K, N) per expert


def _plan(quant: str, memory: str | int):
    return plan_memory(MODEL, "cuda", CompileOptions(quant=quant),
                       PlanRequest(seq_len=32768, device_memory=memory))


@pytest.mark.slow
def test_wint2_needs_2_devices_of_80gib() -> None:
    plan = _plan("wint2", "80GiB")
    assert plan.min_devices == 2 and (plan.tp, plan.ep) == (2, 1) and plan.fits
    one = [t for t in plan.search if t.devices == 1]
    assert len(one) == 1 and not one[0].fits and one[0].max_rank_bytes > 72 * GiB  # 97.26 GiB
    r = plan.per_rank[0]
    assert r.by_category["weights"] == pytest.approx(43.07 * GiB, abs=0.01 * GiB)
    # a bf16 cache: 54 layers x K and V x 64 tokens x 8 / 2 KV heads x 128 x 2 bytes
    assert r.kv_detail["block_bytes"] == LAYERS * 2 * 64 * (KV_HEADS // 2) * HEAD_DIM * 2
    assert r.kv_detail["blocks"] >= r.kv_detail["blocks_needed"] == 514


@pytest.mark.slow
@pytest.mark.parametrize("memory", ["141GiB", 141 * 10 ** 9])
def test_wint2_fits_one_141gb_device(memory: str | int) -> None:
    """One H20 141 GB (read as GiB, or as 10^9 bytes: 131.3 GiB, 118.2 usable): the whole model,
    97.26 GiB with the 32K sequence's KV blocks."""
    plan = _plan("wint2", memory)
    assert plan.min_devices == 1 and plan.fits
    r = plan.per_rank[0]
    assert plan.max_rank_bytes == pytest.approx(97.26 * GiB, abs=0.01 * GiB)
    assert r.by_category["weights"] == pytest.approx(85.80 * GiB, abs=0.01 * GiB)


@pytest.mark.slow
@pytest.mark.parametrize("memory", ["80GiB", "64GiB"])
def test_w4a8c8_needs_4_devices(memory: str) -> None:
    """FastDeploy's W4A8C8 checkpoint is TP4-only; the planner reaches 4 by memory: every
    2-device layout needs over 77 GiB per rank."""
    plan = _plan("w4a8c8", memory)
    assert plan.min_devices == 4 and (plan.tp, plan.ep) == (4, 1) and plan.fits
    two = [t for t in plan.search if t.devices == 2]
    assert len(two) == 3 and all(not t.fits and t.max_rank_bytes > 77 * GiB for t in two)
    r = plan.per_rank[0]
    assert r.by_category["weights"] == pytest.approx(36.42 * GiB, abs=0.01 * GiB)
    # C8: the cache is u8, one byte per element (8 / 4 KV heads per rank)
    assert r.kv_detail["block_bytes"] == LAYERS * 2 * 64 * (KV_HEADS // 4) * HEAD_DIM * 1


@pytest.mark.slow
def test_the_cli_answers_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "plan", MODEL, "--target", "cuda", "--quant", "wint2{w4_end_layer=6}",
                         "--max-model-len", "32768", "--device-memory", "80GiB", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["quant"] == "wint2" and data["min_devices"] == 2
    assert data["pipeline"].startswith("wint2{w4_end_layer=6},quant-annotate{preset=wint8mix}")


def _meta(pipeline: str) -> Graph:
    g = load_model(f"{MODEL}@meta")
    run_pipeline(g, pipeline)
    return g


def _stack_bytes(g: Graph, layer: int, stack: str) -> int:
    prefix = f"ernie.layers.{layer}.mlp.experts.{stack}."
    params = [p for name, p in g.params.items() if name.startswith(prefix)]
    assert params and all(p.source is None for p in params)  # @meta: typed params, no data
    total = 0
    for p in params:
        n = 1
        for d in p.type.shape:
            n *= d
        total += n * p.type.dtype.bits  # bits, packed sub-byte types counted as their bits
    return total // 8


def test_w4a8_experts_take_half_a_byte_per_parameter_and_a_bit() -> None:
    """Per expert and projection: int4 weights (K x N / 2 bytes), bf16 weight scales [N], one f32
    input scale: 0.5 + (2 N + 4) / (K N) bytes per parameter."""
    g = _meta("w4a8c8")
    for layer in (3, 30, 53):
        for stack, (k, n) in STACKS.items():
            got = _stack_bytes(g, layer, stack) / (EXPERTS * k * n)
            assert got == pytest.approx(0.5 + (2 * n + 4) / (k * n), rel=1e-12)
            assert 0.5 < got < 0.501
    # the KV cache scales of C8 (f32 per KV channel) are all the attention gains
    assert sum(1 for n in g.params if n.endswith("cachek_matmul.activation_scale")) == LAYERS


def test_wint2_layers_take_2_point_07_to_2_point_08_bits_per_parameter() -> None:
    """Per expert and projection: 8-bit codes per 4 rows (2 bits), 4-bit scales per 64 rows (1/16
    bit), bf16 super-scale and f32 code scale and zero point per column: 2 + 1/16 + 80 / K bits."""
    g = _meta("wint2")
    for layer in (7, 30, 53):
        for stack, (k, n) in STACKS.items():
            bits = 8 * _stack_bytes(g, layer, stack) / (EXPERTS * k * n)
            assert bits == pytest.approx(2 + 1 / 16 + 80 / k, rel=1e-12)
            assert 2.07 < bits < 2.09
    for layer in (3, 6):  # FastDeploy's w4 layers: float here, wint8mix's int4 in --quant wint2
        assert f"ernie.layers.{layer}.mlp.experts.up_gate_proj.weight" in g.params
    assert g.metadata["wint2"]["w2_layers"] == list(W2_LAYERS)


@pytest.mark.slow
def test_the_planned_u8_bytes_are_the_2_bit_experts() -> None:
    """At tp 1 every u8 byte of the plan is a 2-bit layer's codes or 4-bit scales (K/4 + K/128 rows
    of N bytes per expert), 63.6 GiB of the 85.8."""
    plan = plan_memory(MODEL, "cuda", CompileOptions(quant="wint2", tp=1), PlanRequest(engine="none"))
    want = len(W2_LAYERS) * EXPERTS * sum((k // 4 + k // 128) * n for k, n in STACKS.values())
    assert plan.per_rank[0].weights_by_dtype["u8"] == want
    assert want == pytest.approx(63.615 * GiB, abs=0.001 * GiB)
