"""clone_graph: an independent copy to rewrite, reading the original's weights (no byte copied)."""

from __future__ import annotations

import numpy as np

from ernie_ir.ir.equality import structural_diff
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.storage import clone_graph
from ernie_ir.load import load_input
from ernie_ir.passes.decoding.kv_cache import add_kv_cache
from ernie_ir.runtime.interpreter import run_graph

IDS = np.array([[1, 2, 3, 400, 5]])


def test_clone_is_equal_and_shares_the_weights() -> None:
    graph = load_input("ernie-4.5-0.3b@tiny")
    copy = clone_graph(graph)
    assert copy is not graph and structural_diff(graph, copy) is None
    assert print_graph(copy) == print_graph(graph)
    assert copy.metadata == graph.metadata and copy.metadata is not graph.metadata
    assert copy.metadata["config"] is not graph.metadata["config"]  # a deep copy
    for name, p in graph.params.items():
        q = copy.params[name]
        assert q is not p and q.source is p.source and q.type == p.type
    np.testing.assert_array_equal(run_graph(copy, {"input_ids": IDS})["logits"],
                                  run_graph(graph, {"input_ids": IDS})["logits"])


def test_rewriting_the_clone_leaves_the_original_as_it_was() -> None:
    graph = load_input("gpt-345m@tiny")
    before = print_graph(graph)
    meta = dict(graph.metadata)
    copy = clone_graph(graph)
    add_kv_cache(copy)
    copy.metadata["config"]["vocab_size"] = -1
    assert print_graph(graph) == before and graph.metadata.keys() == meta.keys()
    assert "kv_cache" not in graph.metadata and graph.metadata["config"]["vocab_size"] == 1024
    assert [v.name for v in graph.inputs] == ["input_ids"] and graph.output_names == ["logits"]
    assert "attention_mask" in [v.name for v in copy.inputs]
    run_graph(graph, {"input_ids": IDS})  # still the whole-sequence graph
