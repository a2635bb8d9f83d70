"""Generating on Paddle (`Generator(artifact, backend="paddle")`: the Paddle Layer of the rank's
decoder graph) equals the interpreter: the same tokens and, at every step, logits within 1e-5 of
the largest |logit|, for a batch of two prompts of unequal length (left-padded: the pads' query
rows see no key, so the Paddle attention must give zeros there, not NaN).

Both comparisons are made where they mean something (ernie_ir.testing.stability):
- logits: a MoE router (or any discrete decision) within float32 noise of flipping would make
  Paddle's and numpy's BLAS pick different experts; `stable_positions` run on the interpreter's
  own decoder inputs of every step must find no such decision at a real (not pad) position, so
  the prompts here are ones whose routers are decided (asserted, machine independent);
- tokens: greedy picks the largest logit; each step's top-two gap must exceed the logits'
  tolerance by 10x (asserted), so equal tokens are a sound requirement.

The tiny models with tied embeddings mostly repeat their last token; ERNIE-3.5-SE's tiny model
and the LoRA adapter (random, non-zero) give diverse tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ernie_ir.generation import DecodeOptions, Generator
from ernie_ir.ir.weights import ArraySource, write_safetensors
from ernie_ir.load import load_input
from ernie_ir.passes.quant.config import find_targets
from ernie_ir.targets.compile import CompileOptions, compile_model
from ernie_ir.testing.stability import stable_positions

pytest.importorskip("paddle")

PROMPTS = [[5, 17, 300, 42, 9, 88, 7], [11, 600, 3]]
OPTIONS = DecodeOptions(max_new_tokens=5, keep_logits=True)
REL = 1e-5
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("ernie-4.5-0.3b@tiny", {}),
    "moe-wint8mix": ("ernie-4.5-21b-a3b@tiny", {"quant": "wint8mix"}),
    "se": ("ernie-3.5-se-3b@tiny", {}),
    "gpt": ("gpt-345m@tiny", {}),
    "lora-wint8mix": ("ernie-4.5-0.3b@tiny", {"quant": "wint8mix", "lora": True}),
}


def write_adapter(folder: Path, model: str) -> Path:
    """A paddleformers-style adapter with random non-zero A and B on every o_proj and down_proj
    (LoRA's own init has B = 0, which would not change a single logit)."""
    rng = np.random.default_rng(3)
    tensors = []
    for t in find_targets(load_input(model)):
        if t.path.endswith(("o_proj", "down_proj")):
            v = t.node.inputs[t.index]
            k, n = v.type.shape[-2:]
            key = "model." + t.path.removeprefix("ernie.")
            for which, shape in (("lora_A", (k, 4)), ("lora_B", (4, n))):
                values = rng.standard_normal(shape).astype(np.float32) * 0.3
                tensors.append((f"{key}.{which}", ArraySource(values)))
    folder.mkdir()
    (folder / "lora_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    return folder


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    model, kw = CASES[name]
    tmp = tmp_path_factory.mktemp(f"generate-{name}")
    kw = dict(kw)
    if kw.pop("lora", False):
        kw["lora_adapter"] = write_adapter(tmp / "adapter", model)
    compile_model(model, "cuda", CompileOptions(out=tmp / "art", **kw))
    return name, tmp / "art"


def recorded(gen: Generator) -> list[dict[str, np.ndarray]]:
    """Every step's feeds of `gen`'s decoder, from now on."""
    feeds: list[dict[str, np.ndarray]] = []
    step = gen.decoder.step

    def record(f: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        feeds.append({k: np.array(v) for k, v in f.items()})
        return step(f)

    gen.decoder.step = record
    return feeds


def undecided(graph: Any, feeds: dict[str, np.ndarray]) -> list[str]:
    """The decisions (a router's top-k, a quantizer's rounding) of one decoder call within float32
    noise of flipping at a real token (pads are never attended to: their decisions do not count)."""
    stable = stable_positions(graph, feeds)
    s = feeds["input_ids"].shape[1]
    real = feeds["attention_mask"][:, -s:] != 0
    found = [f"{node} at (row, position) {(b, q)}" for node, pairs in stable.unstable.items()
             for b, q in pairs if real[b, q]]
    if stable.mixing and stable.unstable:  # a node mixing positions would carry a pad's flip along
        found.append(f"{stable.mixing[0]} mixes positions")
    return found


def test_paddle_generate_equals_interpreter(case: tuple[str, Path]) -> None:
    name, art = case
    interp = Generator(art, backend="interpreter")
    feeds = recorded(interp)
    ref = interp.generate(PROMPTS, OPTIONS, ignore_eos=True)
    graph = interp.decoder.graphs[0]
    for i, f in enumerate(feeds):
        assert not undecided(graph, f), f"{name} step {i}: pick other prompts: {undecided(graph, f)[:3]}"

    got = Generator(art, backend="paddle").generate(PROMPTS, OPTIONS, ignore_eos=True)
    assert len(got.step_logits) == len(ref.step_logits) == OPTIONS.max_new_tokens
    for i, (p, r) in enumerate(zip(got.step_logits, ref.step_logits, strict=True)):
        scale = float(np.abs(r).max())
        assert np.isfinite(p).all(), f"{name} step {i}: non-finite logits"
        err = float(np.abs(p - r).max()) / scale
        assert err <= REL, f"{name} step {i}: logits differ by {err:.2e} of the largest |logit|"
        top = np.sort(r, axis=-1)
        gap = float((top[:, -1] - top[:, -2]).min()) / scale
        assert gap > 10 * 2 * REL, f"{name} step {i}: a near-tie ({gap:.1e}): pick other prompts"
    assert got.new_tokens == ref.new_tokens
    assert got.finish_reasons == ref.finish_reasons == ["length", "length"]
    if name in ("se", "lora-wint8mix"):  # diverse output: not the last token repeated
        assert any(len(set(n)) > 1 for n in got.new_tokens), got.new_tokens


def test_paddle_generate_ends_rows_like_the_interpreter(tmp_path: Path) -> None:
    """An EOS id (the first token row 1 generates) ends that row only; the other row goes on,
    fed pads that no query attends to."""
    art = tmp_path / "art"
    compile_model("ernie-3.5-se-3b@tiny", "cuda", CompileOptions(out=art))
    interp = Generator(art, backend="interpreter")
    first = interp.generate(PROMPTS, OPTIONS, ignore_eos=True).new_tokens[1][0]
    options = DecodeOptions(max_new_tokens=5, keep_logits=True, eos_ids=frozenset({first}))
    ref = interp.generate(PROMPTS, options)
    got = Generator(art, backend="paddle").generate(PROMPTS, options)
    assert ref.finish_reasons[1] == "eos" and ref.new_tokens[1] == [first]
    assert got.new_tokens == ref.new_tokens and got.finish_reasons == ref.finish_reasons
    assert len(got.step_logits) == len(ref.step_logits) == options.max_new_tokens  # row 0 went on
    for i, (p, r) in enumerate(zip(got.step_logits, ref.step_logits, strict=True)):
        live = [b for b in range(len(PROMPTS)) if i < len(ref.new_tokens[b])]  # an ended row's are unused
        assert np.abs(p[live] - r[live]).max() <= REL * np.abs(r[live]).max()
