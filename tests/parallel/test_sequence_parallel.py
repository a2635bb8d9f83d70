"""Sequence parallelism (`split{sp=true}`, `compile --sp`): exact against the unsplit graph.

With sp the residual stream and the norms hold rank r's contiguous shard of the flattened
B*S tokens; a row-parallel block's partial sum is reduce-scattered (its bias added after) and a
column-parallel block's input all-gathered (all_gather_sequence); a whole token-shaped value
(GPT's position embeddings, an embedding kept whole) is sliced (scatter_sequence). The SPMD
interpreter runs the rank graphs; their logits must equal the unsplit graph's (1e-5 relative,
the tolerance of the tp tests), and no all_reduce is left in a decoder layer.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _parallel_testkit import FAMILIES, rel_err, tiny, tp_fits

from ernie_ir.cli.app import main
from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.verifier import verify
from ernie_ir.passes.parallel.split import SplitError, mapping_for, split_graph
from ernie_ir.runtime.interpreter import Interpreter
from ernie_ir.runtime.spmd import run_spmd
from ernie_ir.targets import CompileOptions, compile_model

IDS = np.array([[1, 5, 900, 77, 3, 1000], [7, 8, 9, 10, 511, 512]], dtype=np.int64)  # 12 tokens
SP_OPS = ("all_reduce", "reduce_scatter", "all_gather_sequence", "scatter_sequence")


def _layouts(name: str) -> list[tuple[int, int]]:
    out = [(tp, 1) for tp in (2, 4) if tp_fits(name, tp)]
    if "a3b" in name or "a47b" in name:
        out.append((2, 2))
    return out


CASES = [(name, tp, ep) for name in FAMILIES for tp, ep in _layouts(name)]


@pytest.mark.parametrize(("name", "tp", "ep"), CASES)
def test_sp_logits_equal_unsplit(name: str, tp: int, ep: int) -> None:
    graph = tiny(name)
    ref = Interpreter(graph).run({"input_ids": IDS})["logits"]
    ranks = split_graph(graph, mapping_for(graph, tp, ep), sp=True)
    for r in ranks:
        verify(r)
    outs = run_spmd(ranks, {"input_ids": IDS})
    errs = [rel_err(o["logits"], ref) for o in outs]
    ops = Counter(n.op for n in ranks[0] if n.op in SP_OPS)
    print(f"[sp] {name} tp {tp} ep {ep}: {dict(ops)}, rel {max(errs):.2e}")
    assert max(errs) < 1e-5
    assert ops["all_reduce"] == 0 and ops["reduce_scatter"] >= 1
    assert ranks[0].metadata["parallel"]["sp"] is True
    for g in ranks:  # the norms run on the token shards
        norms = [n for n in g if n.op in ("rms_norm", "layer_norm")]
        assert norms and all(n.outputs[0].type.shape[0] == "Tsp" for n in norms)


@pytest.mark.parametrize(("name", "pipeline", "ep"), [
    ("ernie-4.5-0.3b", "lora{rank=4}", 1), ("ernie-4.5-0.3b", "wint8mix", 1),
    ("ernie-4.5-300b-a47b", "wint8mix,lora{rank=4}", 2)])
def test_sp_after_lora_and_quantization(name: str, pipeline: str, ep: int) -> None:
    graph = tiny(name, pipeline)
    ref = Interpreter(graph).run({"input_ids": IDS})["logits"]
    ranks = split_graph(graph, mapping_for(graph, 2, ep), sp=True)
    for r in ranks:
        verify(r)
    outs = run_spmd(ranks, {"input_ids": IDS})
    assert rel_err(outs[0]["logits"], ref) < 1e-5


def test_sp_with_a_replicated_head() -> None:
    """lm_head=replicate keeps a tied embedding whole: its output is sliced onto the shards."""
    graph = tiny("ernie-4.5-0.3b")
    ref = Interpreter(graph).run({"input_ids": IDS})["logits"]
    ranks = split_graph(graph, mapping_for(graph, 2, 1), lm_head="replicate", sp=True)
    assert rel_err(run_spmd(ranks, {"input_ids": IDS})[1]["logits"], ref) < 1e-5


def test_sp_needs_tp() -> None:
    graph = tiny("ernie-4.5-21b-a3b")
    with pytest.raises(SplitError, match="needs tp > 1"):
        split_graph(graph, mapping_for(graph, 1, 2), sp=True)
    with pytest.raises(ErnieIRError, match=r"--sp .* needs --tp 2 or more, got --tp 1"):
        compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(sp=True,
                      out=Path("/nonexistent/never-written")))


def test_sp_refuses_tokens_not_divisible_by_tp() -> None:
    graph = tiny("ernie-4.5-0.3b")
    ranks = split_graph(graph, mapping_for(graph, 2, 1), sp=True)
    with pytest.raises(ErnieIRError) as err:
        run_spmd(ranks, {"input_ids": IDS[:1, :5]})
    msg = str(err.value)
    assert "\n" not in msg and "5 tokens (batch x sequence) do not divide into tp 2" in msg


def test_compile_cli_sp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "art"
    with pytest.raises(SystemExit) as done:
        main(["compile", "ernie-4.5-0.3b@tiny", "--target", "cuda", "--tp", "2", "--sp", "--out", str(out),
              "--stop-after", "split"])
    assert done.value.code == 0, capsys.readouterr().err
    from ernie_ir.ir.storage import load_graph

    g = load_graph(out / "rank1")
    assert {n.op for n in g} >= {"reduce_scatter", "all_gather_sequence"}
    with pytest.raises(SystemExit) as done:
        main(["compile", "ernie-4.5-0.3b@tiny", "--target", "cuda", "--sp", "--out", str(tmp_path / "x")])
    assert done.value.code != 0
    assert "--sp" in capsys.readouterr().err
