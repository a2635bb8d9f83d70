"""`generate --backend paddle` on a 2-rank artifact: one paddle.distributed gloo process per rank,
each running the whole generation loop over its rank's decoder Layer, equals the SPMD
interpreter (every rank's decoder in lockstep in one process): the same tokens, and logits within
1e-5 of the largest |logit| at every step. Rank 0's logits are what every rank chooses from, so
the ranks pick the same tokens, greedy or sampled (a seed: the launcher's when none is given).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _dist_testkit import compile_art, leftover_processes

from ernie_ir.generation import DecodeOptions, SamplingOptions, open_decoder

pytest.importorskip("paddle")

PROMPTS = [[1, 5, 900, 77, 3, 1000, 511], [1023, 0, 512]]  # both vocab halves at tp 2; unequal lengths
REL = 1e-5


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_art(tmp_path_factory.mktemp("gloo-generate"), "ernie-4.5-0.3b@tiny", "dense", tp=2)


def test_gloo_greedy_generation_equals_spmd(art: Path) -> None:
    options = DecodeOptions(max_new_tokens=5, keep_logits=True)
    ref = open_decoder(art, "interpreter").generate(PROMPTS, options)
    streamed: list[tuple[int, list[int], list[bool]]] = []
    got = open_decoder(art, "paddle", timeout_s=120).generate(
        PROMPTS, options, on_tokens=lambda s, t, live: streamed.append((s, t.tolist(), list(live))))
    assert got.new_tokens == ref.new_tokens and got.finish_reasons == ref.finish_reasons == ["length"] * 2
    assert len(got.step_logits) == len(ref.step_logits) == 5 and len(got.decode_ms) == 4
    for i, (p, r) in enumerate(zip(got.step_logits, ref.step_logits, strict=True)):
        scale = float(np.abs(r).max())
        err = float(np.abs(p - r).max()) / scale
        print(f"[distributed] generate tp 2 step {i}: gloo vs SPMD max rel {err:.2e}")
        assert err <= REL
        top = np.sort(r, axis=-1)
        assert float((top[:, -1] - top[:, -2]).min()) / scale > 20 * REL  # no near-tie: tokens must agree
    assert [s for s, _, _ in streamed] == list(range(5))  # every step streamed, in order
    assert [t for _, t, _ in streamed] == [list(col) for col in zip(*got.new_tokens, strict=True)]
    assert not leftover_processes()


def test_gloo_sampling_and_stop_equal_spmd(art: Path) -> None:
    """Sampled with a seed, as the interpreter samples; a stop rule (applied in this process,
    after the ranks report the step) ends row 0 after two tokens, as it ends it in the loop.
    (The tiny model's logits are peaked: temperature 10 makes the draws diverse. Logits ~1e-6
    apart move a draw's cumulative probabilities by ~1e-7: a flip is that unlikely, and fixed
    by the seed.)"""
    options = DecodeOptions(max_new_tokens=6, sampling=SamplingOptions(greedy=False, temperature=10.0,
                                                                        top_k=50, seed=12))
    stop = lambda row, new: row == 0 and len(new) == 2  # noqa: E731
    ref = open_decoder(art, "interpreter").generate(PROMPTS, options, stop=stop)
    streamed: list[tuple[int, list[bool]]] = []
    got = open_decoder(art, "paddle", timeout_s=120).generate(
        PROMPTS, options, stop=stop, on_tokens=lambda s, t, live: streamed.append((s, list(live))))
    assert ref.finish_reasons == ["stop", "length"] and len(ref.new_tokens[0]) == 2
    assert got.new_tokens == ref.new_tokens and got.finish_reasons == ref.finish_reasons
    assert len(set(got.new_tokens[1])) > 1  # sampled: not one token repeated
    assert streamed == [(s, [s < 2, True]) for s in range(6)]
    assert not leftover_processes()
