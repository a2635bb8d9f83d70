"""lora-import against paddleformers' LoRAModel (tests/reference/pf_lora.py, float32 on CPU).

The reference builds a random dense ERNIE 4.5, wraps it in LoRAModel with
non-zero adapters, saves base and adapter, and records its logits. We load
the saved base with our frontend, import the adapter folder and compare
logits; then merge and compare again. GQA (the qkv lora_B columns need the
per-KV-group -> plain reorder) and MHA (no reorder) are both checked.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _quant_testkit import logits, run_reference

from ernie_ir.formats.paddleformers_adapter import read_adapter
from ernie_ir.frontends import load_model
from ernie_ir.ir.weights import SafetensorsFile, write_safetensors
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.lora import import_adapter as lora_import_module
from ernie_ir.passes.lora.adapter import AdapterTensor, LoraAdapter
from ernie_ir.passes.lora.import_adapter import NO_READER
from ernie_ir.passes.lora.insert import LoraError
from ernie_ir.passes.quant.config import find_targets

TOL = 5e-5  # max abs logit error / max |logit|: library noise is ~1e-6, a layout slip is ~1


def _max_rel(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(out - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=[2, 4], ids=["gqa", "mha"])
def pf_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"pf_lora_kv{request.param}")
    spec = {"num_key_value_heads": request.param, "r": 4, "lora_alpha": 8}
    run_reference("pf_lora.py", spec, out)
    return out


@pytest.mark.reference
@pytest.mark.slow
def test_imported_adapter_matches_paddleformers_logits(pf_run: Path) -> None:
    ids = np.load(pf_run / "input_ids.npy")
    ref, ref_base = np.load(pf_run / "logits.npy"), np.load(pf_run / "base_logits.npy")
    assert np.abs(ref - ref_base).max() > 0.1  # the adapter matters, so the check can fail
    g = load_model(str(pf_run / "base"))
    assert _max_rel(logits(g, ids), ref_base) < TOL
    result = run_pipeline(g, f'lora-import{{path="{pf_run / "adapter"}"}}', adapter_reader=read_adapter)
    assert result.stats["1:lora-import"] == {"adapters": 8}
    err = _max_rel(logits(g, ids), ref)
    print(f"\n[cross-check] lora-import vs paddleformers LoRAModel ({pf_run.name}): max rel {err:.2e}")
    assert err < TOL
    node = next(n for n in g if n.op == "lora")
    assert node.attrs.scale == 2.0  # type: ignore[attr-defined]
    assert all(p.trainable == p.name.endswith((".lora_A", ".lora_B")) for p in g.params.values())
    run_pipeline(g, "lora-merge")
    assert _max_rel(logits(g, ids), ref) < TOL


@pytest.mark.reference
@pytest.mark.slow
def test_gqa_needs_the_qkv_reorder_mha_does_not(pf_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = json.loads((pf_run / "adapter" / "config.json").read_text())
    monkeypatch.setattr(lora_import_module, "kv_group_to_plain", lambda b, *a: b)
    g = load_model(str(pf_run / "base"))
    run_pipeline(g, f'lora-import{{path="{pf_run / "adapter"}"}}', adapter_reader=read_adapter)
    err = _max_rel(logits(g, np.load(pf_run / "input_ids.npy")), np.load(pf_run / "logits.npy"))
    if cfg["num_key_value_heads"] < cfg["num_attention_heads"]:
        assert err > 1e-2  # without the reorder the q, k, v deltas land in the wrong columns
    else:
        assert err < TOL  # MHA: per KV group is per head, which is also our layout


@pytest.mark.reference
@pytest.mark.slow
def test_adapter_over_a_weight_only_base(pf_run: Path) -> None:
    g = load_model(str(pf_run / "base"))
    run_pipeline(g, f'wint8,lora-import{{path="{pf_run / "adapter"}"}}', adapter_reader=read_adapter)
    assert {n.inputs[0].producer.op for n in g if n.op == "lora"} == {"weight_only_linear"}  # type: ignore[union-attr]
    ref = np.load(pf_run / "logits.npy")
    assert _max_rel(logits(g, np.load(pf_run / "input_ids.npy")), ref) < 0.05


def _copy_adapter(pf_run: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(pf_run / "adapter", dst)
    (f,) = dst.glob("*.safetensors")
    st = SafetensorsFile(f)
    tensors = {k: np.array(st.read(k)) for k in st}
    f.unlink()
    write_safetensors(dst / "peft_model-00001-of-00001.safetensors", list(edit(tensors).items()))
    return dst


@pytest.mark.reference
@pytest.mark.slow
def test_adapter_whose_shapes_do_not_fit(pf_run: Path, tmp_path: Path) -> None:
    def widen(t: dict) -> dict:
        k = "model.layers.1.mlp.down_proj.lora_A"
        t[k] = np.zeros((t[k].shape[0] + 1, t[k].shape[1]), np.float32)
        return t

    bad = _copy_adapter(pf_run, tmp_path / "a", widen)
    with pytest.raises(LoraError, match=r"adapter for ernie\.layers\.1\.mlp\.down_proj has lora_A "
                                        r"\[97, 4\] .*needs \[96, 4\] and \[4, 64\]"):
        run_pipeline(load_model(str(pf_run / "base")), f'lora-import{{path="{bad}"}}',
                     adapter_reader=read_adapter)


@pytest.mark.reference
@pytest.mark.slow
def test_adapter_for_a_layer_the_model_lacks(pf_run: Path, tmp_path: Path) -> None:
    def rename(t: dict) -> dict:
        t["model.layers.7.mlp.down_proj.lora_A"] = t.pop("model.layers.1.mlp.down_proj.lora_A")
        return t

    bad = _copy_adapter(pf_run, tmp_path / "a", rename)
    with pytest.raises(LoraError, match=r"targets ernie\.layers\.7\.mlp\.down_proj, which is not a linear"):
        run_pipeline(load_model(str(pf_run / "base")), f'lora-import{{path="{bad}"}}',
                     adapter_reader=read_adapter)


def test_missing_or_malformed_adapter_folders(tmp_path: Path) -> None:
    g = load_model("ernie-4.5-0.3b@tiny")
    with pytest.raises(LoraError, match="does not exist"):
        run_pipeline(g, f'lora-import{{path="{tmp_path / "nope"}"}}', adapter_reader=read_adapter)
    with pytest.raises(LoraError, match=r"not a LoRA adapter folder \(no lora_config\.json\)"):
        run_pipeline(g, f'lora-import{{path="{tmp_path}"}}', adapter_reader=read_adapter)
    (tmp_path / "lora_config.json").write_text("{")
    with pytest.raises(LoraError, match="not valid JSON"):
        run_pipeline(g, f'lora-import{{path="{tmp_path}"}}', adapter_reader=read_adapter)
    (tmp_path / "lora_config.json").write_text('{"r": 4}')
    with pytest.raises(LoraError, match=r"no adapter weights \(\*\.safetensors\)"):
        run_pipeline(g, f'lora-import{{path="{tmp_path}"}}', adapter_reader=read_adapter)


def test_without_an_adapter_reader_lora_import_stops_in_one_line(tmp_path: Path) -> None:
    """The pass reads no file: its caller hands it a reader (compile_model, the CLI, the planner,
    export and the golden harness give the paddleformers one), as it hands fp8 an evaluator."""
    g = load_model("ernie-4.5-0.3b@tiny")
    with pytest.raises(LoraError) as info:
        run_pipeline(g, f'lora-import{{path="{tmp_path / "nope"}"}}')
    message = str(info.value)
    assert "\n" not in message and message == NO_READER
    assert "needs an adapter reader" in message
    assert "adapter_reader=ernie_ir.formats.paddleformers_adapter.read_adapter" in message
    assert not any(n.op == "lora" for n in g)


def test_lora_import_attaches_what_its_reader_returns() -> None:
    """Any reader will do: the pass renames the module names (`prefix_map`), matches them to the
    graph's linears, and reorders a qkv lora_B only when the reader says it is per KV group."""
    g = load_model("ernie-4.5-0.3b@tiny")
    sites = {t.path: t for t in find_targets(g)}
    qkv, down = "ernie.layers.0.self_attn.qkv_proj", "ernie.layers.1.mlp.down_proj"
    rng = np.random.default_rng(0)
    tensors, want = [], {}
    for path in (qkv, down):
        k, n = sites[path].param.type.shape  # type: ignore[union-attr]
        a, b = rng.standard_normal((k, 2), np.float32), rng.standard_normal((2, n), np.float32)
        module = "model." + path.removeprefix("ernie.")
        tensors += [AdapterTensor(f"{module}.lora_A", module, "lora_A", a),
                    AdapterTensor(f"{module}.lora_B", module, "lora_B", b)]
        want[path] = (a, b)
    asked: list[Path] = []

    def reader(folder: Path) -> LoraAdapter:
        asked.append(folder)
        return LoraAdapter("in-memory", rank=2, scale=0.5, dropout=0.0, tensors=tuple(tensors))

    result = run_pipeline(g, 'lora-import{path="somewhere"}', adapter_reader=reader)
    assert asked == [Path("somewhere")] and result.stats["1:lora-import"] == {"adapters": 2}
    for path, (a, b) in want.items():
        np.testing.assert_array_equal(g.params[f"{path}.lora_A"].read(), a)
        np.testing.assert_array_equal(g.params[f"{path}.lora_B"].read(), b)  # plain: as given
    assert {n.attrs.scale for n in g if n.op == "lora"} == {0.5}  # type: ignore[attr-defined]

    stray = AdapterTensor("x.lora_A", "model.layers.9.mlp.down_proj", "lora_A", want[down][0])
    bad = LoraAdapter("in-memory", rank=2, scale=0.5, dropout=0.0, tensors=(stray,))
    with pytest.raises(LoraError, match=r"^in-memory: adapter 'x\.lora_A' targets "
                                        r"ernie\.layers\.9\.mlp\.down_proj, which is not a linear"):
        run_pipeline(load_model("ernie-4.5-0.3b@tiny"), 'lora-import{path="p"}', adapter_reader=lambda _: bad)
