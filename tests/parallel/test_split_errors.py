"""Layouts that cannot be built are refused with one line naming the numbers and what works.

Each error is a subclass of ErnieIRError (MappingError from `mapping_for` /
`Mapping.create`, SplitError from the cut itself).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _parallel_testkit import build, tiny

from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.mapping import Mapping, MappingError
from ernie_ir.load import load_input
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.parallel.split import SplitError, mapping_for, split_graph
from ernie_ir.runtime import Interpreter


def refused(kind: type[ErnieIRError], fn, *needles: str) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(ErnieIRError) as info:
        fn()
    e = info.value
    assert isinstance(e, kind) and type(e) is not ErnieIRError, type(e)
    msg = str(e)
    assert msg and "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def split(graph, tp: int = 1, ep: int = 1):  # type: ignore[no-untyped-def]
    return lambda: split_graph(graph, mapping_for(graph, tp, ep))


def test_indivisible_vocabulary():
    graph = build("ernie-4.5-0.3b", vocab_size=1022)
    refused(MappingError, split(graph, 4), "--tp 4", "1022 rows", "layouts that work: --tp 1, --tp 2")
    split_graph(graph, mapping_for(graph, 2))  # 1022 = 2 * 511: fine


FIVE_HEADS = {"num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 16}  # 21B-A3B@tiny had 5


def test_indivisible_heads():
    graph = build("ernie-4.5-21b-a3b", **FIVE_HEADS)
    refused(SplitError, split(graph, 2), "5 heads", "tp 2", "layouts that work: --tp 1")
    graph = load_input("gpt-345m@tiny")  # 4 heads
    refused(SplitError, split(graph, 8), "4 heads", "tp 8", "layouts that work: --tp 1, --tp 2, --tp 4")
    # ERNIE-3.5-SE's parallel layers fuse [QKV | gate | up]: the attention part is cut in heads too
    graph = load_input("ernie-3.5-se-3b@tiny")
    refused(SplitError, split(graph, 8), "4 heads", "layouts that work: --tp 1, --tp 2, --tp 4")


def test_kv_heads_neither_dividing_nor_divided():
    graph = build("ernie-4.5-0.3b", num_attention_heads=12, num_key_value_heads=3)
    refused(SplitError, split(graph, 2), "3 heads", "tp 2", "a multiple of 3")
    graph = build("ernie-4.5-0.3b", num_attention_heads=12, num_key_value_heads=3, vocab_size=1020)
    split_graph(graph, mapping_for(graph, 6))  # KV replicated in pairs: fine (tp % nkv == 0)


def test_indivisible_intermediate_size():
    graph = build("ernie-4.5-0.3b", intermediate_size=194)
    refused(SplitError, split(graph, 4), "194 columns", "tp 4", "layouts that work: --tp 1, --tp 2",
            "ernie.layers.0.mlp.up_gate_proj")


def test_indivisible_expert_intermediate_size():
    graph = build("ernie-4.5-300b-a47b", moe_intermediate_size=30)
    refused(SplitError, split(graph, 4), "expert intermediate size 30", "4 parts", "--ep 4")
    split_graph(graph, mapping_for(graph, 4, 4))  # whole experts: fine


@pytest.mark.parametrize("ep", [3, 32])
def test_indivisible_experts(ep: int):
    graph = load_input("ernie-4.5-300b-a47b@tiny")  # 16 routed experts
    refused(MappingError, split(graph, 1, ep), f"--ep {ep}", "16 routed experts",
            "use --ep in [1, 2, 4, 8, 16]")


# (3, 2) regressed once: the suggestions ignored the expert count (--tp 1 --ep 3 on 16 experts)
@pytest.mark.parametrize("tp, ep", [(2, 4), (2, 8), (3, 2)])
def test_unsupported_layout(tp: int, ep: int):
    graph = build("ernie-4.5-300b-a47b", vocab_size=1536)  # divisible by 2, 3, 4, 8: the layout is refused
    world = max(tp, ep)
    msg = refused(MappingError, split(graph, tp, ep), f"--tp {tp} --ep {ep}", "unsupported layout",
                  f"world {world}", f"--tp {world} --ep 1")
    assert (f"--tp 1 --ep {world}" in msg) == (16 % world == 0)  # only layouts the experts allow
    for suggestion in re.findall(r"--tp (\d+) --ep (\d+)", msg.split("use one of", 1)[1]):
        Mapping.create(*map(int, suggestion), num_experts=16)  # every suggested layout builds


def test_expert_parallel_on_a_dense_model():
    for name in ("ernie-4.5-0.3b", "gpt-345m", "ernie-3.5-se-3b"):
        graph = load_input(f"{name}@tiny")
        refused(MappingError, split(graph, 1, 2), "--ep 2", "no routed experts", "use --ep 1")
        refused(MappingError, lambda g=graph: run_pipeline(g, "split{ep=2}"), "no routed experts")
        refused(MappingError, split(graph, 2, 2), "--ep 2", "no routed experts")


def test_degrees_below_one():
    graph = load_input("ernie-4.5-0.3b@tiny")
    refused(MappingError, split(graph, 0), "--tp 0", ">= 1")
    refused(MappingError, lambda: Mapping.create(1, 0), "--ep 0", ">= 1")


def test_splitting_a_split_graph():
    graph = load_input("ernie-4.5-0.3b@tiny")
    ranks = split_graph(graph, mapping_for(graph, 2))
    refused(SplitError, split(ranks[1], 2), "all_reduce", "already split")
    refused(SplitError, lambda: run_pipeline(ranks[0], "split{tp=2}"), "already split")
    g = load_input("ernie-4.5-21b-a3b@tiny")
    refused(SplitError, lambda: run_pipeline(g, "split{ep=2},split{ep=4}"), "already split")


@pytest.mark.parametrize("pipeline, op", [("qat-int8", "pact"), ("fp8", "fp8_linear")])
def test_single_rank_only_quantization(pipeline: str, op: str):
    graph = load_input("ernie-4.5-0.3b@tiny")
    run_pipeline(graph, pipeline, evaluator=Interpreter)  # fp8 calibrates with it
    refused(SplitError, split(graph, 2), op, "one rank")


def test_group_wise_scales_must_cover_whole_groups(tmp_path: Path):
    cfg = tmp_path / "g64.yaml"
    cfg.write_text("rules:\n  - match: '.*'\n    algo: weight_only_int8\n    group_size: 64\n")
    graph = load_input("ernie-4.5-0.3b@tiny")  # down_proj rows 192: 96 per rank at tp=2
    run_pipeline(graph, f"quant-annotate{{config={cfg}}},weight-only-quant")
    refused(SplitError, split(graph, 2), "ernie.layers.0.mlp.down_proj", "[(0, 96)]",
            "groups of 64", "group_size -1")


# -- bugs found while writing these tests (fixed; kept as regression tests) ---------------------


def _listed_tp(msg: str) -> list[int]:
    listed = msg.split("layouts that work: ", 1)
    assert len(listed) == 2, msg
    return [int(x) for x in re.findall(r"--tp (\d+)", listed[1])]


def test_suggested_tp_degrees_work_tiny():
    graph = build("ernie-4.5-21b-a3b", **FIVE_HEADS)
    msg = refused(SplitError, split(graph, 2), "5 heads")
    for tp in _listed_tp(msg):
        split_graph(graph, mapping_for(graph, tp, 1))


def test_suggested_tp_degrees_work_published_21b():
    graph = load_input("ernie-4.5-21b-a3b@meta")
    msg = refused(SplitError, split(graph, 8), "20 heads")
    for tp in _listed_tp(msg):
        split_graph(graph, mapping_for(graph, tp, 1))


def test_group_wise_experts_split_whole_by_ep(tmp_path: Path):
    cfg = tmp_path / "g64.yaml"
    cfg.write_text("rules:\n  - match: '.*experts.*'\n    algo: weight_only_int8\n    group_size: 64\n")
    graph = tiny("ernie-4.5-300b-a47b")  # expert intermediate 32 < 64: one partial group per expert
    run_pipeline(graph, f"quant-annotate{{config={cfg}}},weight-only-quant")
    split_graph(graph, mapping_for(graph, 1, 2))  # whole experts per rank: nothing to cut along rows


def test_quantizing_row_parallel_weights_after_the_split():
    graph = load_input("ernie-4.5-0.3b@tiny")
    refused(ErnieIRError, lambda: run_pipeline(graph, "split{tp=2},wint8"), "after split",
            "ernie.layers.0.self_attn.o_proj.weight", "row-parallel", "before splitting")


@pytest.mark.parametrize("pipeline", ["split{tp=2},lora{rank=4}", "split{ep=2},lora{rank=4}"])
def test_lora_after_the_split(pipeline: str):
    graph = load_input("ernie-4.5-300b-a47b@tiny")
    refused(ErnieIRError, lambda: run_pipeline(graph, pipeline), "lora after split", "before splitting")
