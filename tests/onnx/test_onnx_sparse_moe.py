"""Sparse MoE in model.onnx: only the routed experts run, equal to the interpreter and the dense form.

Each MoE layer is one `If` per expert, taken only when the call routes a token to it (NonZero /
Gather rows, that expert's weights read from initializers of its own and dequantized there,
ScatterND add); checked in a bare
`onnxruntime.InferenceSession` for float, wint8, wint4, cuda-arch 70 packed and LoRA experts,
and a 64-expert variant of the tiny ERNIE 4.5 MoE (packed at the default sm80).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _moe_kit import CASES, EXPERTS64, IDS, moe_graph

from ernie_ir.backends.onnx.lower import dense_moe, emit_onnx
from ernie_ir.runtime.interpreter import run_graph


def bare_session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(str(path), options)


def logits_of(path: Path) -> np.ndarray:
    return bare_session(path).run(None, {"input_ids": IDS})[0]


def expert_branches(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The experts' Ifs (not the int8 linears' Ifs on the number of rows)."""
    return [n for n in model.graph.node if n.op_type == "If"
            and any(a.g.name.startswith("moe_expert") for a in n.attribute)]


def branch_ops(node: onnx.NodeProto, which: str = "then_branch") -> list[str]:
    attr = next(a for a in node.attribute if a.name == which)
    return [n.op_type for n in onnx.helper.get_attribute_value(attr).node]


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_onnx_equals_interpreter_and_dense(case: str, tmp_path: Path) -> None:
    g = moe_graph(CASES[case])
    experts = [n for n in g if n.op in ("moe_experts", "moe_experts_lora")]
    assert experts
    ref = run_graph(g, {"input_ids": IDS})["logits"]
    sparse, _ = emit_onnx(g, tmp_path / "sparse", numerics="exact")
    with dense_moe():
        dense, _ = emit_onnx(g, tmp_path / "dense", numerics="exact")
    got, got_dense = logits_of(sparse), logits_of(dense)
    tol = 1e-4 * float(np.abs(ref).max())
    assert np.abs(got - ref).max() <= tol
    assert np.abs(got - got_dense).max() <= tol
    model = onnx.load(str(sparse), load_external_data=False)
    branches = expert_branches(model)
    num_experts = experts[0].inputs[3].type.shape[0]
    assert len(branches) == num_experts * len(experts)  # one If per expert per MoE layer
    lora = "lora" in case
    for br in branches:  # taken: that expert's up_gate and down matmuls (+ its LoRA pairs); else: none
        ops = branch_ops(br)
        assert ops.count("MatMul") == (6 if lora else 2)
        assert {"NonZero", "Gather", "ScatterND"} <= set(ops)
        assert branch_ops(br, "else_branch") == ["Identity"]
    # no expert stack is dequantized or multiplied whole at the top level
    inits = {i.name: list(i.dims) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type in ("DequantizeLinear", "MatMul"):
            assert not any(len(inits.get(i, [])) == 3 for i in n.input), n
    if "wint" in case:  # each expert dequantized in its own branch, from its own initializers
        assert all(branch_ops(br).count("DequantizeLinear") == 2 for br in branches)
    dense_model = onnx.load(str(dense), load_external_data=False)
    assert not expert_branches(dense_model)


@pytest.mark.slow
def test_64_experts_packed_at_sm80_sparse(tmp_path: Path) -> None:
    g = moe_graph("wint8mix,legalize-cuda{cuda_arch=80}", **EXPERTS64)
    assert any(n.op == "unpack_weight" for n in g)  # the packed-expert path at the default sm80
    assert all(n.inputs[3].type.shape[0] == 64 for n in g if n.op == "moe_experts")
    ref = run_graph(g, {"input_ids": IDS})["logits"]
    path, _ = emit_onnx(g, tmp_path / "m", numerics="exact")
    got = logits_of(path)
    assert np.abs(got - ref).max() <= 1e-4 * float(np.abs(ref).max())


def test_int4_experts_keep_their_bytes_once(tmp_path: Path) -> None:
    g = moe_graph("wint4,legalize-cuda{cuda_arch=80}")
    path, data = emit_onnx(g, tmp_path / "m", numerics="exact")
    model = onnx.load(str(path), load_external_data=False)
    ends = [(int(e["offset"]), int(e["length"]))
            for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
            for e in [{x.key: x.value for x in t.external_data}]]
    assert sum(length for _, length in ends) <= data.stat().st_size  # nothing referenced twice
    assert len(set(ends)) == len(ends)
    views = [t for t in model.graph.initializer if "experts" in t.name and t.name.endswith("]")]
    assert views and any(t.data_type == onnx.TensorProto.INT4 for t in views)
    assert not [t for t in model.graph.initializer if len(t.dims) == 3 and ".mlp.experts." in t.name]


@pytest.mark.parametrize("case", ["wint8", "wint4", "wint8mix-sm70-packed", "wint8mix-lora"])
def test_fast_numerics_run_each_routed_expert_as_matmulnbits(case: str, tmp_path: Path) -> None:
    # fast numerics (int8 activations): an expert's matmuls are MatMulNBits in its branch, with
    # weights decoding to q * s of the expert alone; no expert is dequantized, nothing is stored twice
    from onnx import numpy_helper
    from test_onnx_numerics import FAST_TOL, _decode_nbits

    g = moe_graph(CASES[case])
    ref = run_graph(g, {"input_ids": IDS})["logits"]
    path, data = emit_onnx(g, tmp_path / "m", numerics="fast")
    got = logits_of(path)
    assert np.isfinite(got).all() and np.abs(got - ref).max() <= FAST_TOL * np.abs(ref).max()
    model = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    branches = expert_branches(model)
    assert branches
    dq = next(n for n in g if n.op == "dequantize" and n.outputs[0].users[0].op.startswith("moe_experts"))
    q = np.asarray(dq.inputs[0].read() if dq.inputs[0].producer is None else 0)
    for br in branches:
        then = onnx.helper.get_attribute_value(next(a for a in br.attribute if a.name == "then_branch"))
        ops = [n.op_type for n in then.node]
        assert "DequantizeLinear" not in ops
        assert ops.count("MatMul") == (4 if "lora" in case else 0)
        assert ops.count("MatMulNBits") == 2  # up_gate and down (fast int8: one 8-bit MatMulNBits)
        own = {t.name: numpy_helper.to_array(t) for t in then.initializer}
        assert any(n.op_type == "MatMulNBits" and n.input[1] in own for n in then.node)
    if q.ndim == 3:  # an unpacked stack: the first expert's up_gate weights decode to q[0] * s[0]
        s = np.asarray(dq.inputs[1].read()).astype(np.float64)
        first = onnx.helper.get_attribute_value(
            next(a for a in branches[0].attribute if a.name == "then_branch"))
        own = {t.name: numpy_helper.to_array(t) for t in first.initializer} | inits
        nbits = next(n for n in first.node if n.op_type == "MatMulNBits")
        want = q[0].astype(np.float64) * (s[0] if s.ndim == 2 else s)
        assert np.array_equal(_decode_nbits(nbits, own), want)
    stored = onnx.load(str(path), load_external_data=False)
    external = [t for t in _all_initializers(stored) if t.data_location == onnx.TensorProto.EXTERNAL]
    ends = [int({x.key: x.value for x in t.external_data}["length"]) for t in external]
    assert data.stat().st_size - sum(ends) <= 64 * len(ends)  # no unread bytes (an expert stack) in the file


def _all_initializers(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    out = list(model.graph.initializer)
    for n in model.graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                out.extend(a.g.initializer)
    return out
