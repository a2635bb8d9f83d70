"""Generation with a KV cache (issue 20): the decoder against full recompute, every family, float,
wint8mix and LoRA, one rank and two, padded batches; sampling; EOS; the cache's dtype; the pass.

The reference is the graph the decoder was made from, run without a cache on each row alone
(prompt + the tokens generated so far): per step, the logits the next token was chosen from must
agree to 1e-5 of the largest logit, and the greedy tokens must be equal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from _fe_testkit import hf_to_paddle, random_hf_ernie, write_checkpoint

from ernie_ir.artifacts import load_rank_graphs
from ernie_ir.backends.sessions import run_artifact
from ernie_ir.generation import DecodeError, DecodeOptions, Generator, SamplingOptions
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.verifier import verify
from ernie_ir.load import load_input
from ernie_ir.passes.decoding.kv_cache import KvCacheError, add_kv_cache
from ernie_ir.runtime import Interpreter
from ernie_ir.runtime.decoding import choose, decode, empty_cache
from ernie_ir.targets.compile import CompileOptions, compile_model

BUILTINS = ["ernie-4.5-0.3b@tiny", "ernie-4.5-21b-a3b@tiny", "ernie-3.5-se-3b@tiny", "gpt-345m@tiny"]
DENSE = {
    "architectures": ["Ernie4_5_ForCausalLM"], "hidden_size": 48, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 160, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
PROMPTS = [[5, 17, 33, 9, 71, 8, 40], [12, 90, 3]]  # unequal: the short one is left-padded


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random ERNIE 4.5 dense checkpoint whose greedy output is diverse (untied, N(0, 1/fan_in))."""
    root = tmp_path_factory.mktemp("dense") / "model"
    return write_checkpoint(root, DENSE, hf_to_paddle(random_hf_ernie(DENSE, seed=3), DENSE))


def check_against_recompute(gen: Generator, reference, prompts=PROMPTS, steps: int = 5) -> list[list[int]]:
    """Decode greedily with the cache; compare every step with the reference (a graph, or a
    function of the ids giving full-sequence logits) on each row alone."""
    result = gen.generate(prompts, DecodeOptions(max_new_tokens=steps, keep_logits=True), ignore_eos=True)
    if callable(reference):
        full = reference
    else:
        it = Interpreter(reference)

        def full(seq: np.ndarray) -> np.ndarray:
            return it.run({"input_ids": seq})["logits"]

    for r, (prompt, new) in enumerate(zip(result.prompts, result.new_tokens, strict=True)):
        assert len(new) == steps
        seq = np.asarray([prompt + new[:-1]], np.int64)
        ref = full(seq)[0, len(prompt) - 1:]
        got = np.stack([s[r] for s in result.step_logits])
        scale = float(np.abs(ref).max())
        err = float(np.abs(got - ref).max())
        assert err <= 1e-5 * scale, f"row {r}: cached logits differ by {err} (scale {scale})"
        assert np.argmax(ref, axis=-1).tolist() == new, f"row {r}: greedy tokens differ from recompute"
    return result.new_tokens


@pytest.mark.parametrize("model", BUILTINS)
def test_every_family_decodes_as_it_recomputes(model: str):
    check_against_recompute(Generator(model), load_input(model))


def test_a_diverse_checkpoint_decodes_as_it_recomputes(dense_ckpt: Path):
    new = check_against_recompute(Generator(dense_ckpt), load_input(str(dense_ckpt)), steps=8)
    assert len(set(new[0])) > 4, f"the test model repeats itself: {new}"


@pytest.mark.parametrize(("model", "options"), [
    ("ernie-4.5-21b-a3b@tiny", {"quant": "wint8mix"}),
    ("ernie-3.5-se-3b@tiny", {"quant": "wint8mix"}),
    ("gpt-345m@tiny", {"lora_rank": 4}),
    ("ernie-4.5-0.3b@tiny", {"tp": 2}),
    ("ernie-4.5-21b-a3b@tiny", {"tp": 2, "ep": 2}),
    ("ernie-3.5-se-3b@tiny", {"tp": 2, "quant": "wint8mix"}),
])
def test_artifacts_decode_as_they_recompute(model: str, options: dict, tmp_path: Path):
    """Quantized, LoRA and split artifacts: the rank graphs' decoders (the SPMD interpreter for
    several ranks, each rank its own cache) against the same rank graphs run without a cache."""
    art = compile_model(model, "cuda", CompileOptions(out=tmp_path / "a", **options))
    ranks = len(load_rank_graphs(art.out)[1])
    assert ranks == max(options.get("tp", 1), options.get("ep", 1))
    check_against_recompute(Generator(art.out), lambda seq: run_artifact(Path(art.out), seq, "interpreter"))


def test_right_padding_with_holes(dense_ckpt: Path):
    """onnxruntime-genai's padding: a pad in the middle (mask 0) is skipped, positions continue."""
    graph = load_input(str(dense_ckpt))
    full = Interpreter(graph).run({"input_ids": np.asarray([[5, 17, 33]])})["logits"][0]
    dec = load_input(str(dense_ckpt))
    layout = add_kv_cache(dec)
    out = Interpreter(dec).run({
        "input_ids": np.asarray([[5, 17, 0, 33]]), "attention_mask": np.asarray([[1, 1, 0, 1]]),
        "position_ids": np.asarray([[0, 1, 1, 2]]), **empty_cache(layout.layers, 1)})
    got = out["logits"][0][[0, 1, 3]]
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-5 * float(np.abs(full).max()))


