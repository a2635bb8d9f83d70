"""`--emit paddle-inference` writes the KV-cache decoder (ernie_ir.backends.paddle.decoder):
`generate --backend paddle-inference` steps it in a `paddle.inference` predictor and gives the
interpreter's tokens (greedy) on every family's built-in @tiny; a bare predictor made in the test
from the saved files gives our session's logits for one step; its prefill is the artifact's only
Paddle program (the `paddle` backend's logits come from it, the weights are written once).

The prompts are ones whose greedy picks are far from a tie on these models (test_paddle_generate
checks the same families' Paddle Layer step by step with that margin asserted).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli

from ernie_ir.artifacts import read_manifest, verify_artifact
from ernie_ir.backends import sessions as sessions_module
from ernie_ir.backends.sessions import choose_backend, open_backend
from ernie_ir.generation import DecodeOptions, Generator
from ernie_ir.targets.compile import CompileOptions, compile_model

pytest.importorskip("paddle")

FAMILIES = {"dense": "ernie-4.5-0.3b@tiny", "moe": "ernie-4.5-21b-a3b@tiny",
            "gpt": "gpt-345m@tiny", "se": "ernie-3.5-se-3b@tiny"}
PROMPTS = [[5, 17, 300, 42, 9, 88, 7], [11, 600, 3]]
NEW = 4


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's @tiny compiled with --emit paddle-inference, once for the module."""
    tmp = tmp_path_factory.mktemp("paddle-inference")
    arts = {}
    for name, model in FAMILIES.items():
        arts[name] = tmp / name
        compile_model(model, "kunlun", CompileOptions(out=arts[name], emit="paddle-inference"))
    return arts


def _generate(capsys: pytest.CaptureFixture[str], art: Path, backend: str) -> list[list[int]]:
    code, out, err = cli(capsys, "generate", str(art), "--prompts", str(art.parent / "prompts.jsonl"),
                         "--max-new-tokens", str(NEW), "--ignore-eos", "--backend", backend, "--json")
    assert code == 0, err
    return json.loads(out)["new_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_on_paddle_inference_equals_the_interpreter(artifacts: dict[str, Path], family: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    art = artifacts[family]
    (art.parent / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    manifest = verify_artifact(art)
    assert manifest.backends == ["interpreter", "paddle", "paddle-inference"]
    ref = _generate(capsys, art, "interpreter")
    got = _generate(capsys, art, "paddle-inference")
    assert got == ref and [len(r) for r in ref] == [NEW, NEW]


@pytest.mark.slow
def test_a_bare_predictor_takes_one_step_like_the_session(artifacts: dict[str, Path]) -> None:
    from paddle import inference

    art = artifacts["se"]
    folder = art / "inference" / "paddle"
    # one program: the decoder's; no second copy of the weights for a logits-only model
    assert sorted(p.name for p in folder.iterdir()) == ["decoder.json", "model.json", "model.pdiparams"]
    io = json.loads((folder / "decoder.json").read_text())

    session = open_backend(art, "paddle-inference")
    options = DecodeOptions(max_new_tokens=2, keep_logits=True)
    gen = Generator(art, backend="paddle-inference")
    seen: list[dict[str, np.ndarray]] = []
    step = gen.decoder.step
    gen.decoder.step = lambda f: (seen.append({k: np.array(v) for k, v in f.items()}), step(f))[1]
    ours = gen.generate(PROMPTS, options, ignore_eos=True)
    second = seen[1]  # a decode step: one new token, a past of the prompt's length
    assert second["input_ids"].shape == (2, 1) and second["past_key_values.0.key"].shape[2] == 7

    config = inference.Config(str(folder / "model.json"), str(folder / "model.pdiparams"))
    config.disable_gpu()
    config.disable_mkldnn()
    pred = inference.create_predictor(config)
    assert pred.get_input_names() == io["inputs"]
    for name in pred.get_input_names():
        handle = pred.get_input_handle(name)
        handle.reshape(list(second[name].shape))
        handle.copy_from_cpu(np.ascontiguousarray(second[name]))
    pred.run()
    outs = dict(zip(io["outputs"], (pred.get_output_handle(n).copy_to_cpu()
                                    for n in pred.get_output_names()), strict=True))
    assert outs["logits"].shape[:2] == (2, 1) and outs["present.0.key"].shape[2] == 8
    np.testing.assert_array_equal(outs["logits"][:, -1], ours.step_logits[1])

    # the whole-sequence logits (run, eval) are the decoder's prefill, equal to the interpreter's
    ids = np.array([PROMPTS[0]])
    ref = open_backend(art, "interpreter").logits(ids)
    got = session.logits(ids)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-5 * float(np.abs(ref).max()))
    np.testing.assert_array_equal(open_backend(art, "paddle").logits(ids), got)


@pytest.mark.slow
def test_auto_picks_paddle_inference_where_the_artifact_has_it(artifacts: dict[str, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = read_manifest(artifacts["gpt"])
    assert choose_backend(manifest).name == "paddle-inference"  # the fastest on a CPU (docs/targets.md)
    monkeypatch.setattr(sessions_module, "_paddle_importable", lambda: False)
    assert choose_backend(manifest).name == "interpreter"
