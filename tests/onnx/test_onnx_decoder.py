"""The ONNX model an artifact carries is a KV-cache decoder, in a bare session and in onnxruntime-genai.

`compile --emit onnx` writes the `kv-cache` pass's decoder (inputs input_ids, attention_mask,
position_ids, past_key_values.{i}.key/.value; outputs logits, present.{i}.key/.value) and a
genai_config.json beside it. For the built-in tiny models, float and wint8mix:

(a) a bare `onnxruntime.InferenceSession` fed an empty past gives the interpreter's logits of
    the whole sequences (the rank graph, no cache);
(b) prefill and then one token per call, feeding each present back as the past, gives the
    whole-sequence logits at every step;
(c) a left-padded batch of prompts of unequal length gives every row's real positions as that
    row alone gives them (pad rows are masked out completely: zeros, not NaN);
(d) onnxruntime-genai (`og.Model(og.Config(folder))`) decodes greedily the tokens a greedy loop
    over the interpreter's whole-sequence logits picks, with its logits at every step, for one
    prompt and for a right-padded batch.

MoE routers can flip between two float32 backends wherever a top-k is within rounding of a tie
(ernie_ir.testing.stability): logits are compared at the stable positions, greedy tokens only on
float models, where the tiny models' top-1 leads by a clear margin (checked).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ernie_ir.backends.onnx.session import full_sequence_feeds, run_onnx
from ernie_ir.formats.genai_config import GenaiConfigError, genai_config, missing_token_ids
from ernie_ir.ir import Graph
from ernie_ir.ir.storage import clone_graph
from ernie_ir.load import load_input
from ernie_ir.passes.decoding.kv_cache import CacheLayout, add_kv_cache
from ernie_ir.runtime.decoding import DecodeOptions, decode, empty_cache, left_pad
from ernie_ir.runtime.interpreter import run_graph
from ernie_ir.targets import TargetError, load_artifact
from ernie_ir.targets.compile import CompileOptions, compile_model
from ernie_ir.targets.executables import _onnx_emitter
from ernie_ir.testing.stability import stable_positions

og = pytest.importorskip("onnxruntime_genai")

MODELS = ("ernie-4.5-0.3b@tiny", "ernie-4.5-21b-a3b@tiny", "ernie-3.5-se-3b@tiny", "gpt-345m@tiny")
CASES = [(m, q) for m in MODELS for q in (None, "wint8mix")]
FLOAT_TOL = 2e-5
"""Float models: max |logit error| <= FLOAT_TOL x max |logit| (float32 reduction order; as
test_onnx_numerics' EXACT_TOL)."""
WEIGHT_ONLY_TOL = 5e-3
"""wint8mix at the default weight-only numerics (test_onnx_numerics.WEIGHT_ONLY_TOL: the bf16
rounding of dequantized weights is dropped)."""
STEP_TOL = 1e-5
"""The same session, with and without a cache: relative to the largest logit."""
IDS = np.array([[11, 300, 42, 7, 99, 123, 500, 17], [9, 8, 7, 6, 5, 4, 1000, 3]])
PREFILL = 4
PROMPTS = [[11, 300, 42, 7, 99, 123], [500, 17, 3]]  # no pad (0) and no EOS id (2) among them


def _id(case: tuple[str, str | None]) -> str:
    return f"{case[0]}-{case[1] or 'float'}"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str | None], Path]:
    root = tmp_path_factory.mktemp("decoder")
    return {c: Path(compile_model(c[0], "cuda",
                                  CompileOptions(quant=c[1], emit="onnx", out=root / _id(c))).out)
            for c in CASES}


def _onnx(art: Path) -> Path:
    return art / "inference" / "onnx" / "model.onnx"


def _session(art: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(_onnx(art)))  # onnxruntime's defaults: what a user gets


def _layout(session: ort.InferenceSession) -> list[tuple[int, int]]:
    past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.") and
            i.name.endswith(".key")]
    return [(int(i.shape[1]), int(i.shape[3])) for i in past]


def _step(session: ort.InferenceSession):
    names = [o.name for o in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(None, dict(feeds)), strict=True))


def _tol(quant: str | None) -> float:
    return FLOAT_TOL if quant is None else WEIGHT_ONLY_TOL