def test_sampling_follows_top_k_top_p_and_temperature():
    logits = np.asarray([[2.0, 1.0, 0.5, 0.0, -1.0]], np.float32)
    rng = np.random.default_rng(0)
    opts = SamplingOptions(greedy=False, temperature=0.7, top_k=4, top_p=0.9, seed=0)
    draws = np.asarray([choose(logits, opts, rng)[0] for _ in range(20000)])
    p = np.exp(logits[0, :4] / 0.7)
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), 0.9) + 1)  # the smallest prefix reaching 0.9
    q = np.zeros(5)
    q[:keep] = p[:keep] / p[:keep].sum()
    freq = np.bincount(draws, minlength=5) / len(draws)
    assert np.abs(freq - q).max() < 0.015, (freq, q)
    assert choose(logits, SamplingOptions(greedy=False, top_k=1), rng)[0] == 0


def test_seeded_sampling_repeats_and_top_k_1_is_greedy(dense_ckpt: Path):
    gen = Generator(dense_ckpt)
    greedy = gen.generate(PROMPTS, DecodeOptions(max_new_tokens=6), ignore_eos=True).new_tokens
    sampled = SamplingOptions(greedy=False, temperature=1.5, seed=7)
    a = gen.generate(PROMPTS, DecodeOptions(max_new_tokens=6, sampling=sampled), ignore_eos=True)
    b = gen.generate(PROMPTS, DecodeOptions(max_new_tokens=6, sampling=sampled), ignore_eos=True)
    assert a.new_tokens == b.new_tokens
    assert a.new_tokens != greedy
    k1 = SamplingOptions(greedy=False, top_k=1, seed=1)
    assert gen.generate(PROMPTS, DecodeOptions(max_new_tokens=6, sampling=k1), ignore_eos=True).new_tokens \
        == greedy


def test_eos_ends_a_row_and_the_others_go_on(dense_ckpt: Path):
    gen = Generator(dense_ckpt)
    free = gen.generate(PROMPTS, DecodeOptions(max_new_tokens=6), ignore_eos=True)
    eos = free.new_tokens[0][2]
    assert eos not in free.new_tokens[0][:2]
    cut = gen.generate(PROMPTS, DecodeOptions(max_new_tokens=6, eos_ids=frozenset({eos})))
    assert cut.new_tokens[0] == free.new_tokens[0][:3] and cut.finish_reasons[0] == "eos"
    if eos not in free.new_tokens[1]:
        assert cut.new_tokens[1] == free.new_tokens[1] and cut.finish_reasons[1] == "length"


def test_the_cache_dtype_rounds_the_cache(dense_ckpt: Path):
    f32 = Generator(dense_ckpt).generate(PROMPTS, DecodeOptions(max_new_tokens=4, keep_logits=True),
                                         ignore_eos=True)
    dec = load_input(str(dense_ckpt))
    layout = add_kv_cache(dec, "f16")
    assert layout.dtype == "f16"
    step = Interpreter(dec).run
    seen: list[np.ndarray] = []

    def spy(feeds):
        out = step(feeds)
        seen.extend(v for k, v in out.items() if k.startswith("present."))
        return out

    f16 = decode(spy, layout.layers, PROMPTS, DecodeOptions(max_new_tokens=4, keep_logits=True))
    for v in seen:
        assert np.array_equal(v, v.astype(np.float16).astype(np.float32))
    assert seen and any(v.size for v in seen)
    for a, b in zip(f16.step_logits, f32.step_logits, strict=True):
        assert np.abs(a - b).max() <= 1e-2 * np.abs(b).max()


def test_the_decoder_graph_prints_parses_and_verifies():
    g = load_input("ernie-4.5-21b-a3b@tiny")
    add_kv_cache(g)
    verify(g)
    text = print_graph(g)
    again = parse_graph(text)
    assert print_graph(again) == text
    assert [v.name for v in g.inputs][:3] == ["input_ids", "attention_mask", "position_ids"]
    assert g.output_names[1:3] == ["present.0.key", "present.0.value"]
    assert "kv_cache_append" in text and "key_padding_mask" in text


def test_the_pass_refuses_what_it_cannot_make_a_decoder():
    g = load_input("ernie-4.5-0.3b@tiny")
    add_kv_cache(g)
    with pytest.raises(KvCacheError, match="already a decoder"):
        add_kv_cache(g)
    with pytest.raises(KvCacheError, match="holds f32, bf16, f16; not i8"):
        add_kv_cache(load_input("gpt-345m@tiny"), "i8")


def test_requests_are_refused_before_any_work(dense_ckpt: Path):
    gen = Generator(dense_ckpt)
    with pytest.raises(DecodeError, match="empty"):
        gen.check([[]], 4)
    with pytest.raises(DecodeError, match="outside the vocabulary"):
        gen.check([[1, 160]], 4)
    with pytest.raises(DecodeError, match="beyond the model's 64"):
        gen.check([[1] * 60], 5)
    with pytest.raises(DecodeError, match="max-new-tokens"):
        gen.check([[1]], 0)
    with pytest.raises(DecodeError, match="top-p"):
        SamplingOptions(greedy=False, top_p=0.0).check()


def test_generate_api_reads_eos_from_the_config(dense_ckpt: Path, tmp_path: Path):
    gen = Generator(dense_ckpt)
    assert gen.eos_ids == frozenset({2}) and gen.pad_id == 0
    folder = tmp_path / "m"
    folder.mkdir()
    for f in dense_ckpt.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert Generator(folder).eos_ids == frozenset({2, 7})
