"""cuda packing: bit-exact with Paddle's `weight_quantize` CPU kernel, and the packed-layout ops."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ernie_ir.ir import ErnieIRError, GraphBuilder, Param, bf16, f32, i4, i8, tensor
from ernie_ir.ops.quant_numerics import weight_quantize
from ernie_ir.runtime import run_graph
from ernie_ir.targets.cuda.packing import CUDA_ARCHS, pack, packable, packed_shape, unpack

REPO = Path(__file__).resolve().parents[2]
REFENVS = Path(os.environ.get("ERNIE_IR_REFENVS", Path.home() / ".cache/ernie-ir/refenvs"))
PF_PYTHON = REFENVS / "pf" / "bin" / "python"
SHAPES = ([256, 128], [192, 80])  # [in, out]; 192 = 3 * 64 rows, 80 = 5 * 16 outputs


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def paddle_cases(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not PF_PYTHON.exists():
        pytest.skip(f"reference env 'pf' missing ({PF_PYTHON}); build it with "
                    "`bash tests/reference/install_envs.sh pf`")
    out = tmp_path_factory.mktemp("pf_quant")
    spec = {"shape": request.param, "position_maps": False, "fake_shape": [2, 2], "bits": [8],
            "round_types": [0], "quant_axes": [0], "moving_steps": 1}
    subprocess.run([str(PF_PYTHON), str(REPO / "tests/reference/pf_quant.py"), json.dumps(spec), str(out)],
                   check=True, capture_output=True, timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.reference
def test_packing_is_bit_exact_with_paddle_for_every_arch_bits_and_group(paddle_cases: Path) -> None:
    meta = json.loads((paddle_cases / "meta.json").read_text())
    assert not meta["refused"]
    w = np.load(paddle_cases / "wq_input_bf16.npy").view(ml_dtypes.bfloat16)
    seen = set()
    for tag, case in meta["cases"].items():
        if not tag.startswith("wq_"):
            continue
        bits = 8 if case["algo"] == "weight_only_int8" else 4
        q, scale = weight_quantize(w, bits, case["group_size"])
        ours = pack(q, bits, case["arch"])
        theirs = np.load(paddle_cases / f"{case['q']}.npy")
        assert ours.dtype == theirs.dtype == np.int8 and ours.shape == theirs.shape, tag
        assert ours.tobytes() == theirs.tobytes(), tag
        ref_scale = np.load(paddle_cases / f"{case['scale']}.npy")
        assert scale.view(np.uint16).tobytes() == ref_scale.tobytes(), tag
        np.testing.assert_array_equal(unpack(theirs, *w.shape, bits, case["arch"]), q)
        seen.add((bits, case["arch"], case["group_size"]))
    assert seen == {(b, a, g) for b in (8, 4) for a in CUDA_ARCHS for g in (-1, 64, 128)}


@pytest.mark.parametrize("arch", CUDA_ARCHS)
@pytest.mark.parametrize("bits", [8, 4])
def test_unpack_inverts_pack(arch: int, bits: int) -> None:
    rng = np.random.default_rng(arch + bits)
    b = 127 if bits == 8 else 7
    q = rng.integers(-b, b + 1, (128, 96)).astype(np.int8)
    p = pack(q, bits, arch)
    assert p.shape == packed_shape(128, 96, bits)
    np.testing.assert_array_equal(unpack(p, 128, 96, bits, arch), q)


def test_packable_shapes() -> None:
    assert packable(64, 80, 8, 80) is None
    assert packable(80, 112, 8, 70) is None
    assert "multiple of 64" in (packable(80, 112, 8, 80) or "")
    assert "multiple of 16" in (packable(64, 100, 8, 70) or "")
    with pytest.raises(ErnieIRError, match="cannot pack"):
        pack(np.zeros((80, 112), np.int8), 8, 80)


@pytest.mark.parametrize("arch", [70, 80])
@pytest.mark.parametrize("bits,gs", [(8, -1), (4, -1), (8, 64), (4, 128)])
def test_packed_ops_equal_unpacked_ops(arch: int, bits: int, gs: int) -> None:
    rng = np.random.default_rng(7)
    k, n = 256, 96
    w = (rng.standard_normal((k, n)) * 0.05).astype(ml_dtypes.bfloat16)
    q, s = weight_quantize(w, bits, gs)
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    results = []
    for packed in (False, True):
        gb = GraphBuilder()
        xin = gb.input("x", tensor(f32, "B", "S", k))
        sp = gb.graph.add_param(Param("l.weight_scale", tensor(bf16, *s.shape)))
        sp.set_data(s)
        if packed:
            qp = gb.graph.add_param(Param("l.quant_weight", tensor(i8, *packed_shape(k, n, bits))))
            qp.set_data(pack(q, bits, arch))
            y = gb.weight_only_linear_packed(xin, qp, sp, arch=arch, bits=bits, in_features=k, group_size=gs)
            u = gb.unpack_weight(qp, qp, arch=arch, bits=bits, in_features=k, stacked=True)
            ss = gb.stack(sp, sp)
            gb.graph.add_output(u, "unpacked")
            gb.graph.add_output(ss, "stacked")
        else:
            lq = Param("l.q", tensor(i8 if bits == 8 else i4, k, n))
            lq.set_data(q if bits == 8 else q.astype(ml_dtypes.int4))
            qp = gb.graph.add_param(lq)
            y = gb.weight_only_linear(xin, qp, sp, group_size=gs)
        gb.graph.add_output(y, "y")
        results.append(run_graph(gb.graph, {"x": x}))
    np.testing.assert_array_equal(results[0]["y"], results[1]["y"])
    np.testing.assert_array_equal(results[1]["unpacked"].astype(np.int8), np.stack([q, q]))
    np.testing.assert_array_equal(results[1]["stacked"], np.stack([s, s]).astype(np.float32))