def _stable(art: Path, ids: np.ndarray) -> np.ndarray:
    """[B, S] bool: where no router or quantizer is within float rounding of a decision."""
    return stable_positions(load_artifact(art), {"input_ids": ids}).mask(ids.shape[1])


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_decoder_interface(artifacts: dict, case: tuple[str, str | None]) -> None:
    art = artifacts[case]
    model = onnx.load(str(_onnx(art)), load_external_data=False)
    graph = load_artifact(art)
    layout = CacheLayout.of(_decoder(graph))
    ins = {i.name: i for i in model.graph.input}
    outs = [o.name for o in model.graph.output]
    n = len(layout.layers)
    assert list(ins)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert list(ins)[3:] == [f"past_key_values.{i}.{k}" for i in range(n) for k in ("key", "value")]
    assert outs == ["logits", *(f"present.{i}.{k}" for i in range(n) for k in ("key", "value"))]

    def dims(v: onnx.ValueInfoProto) -> list[object]:
        return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]

    kv, d = layout.layers[0]
    for name in ("input_ids", "attention_mask", "position_ids"):
        assert ins[name].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert dims(ins["attention_mask"]) == ["B", "T"] and dims(ins["position_ids"]) == ["B", "S"]
    assert dims(ins["past_key_values.0.key"]) == ["B", kv, "P", d]  # static heads and head dim
    present = next(o for o in model.graph.output if o.name == "present.0.value")
    assert dims(present) == ["B", kv, "T", d]
    # bf16 caches (ERNIE's) cross the boundary as float32 holding bf16 values
    assert {i.type.tensor_type.elem_type for i in model.graph.input[3:]} == {onnx.TensorProto.FLOAT}
    # the rank graph itself stays the whole-sequence graph (the other executables read it)
    assert [v.name for v in graph.inputs] == ["input_ids"] and "kv_cache" not in graph.metadata
    assert "kv_cache_append" not in (art / "rank0" / "graph.ir").read_text()


def _decoder(graph: Graph) -> Graph:
    """A decoder copy of `graph` (the original unchanged)."""
    dec = clone_graph(graph)
    add_kv_cache(dec)
    return dec


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_full_sequence_in_a_bare_session_equals_the_interpreter(artifacts: dict,
                                                                case: tuple[str, str | None]) -> None:
    art = artifacts[case]
    session = _session(art)
    got = session.run(["logits"], full_sequence_feeds(session, IDS))[0]
    ref = run_graph(load_artifact(art), {"input_ids": IDS})["logits"]
    keep = _stable(art, IDS)
    assert keep.sum() >= IDS.size // 2 and got.shape == ref.shape and np.isfinite(got).all()
    assert np.abs(got - ref)[keep].max() <= _tol(case[1]) * np.abs(ref).max()
    assert np.array_equal(run_onnx(_onnx(art), IDS), got)  # run_onnx feeds the same


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_incremental_decode_equals_the_full_sequence(artifacts: dict, case: tuple[str, str | None]) -> None:
    art = artifacts[case]
    session = _session(art)
    full = session.run(["logits"], full_sequence_feeds(session, IDS))[0]
    run = _step(session)
    b, s = IDS.shape
    feeds = {"input_ids": IDS[:, :PREFILL], "attention_mask": np.ones((b, PREFILL), np.int64),
             "position_ids": np.broadcast_to(np.arange(PREFILL), (b, PREFILL)).astype(np.int64),
             **empty_cache(_layout(session), b)}
    steps = [run(feeds)]
    for t in range(PREFILL, s):
        prev = steps[-1]
        feeds = {"input_ids": IDS[:, t:t + 1], "attention_mask": np.ones((b, t + 1), np.int64),
                 "position_ids": np.full((b, 1), t, np.int64),
                 **{k.replace("present.", "past_key_values."): v for k, v in prev.items() if k != "logits"}}
        steps.append(run(feeds))
        assert steps[-1]["present.0.key"].shape[2] == t + 1
    got = np.concatenate([x["logits"] for x in steps], axis=1)
    keep = _stable(art, IDS)
    assert np.abs(got - full)[keep].max() <= STEP_TOL * np.abs(full).max()


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_left_padded_rows_equal_each_row_alone(artifacts: dict, case: tuple[str, str | None]) -> None:
    art = artifacts[case]
    session = _session(art)
    step = _step(session)
    ids, mask, positions = left_pad(PROMPTS, 0)
    out = step({"input_ids": ids, "attention_mask": mask, "position_ids": positions,
                **empty_cache(_layout(session), len(PROMPTS))})
    assert all(np.isfinite(v).all() for v in out.values())  # pad rows: zeros, never NaN
    options = DecodeOptions(max_new_tokens=4, keep_logits=True)
    batch = decode(step, _layout(session), PROMPTS, options)
    for r, prompt in enumerate(PROMPTS):
        row = np.array([prompt])
        alone = session.run(["logits"], full_sequence_feeds(session, row))[0][0]
        keep = _stable(art, row)[0]
        assert keep.sum() >= (len(prompt) + 1) // 2
        real = out["logits"][r, ids.shape[1] - len(prompt):]
        assert np.abs(real - alone)[keep].max() <= STEP_TOL * np.abs(alone).max()
        if keep.all():  # every later step too, through the cache
            single = decode(step, _layout(session), [prompt], options)
            assert batch.new_tokens[r] == single.new_tokens[0]
            for x, y in zip(batch.step_logits, single.step_logits, strict=True):
                assert np.abs(x[r] - y[0]).max() <= STEP_TOL * np.abs(y).max()


