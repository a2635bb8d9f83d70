"""The ONNX executable of a trained QAT artifact: its activation quantizers bit for bit.

`compile TRAINED_QAT_ART --target cuda` converts the weights to int8 (`qat-convert`) and keeps
the activations' fake quantization in its inference form: `pact` (clip by the learned alpha)
and `fake_quant_moving_average{is_test}` (the learned scale, a constant). emit_onnx lowers both
(and `fake_quant`, abs-max from x, which a converted graph keeps for a weight it cannot
convert) as their numpy kernels, one float32 ONNX op per numpy operation (the emitter's
docstring, "QAT quantizers"), so onnxruntime's results are the interpreter's bit for bit:

(a) per op, on inputs built to sit on every rounding tie (k * x exactly n + 0.5 quantization
    steps, the float below it, the floats around both), at the clip bounds, on +-0, +-inf,
    NaN, for several scales (0, below Paddle's 1e-30 guard, powers of two, learned-like),
    both round types, 8 and 4 bits, constant and computed scales: every float32 result has
    the kernel's bits (NaN where the kernel gives NaN);
(b) in the trained GPT and ERNIE 4.5 tiny artifacts, each quantizer node lowered alone and fed
    the activation the interpreter computes there gives the interpreter's result bit for bit;
(c) the whole model in a bare `onnxruntime.InferenceSession` (no options: what a user runs)
    gives the interpreter's logits within LOGITS_TOL. Why that holds: the quantizers are
    exact, so the two differ only by float32 summation order (matmuls, softmax, norms);
    a quantizer could still turn a 1-ulp difference of its input that sits on a rounding
    boundary into one quantization step, which these inputs do not hit (measured <= 3.5e-7
    of the logits' scale, the same as a float model's ONNX against the interpreter);
(d) the fake-quantized graph (`--disable-pass qat-convert`) gives the converted model's ONNX
    logits exactly (both hold fake_quant(W) bit for bit).

The training form of the moving average (it updates its state) is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ernie_ir.backends.onnx.lower import OnnxExportError, build_onnx
from ernie_ir.backends.onnx.session import full_sequence_feeds
from ernie_ir.backends.sessions import run_artifact
from ernie_ir.ir import DType, ErnieIRError, Graph, GraphBuilder, Node, TensorType
from ernie_ir.ir.weights import ArraySource
from ernie_ir.ops.quant_numerics import paddle_inverse
from ernie_ir.runtime.interpreter import Interpreter, run_graph
from ernie_ir.targets import CompileOptions, compile_model, load_artifact, read_manifest

MODELS = {"gpt": "gpt-345m@tiny", "ernie": "ernie-4.5-0.3b@tiny"}
# PaddleSlim's QAT config with a scale per output channel (ERNIE); GPT uses the qat-int8 preset
# (abs_max: one scale per weight). Both: PACT, then a moving-average activation quantizer. As
# tests/quant/test_qat_to_int8.py.
CHANNEL_WISE = ("Quantization:\n  weight_quantize_type: channel_wise_abs_max\n"
                "  activation_quantize_type: moving_average_abs_max\n"
                "  activation_preprocess_type: PACT\n  weight_bits: 8\n  activation_bits: 8\n")
STEPS = 2
IDS = np.random.default_rng(7).integers(0, 1024, size=(2, 12))
LOGITS_TOL = 2e-5
"""max |logit error| <= LOGITS_TOL x max |logit| (float32 summation order, as test_onnx_emit)."""
SCALES = (0.37, 2.0 ** -3, 3.1415927, 17.25, 1e-31, 0.0)
QUANTIZERS = ("pact", "fake_quant_moving_average")


def _bound(bits: int) -> np.float32:
    return np.float32(2 ** (bits - 1) - 1)


def _around(values: list[np.float32], ulps: int = 3) -> list[np.float32]:
    """Each value and the `ulps` float32 values on either side of it."""
    out = []
    for v in values:
        lo = hi = np.float32(v)
        out.append(lo)
        for _ in range(ulps):
            lo, hi = np.nextafter(lo, np.float32(-np.inf)), np.nextafter(hi, np.float32(np.inf))
            out += [lo, hi]
    return out


def _tie_inputs(s: float, bits: int, inside: bool = False) -> np.ndarray:
    """x where k * x (k = b * inverse(s), the kernel's multiplier) lands on n + 0.5 and on the
    float just below it, for every n the quantizer reaches (and beyond), with their neighbours;
    `inside`: only |x| < s (so s stays a tensor's abs-max). Plus +-0 and the bounds +-s."""
    b = _bound(bits)
    k = b * paddle_inverse(np.float32(s))
    top = int(b) - 1 if inside else int(b) + 3
    below = np.float32(0.49999997)
    targets = [np.float32(t) for n in range(-top - 1, top) for t in (n + 0.5, np.float32(n) + below)]
    x = np.array([*_around([np.float32(t / k) for t in targets]), 0.0, -0.0], np.float32)
    if inside:
        return x[np.abs(x) < np.float32(s)] if s else x[x == 0]
    return np.concatenate([x, np.array(_around([np.float32(s), -np.float32(s)], 2), np.float32)])


def _specials() -> np.ndarray:
    return np.array([np.inf, -np.inf, np.nan, 1e30, -1e30, 1e-45, -1e-45, 1e-38, -1e-38], np.float32)


def _ties_hit(x: np.ndarray, s: float, bits: int, round_type: int) -> int:
    """How many distinct ties n + 0.5 the kernel's rounding input k * x (k * clip(x, -s, s))
    lands on exactly."""
    k = _bound(bits) * paddle_inverse(np.float32(s))
    t = k * (np.clip(x, -np.float32(s), np.float32(s)) if round_type == 1 else x)
    t = t[np.isfinite(t)]
    return len(np.unique(t[t - np.floor(t) == np.float32(0.5)]))


def _onnx_run(graph: Graph, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The graph's ONNX model in a bare onnxruntime session (default options, as a user runs it)."""
    session = ort.InferenceSession(build_onnx(graph).SerializeToString())
    return session.run(None, feeds)


def _assert_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """got has want's float32 bits everywhere, NaN where want is NaN (any NaN)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, what
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=what)
    differ = (got.view(np.uint32) != want.view(np.uint32)) & ~nan
    assert not differ.any(), (f"{what}: {int(differ.sum())} of {got.size} differ, e.g. "
                              f"{got[differ][:4]} instead of {want[differ][:4]}")


def _moving_average_graph(shape: tuple[int, ...], s: float, bits: int, round_type: int,
                          computed: bool) -> Graph:
    b = GraphBuilder("qat")
    x = b.input("x", TensorType(DType.F32, shape))
    scale = (b.input("scale", TensorType(DType.F32, (1,))) if computed
             else b.param("act.scale", source=ArraySource(np.array([s], np.float32))))
    accum = b.param("act.accum", source=ArraySource(np.array([2.5], np.float32)))
    state = b.param("act.state", source=ArraySource(np.array([3.0], np.float32)))
    y = b.fake_quant_moving_average(x, scale, accum, state, bits=bits, round_type=round_type, is_test=True)
    b.output(y[0], name="y")
    return b.graph


@pytest.mark.parametrize("computed", [False, True], ids=["learned-scale", "computed-scale"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("round_type", [0, 1])
def test_moving_average_inference_form_is_the_kernel_bit_for_bit(round_type: int, bits: int,
                                                                computed: bool) -> None:
    b = int(_bound(bits))
    for s in SCALES:
        x = np.concatenate([_tie_inputs(s, bits), _specials()])
        if s > 1e-30:  # the inputs sit on most of the 2b ties in (-b, b) (not every one is a product k * x)
            assert _ties_hit(x, s, bits, round_type) >= 0.8 * 2 * b
        x = x.reshape(1, -1)
        g = _moving_average_graph(x.shape, s, bits, round_type, computed)
        feeds = {"x": x, **({"scale": np.array([s], np.float32)} if computed else {})}
        _assert_bits(_onnx_run(g, feeds)[0], run_graph(g, feeds)["y"], f"scale {s}")


def test_moving_average_passes_its_state_through_and_the_learned_scale_is_in_the_file() -> None:
    b = GraphBuilder("qat")
    x = b.input("x", TensorType(DType.F32, (2, 8)))
    scale, accum, state = (b.param(f"act.{n}", source=ArraySource(np.array([v], np.float32)))
                           for n, v in (("scale", 0.37), ("accum", 2.5), ("state", 3.0)))
    outs = b.fake_quant_moving_average(x, scale, accum, state, is_test=True)
    b.output(*outs, names=["y", "out_scale", "out_state", "out_accum"])
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)}
    got, want = _onnx_run(b.graph, feeds), run_graph(b.graph, feeds)
    for name, arr in zip(["y", "out_scale", "out_state", "out_accum"], got, strict=True):
        _assert_bits(arr, want[name], name)
    inits = {t.name for t in build_onnx(b.graph).graph.initializer}
    assert "act.scale" in inits and not any(n.op_type in ("QuantizeLinear", "DequantizeLinear")
                                            for n in build_onnx(b.graph).graph.node)


def _channels(shape: tuple[int, ...], keep: tuple[int, ...], bits: int, seed: int) -> np.ndarray:
    """x whose abs-max over the axes not in `keep` is a chosen s per kept index, with every
    other value on or around a tie of that index's k; one index all +-0 (s = 0)."""
    rng = np.random.default_rng(seed)
    moved = np.moveaxis(np.zeros(shape, np.float32), keep, range(len(keep)))
    kept, rest = moved.shape[:len(keep)], int(np.prod(moved.shape[len(keep):]))
    flat = moved.reshape(-1, rest)
    for i in range(flat.shape[0]):
        if i == 1:
            flat[i] = np.where(rng.random(rest) < 0.5, np.float32(-0.0), np.float32(0.0))
            continue
        s = np.float32(rng.choice([0.37, 0.125, 3.1415927, 17.25]))
        pool = _tie_inputs(float(s), bits, inside=True)
        flat[i] = rng.choice(pool, rest)
        flat[i, rng.integers(rest)] = s if rng.random() < 0.5 else -s
    return np.moveaxis(flat.reshape(*kept, *moved.shape[len(keep):]), range(len(keep)), keep).copy()


@pytest.mark.parametrize(("shape", "axes"), [((64, 6), (1,)), ((6, 64), (0,)), ((3, 40, 5), (0, 2)),
                                             ((2, 3, 50), (1,)), ((64, 3), ())],
                         ids=["per-column", "per-row", "per-expert-column", "middle", "tensor-wise"])
@pytest.mark.parametrize("round_type", [0, 1])
def test_fake_quant_is_the_kernel_bit_for_bit(shape: tuple[int, ...], axes: tuple[int, ...],
                                              round_type: int) -> None:
    x = _channels(shape, axes or (0,), 8, seed=len(shape) + round_type)
    if not axes:  # one scale: its abs-max, ties of it
        x = np.random.default_rng(1).choice(_tie_inputs(0.37, 8, inside=True), shape).astype(np.float32)
        x.reshape(-1)[5] = np.float32(-0.37)
    b = GraphBuilder("qat")
    xv = b.input("x", TensorType(DType.F32, shape))
    b.output(b.fake_quant(xv, bits=8, round_type=round_type, axes=axes), name="y")
    _assert_bits(_onnx_run(b.graph, {"x": x})[0], run_graph(b.graph, {"x": x})["y"], f"axes {axes}")
    # a constant input (a weight qat-convert kept) is folded by the kernel itself
    c = GraphBuilder("qat")
    w = c.param("w", source=ArraySource(x))
    c.output(c.fake_quant(w, bits=8, round_type=round_type, axes=axes), name="y")
    _assert_bits(_onnx_run(c.graph, {})[0], run_graph(c.graph, {})["y"], f"constant, axes {axes}")


@pytest.mark.parametrize("alpha", [20.0, 0.75, 1e-3, 0.0])
def test_pact_is_the_kernel_bit_for_bit(alpha: float) -> None:
    a = np.float32(alpha)
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(500).astype(np.float32) * np.float32(max(alpha, 1.0)),
                        np.array(_around([a, -a, np.float32(0)]), np.float32),
                        np.array([-0.0, 0.0], np.float32), _specials()]).reshape(1, -1)
    b = GraphBuilder("qat")
    xv = b.input("x", TensorType(DType.F32, x.shape))
    b.output(b.pact(xv, b.param("act.pact_alpha", source=ArraySource(np.array([a])))), name="y")
    with np.errstate(invalid="ignore"):  # inf - inf in the kernel: NaN, as onnxruntime gives
        want = run_graph(b.graph, {"x": x})["y"]
    _assert_bits(_onnx_run(b.graph, {"x": x})[0], want, f"alpha {alpha}")


def test_the_training_form_is_refused_in_one_line(tmp_path: Path) -> None:
    g = _moving_average_graph((2, 4), 0.5, 8, 1, computed=False)
    node = next(n for n in g if n.op == "fake_quant_moving_average")
    node.attrs = node.attrs.model_copy(update={"is_test": False})
    with pytest.raises(OnnxExportError, match=r"cannot lower fake_quant_moving_average .*training form"):
        build_onnx(g)
    # an untrained QAT model compiled for inference keeps the training form: --emit onnx is
    # refused before anything is written
    out = tmp_path / "untrained"
    refused = r"^--emit onnx: fake_quant_moving_average at .* training form"
    with pytest.raises(ErnieIRError, match=refused) as e:
        compile_model(MODELS["gpt"], "cuda", CompileOptions(quant="qat-int8", out=out, emit="paddle,onnx"))
    assert "\n" not in str(e.value) and not out.exists()


# -- the trained artifacts ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> the trained QAT artifact compiled for cuda inference with the ONNX executable."""
    pytest.importorskip("paddle")  # training
    from ernie_ir.training.loop import train_artifact

    tmp = tmp_path_factory.mktemp("qat-onnx")
    cfg = tmp / "channel_wise.yaml"
    cfg.write_text(CHANNEL_WISE, encoding="utf-8")
    out = {}
    for name, kw in (("gpt", {"quant": "qat-int8"}), ("ernie", {"quant_config": cfg})):
        art = tmp / f"{name}-train"
        compile_model(MODELS[name], "cuda", CompileOptions(mode="training", out=art, **kw))  # type: ignore[arg-type]
        train_artifact(art, STEPS)
        report = compile_model(str(art), "cuda", CompileOptions(out=tmp / name, emit="paddle,onnx"))
        assert report.pipeline.startswith("qat-convert,") and report.emit == ["paddle", "onnx"]
        out[name] = tmp / name
    return out


def _single(node: Node, x: np.ndarray) -> Graph:
    """`node` alone (its params copied, its activation an input of the observed shape)."""
    b = GraphBuilder("one")
    xv = b.input("x", TensorType(DType.F32, x.shape))
    params = [b.param(p.name, source=ArraySource(np.asarray(p.read(), np.float32))) for p in node.inputs[1:]]
    outs = b.op(node.op, xv, *params, **node.attrs.model_dump())
    b.output(outs if node.op == "pact" else outs[0], name="y")
    return b.graph


@pytest.mark.parametrize("name", list(MODELS))
def test_every_quantizer_of_the_trained_model_is_bit_for_bit_on_its_activations(
        served: dict[str, Path], name: str) -> None:
    g = load_artifact(served[name])
    assert {n.op for n in g} & {"fake_quant", "fake_quant_moving_average", "pact"} == set(QUANTIZERS)
    seen: dict[int, np.ndarray] = {}
    Interpreter(g).run({"input_ids": IDS}, observer=lambda n, rs: seen.update(
        {id(v): r for v, r in zip(n.outputs, rs, strict=True)}))
    checked = 0
    for node in g:
        if node.op not in QUANTIZERS:
            continue
        x = seen[id(node.inputs[0])]
        _assert_bits(_onnx_run(_single(node, x), {"x": x})[0], seen[id(node.outputs[0])],
                     f"{node.op} at {node.scope}")
        checked += 1
    assert checked == 16  # 4 linears x 2 layers, each a PACT and a moving average


@pytest.mark.parametrize("name", list(MODELS))
def test_a_bare_onnxruntime_session_gives_the_interpreters_logits(served: dict[str, Path], name: str) -> None:
    art = served[name]
    manifest = read_manifest(art)
    assert manifest.backends == ["interpreter", "onnxruntime", "paddle"]
    model = art / "inference" / "onnx" / "model.onnx"
    # the learned activation scales are the file's own initializers, with the artifact's values
    scales = {p.name: p.read() for p in load_artifact(art).params.values()
              if p.name.endswith("activation_quant.scale")}
    inits = {t.name: t for t in onnx.load(str(model), load_external_data=False).graph.initializer}
    assert len(scales) == 8 and set(scales) <= set(inits)
    session = ort.InferenceSession(str(model))  # no options: what a user runs
    for ids in (IDS, np.random.default_rng(1).integers(0, 1024, size=(3, 20))):
        ref = run_artifact(art, ids, "interpreter")
        (got,) = session.run(["logits"], full_sequence_feeds(session, ids))
        assert got.shape == ref.shape and got.dtype == np.float32
        err = float(np.abs(got - ref).max())
        assert err <= LOGITS_TOL * float(np.abs(ref).max()), (err, float(np.abs(ref).max()))
    np.testing.assert_allclose(run_artifact(art, IDS, "onnxruntime"), run_artifact(art, IDS, "interpreter"),
                               rtol=0, atol=LOGITS_TOL * float(np.abs(ref).max()))


@pytest.mark.parametrize("name", list(MODELS))
def test_the_fake_quantized_graph_gives_the_same_onnx_logits(served: dict[str, Path], name: str,
                                                             tmp_path: Path) -> None:
    """--disable-pass qat-convert keeps fake_quant on the weights: the ONNX model folds it by the
    kernel at export, the converted one dequantizes int8 with qat-convert's exact division; both
    are fake_quant(W) bit for bit, so the two models' logits are identical."""
    trained = Path(read_manifest(served[name]).source["model"])  # the training artifact
    fq = tmp_path / "fq"
    report = compile_model(str(trained), "cuda", CompileOptions(out=fq, emit="paddle,onnx",
                           disabled_passes=["qat-convert"]))
    assert report.pipeline == "legalize-cuda" and any(n.op == "fake_quant" for n in load_artifact(fq))
    logits = []
    for art in (served[name], fq):
        session = ort.InferenceSession(str(art / "inference" / "onnx" / "model.onnx"))
        logits.append(session.run(["logits"], full_sequence_feeds(session, IDS))[0])
    np.testing.assert_array_equal(logits[0], logits[1])