def _greedy_reference(graph: Graph, prompt: list[int], max_length: int,
                      eos: set[int]) -> tuple[list[int], list[np.ndarray]]:
    """Greedy over the interpreter's whole-sequence logits: the sequence (prompt + new tokens, up
    to max_length, an EOS not appended) and the logits each new token was chosen from."""
    seq, chosen_from = list(prompt), []
    while len(seq) < max_length:
        logits = run_graph(graph, {"input_ids": np.array([seq])})["logits"][0, -1]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-3 * np.abs(logits).max()  # a decided top-1: no tie to flip
        chosen_from.append(logits)
        token = int(logits.argmax())
        if token in eos:
            break
        seq.append(token)
    return seq, chosen_from


def _og_model(art: Path) -> og.Model:
    cfg = og.Config(str(_onnx(art).parent))
    cfg.clear_providers()  # the CPU
    return og.Model(cfg)


@pytest.mark.parametrize("model", MODELS)
def test_onnxruntime_genai_greedy_equals_the_interpreter(artifacts: dict, model: str) -> None:
    art = artifacts[(model, None)]
    cfg = json.loads((_onnx(art).parent / "genai_config.json").read_text())
    eos = cfg["model"].get("eos_token_id", [])
    eos = set(eos if isinstance(eos, list) else [eos])
    graph = load_artifact(art)
    m = _og_model(art)
    length = 12
    for prompt in PROMPTS:
        want, want_logits = _greedy_reference(graph, prompt, length, eos)
        params = og.GeneratorParams(m)
        params.set_search_options(do_sample=False, max_length=length)
        gen = og.Generator(m, params)
        gen.append_tokens(np.array([prompt], np.int32))
        logits = []
        while not gen.is_done():
            gen.generate_next_token()
            logits.append(np.asarray(gen.get_output("logits"))[0, -1])
        assert [int(t) for t in gen.get_sequence(0)] == want
        for got, ref in zip(logits, want_logits, strict=True):  # an EOS step included
            assert np.abs(got - ref).max() <= FLOAT_TOL * np.abs(ref).max()


@pytest.mark.parametrize("model", MODELS)
def test_onnxruntime_genai_right_padded_batch(artifacts: dict, model: str) -> None:
    """og right-pads a batch with pad_token_id (mask 0), and the generated tokens follow the pads:
    the model sees a mask with holes. Every row decodes as it does alone."""
    art = artifacts[(model, None)]
    cfg = json.loads((_onnx(art).parent / "genai_config.json").read_text())
    pad = cfg["model"].get("pad_token_id", 0)  # og's default
    graph = load_artifact(art)
    m = _og_model(art)
    width, length = max(map(len, PROMPTS)), 11
    batch = np.full((len(PROMPTS), width), pad, np.int32)
    for r, prompt in enumerate(PROMPTS):
        batch[r, :len(prompt)] = prompt
    params = og.GeneratorParams(m)
    params.set_search_options(do_sample=False, max_length=length, batch_size=len(PROMPTS))
    gen = og.Generator(m, params)
    gen.append_tokens(batch)
    while not gen.is_done():
        gen.generate_next_token()
    for r, prompt in enumerate(PROMPTS):
        seq = [int(t) for t in gen.get_sequence(r)]
        assert seq[:width] == list(batch[r])
        new = seq[width:]
        want, _ = _greedy_reference(graph, prompt, len(prompt) + len(new), set())
        assert new and prompt + new == want


def test_genai_config_rules(artifacts: dict) -> None:
    ernie = load_artifact(artifacts[("ernie-4.5-0.3b@tiny", None)])
    dec = _decoder(ernie)
    cfg = genai_config(dec, CacheLayout.of(dec), max_length=64)
    assert cfg["model"]["type"] == "ernie4_5"
    assert {k: cfg["model"][k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert cfg["model"]["vocab_size"] == 1024 and cfg["model"]["context_length"] == 131072
    decoder = cfg["model"]["decoder"]
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"],
            decoder["num_attention_heads"], decoder["hidden_size"]) == (2, 1, 16, 8, 64)
    assert cfg["search"] == {"do_sample": False, "num_beams": 1, "max_length": 64,
                             "past_present_share_buffer": False}
    moe = _decoder(load_artifact(artifacts[("ernie-4.5-21b-a3b@tiny", None)]))
    assert genai_config(moe, CacheLayout.of(moe))["model"]["type"] == "ernie4_5"
    gpt = _decoder(load_artifact(artifacts[("gpt-345m@tiny", None)]))
    cfg = genai_config(gpt, CacheLayout.of(gpt), token_ids={"eos_token_id": 7})
    assert cfg["model"]["type"] == "decoder"
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    assert [cfg["model"][k] for k in keys] == [7, 7, 7]  # pad and bos: the EOS id (GPT-2's way)
    assert missing_token_ids(gpt) == list(keys)  # a compile warns
    assert not set(keys) & set(genai_config(gpt, CacheLayout.of(gpt))["model"])  # og's defaults
    with pytest.raises(GenaiConfigError, match="one KV-head count and head size"):
        genai_config(gpt, CacheLayout(((4, 16), (2, 16)), "f32"))
    with pytest.raises(GenaiConfigError, match=r"max_length 500 is outside 1\.\.128"):
        genai_config(gpt, CacheLayout.of(gpt), max_length=500)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_a_narrow_cache_for_a_float32_model(tmp_path: Path, dtype: str) -> None:
    """kv_cache_dtype bf16 / f16 on GPT (float32): the ONNX inputs stay FLOAT, the cache holds
    bf16 / f16 values, and the decoder equals the interpreter's decoder with that cache, for
    the prefill and a step that reads the cache back."""
    narrow = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}[dtype]
    ulp = {"bf16": 2.0**-7, "f16": 2.0**-10}[dtype]  # the relative spacing of the type
    graph = load_input("gpt-345m@tiny")
    emit = _onnx_emitter(graph, "weight-only", dtype, [])
    emit(graph, tmp_path)
    session = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"))
    assert {i.type for i in session.get_inputs() if i.name.startswith("past_")} == {"tensor(float)"}
    dec = clone_graph(graph)
    assert add_kv_cache(dec, dtype).dtype == dtype
    ids, mask, positions = left_pad(PROMPTS, 0)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
             **empty_cache(_layout(session), len(PROMPTS))}
    for _ in range(2):
        got = _step(session)(feeds)
        ref = run_graph(dec, feeds)
        for name, want in ref.items():
            err, tol = np.abs(got[name] - want), FLOAT_TOL * max(np.abs(want).max(), 1.0)
            if name == "logits":
                assert err.max() <= tol
            else:  # a cached value may round the other way (float32 noise next to a tie): one ulp
                assert (err <= tol + ulp * np.abs(want)).all() and (err > tol).mean() < 0.01, name
        present = got["present.0.key"]
        assert np.array_equal(present, present.astype(narrow).astype(np.float32))  # narrow values
        nxt = got["logits"][:, -1].argmax(-1)[:, None]
        mask = np.concatenate([feeds["attention_mask"], np.ones_like(nxt)], axis=1)
        feeds = {"input_ids": nxt, "attention_mask": mask,
                 "position_ids": feeds["position_ids"][:, -1:] + 1,
                 **{k.replace("present.", "past_key_values."): v for k, v in got.items() if k != "logits"}}
    with pytest.raises(TargetError, match=r"^--emit onnx: the ONNX model is a KV-cache decoder, and a KV "
                                          r"cache holds .*i8"):
        _onnx_emitter(graph, "weight-only", "i8", [])


@pytest.mark.parametrize("mask_type", ["bool", "f32"])
def test_fully_masked_rows_give_zeros_not_nan(tmp_path: Path, mask_type: str) -> None:
    """An attention whose mask hides every key of some query rows: zeros there, as the
    interpreter gives (a keep mask and an additive -inf mask alike)."""
    from ernie_ir.backends.onnx.lower import emit_onnx
    from ernie_ir.ir.parser import parse_graph

    text = (f"graph @masked(%q: f32[2,3,2,4], %k: f32[2,5,1,4], %v: f32[2,5,1,4], %m: {mask_type}[2,1,3,5])"
            " -> (out: f32[2,3,2,4]) {\n"
            "  %0 = attention(%q, %k, %v, %m) {causal = false, scale = none} : f32[2,3,2,4]\n"
            "  return %0\n}\n")
    graph = parse_graph(text)
    rng = np.random.default_rng(0)
    keep = rng.random((2, 1, 3, 5)) < 0.5
    keep[0, 0, 1] = False  # row 1 of batch 0 sees nothing
    keep[1, 0, :, 0] = True
    keep[1, 0, 2] = False
    feeds = {n: rng.standard_normal(s).astype(np.float32)
             for n, s in (("q", (2, 3, 2, 4)), ("k", (2, 5, 1, 4)), ("v", (2, 5, 1, 4)))}
    feeds["m"] = keep if mask_type == "bool" else np.where(keep, 0, -np.inf).astype(np.float32)
    ref = run_graph(graph, feeds)["out"]
    path, _ = emit_onnx(graph, tmp_path)
    got = ort.InferenceSession(str(path)).run(None, feeds)[0]
    assert np.isfinite(got).all() and not ref[0, 1].any() and not got[0, 1].any() and not got[1, 2].any()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
