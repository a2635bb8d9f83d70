"""Merged deploys: `--merge-lora` folds a trained adapter into the base before quantizing and
splitting, and `ernie-ir export` writes the merged float model as a published checkpoint.

The references here are written from the facts (REFERENCE.md 4, 8, 11), not with the code under
test: the adapter files are read with bare safetensors, GQA qkv lora_B columns are taken back from
paddleformers' per-KV-group order in numpy, the merge is `bf16(f32(W) + (f32(A) @ f32(B)) *
f32(scale))` in numpy (paddleformers' mergekit: float32, one cast back), and weight-only
quantization is Paddle's per output channel rule (scale = bf16(absmax / qmax), q =
clip(round_half_away(w / scale))). paddleformers itself (the `pf` reference environment) loads
the exported folder and computes the logits. The adapters are written with
`ernie_ir.formats.paddleformers_adapter.write_adapter` (the format module whose reader
`lora-import` is given).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from _cli_kit import cli, user_error
from _quant_testkit import run_reference
from safetensors import safe_open

from ernie_ir.formats.fastdeploy import load_fastdeploy_checkpoint, merge_ranks
from ernie_ir.formats.paddleformers_adapter import read_adapter, write_adapter
from ernie_ir.ir.storage import save_graph
from ernie_ir.load import load_input
from ernie_ir.passes import run_pipeline
from ernie_ir.runtime.interpreter import run_graph
from ernie_ir.targets import verify_artifact

DENSE, MOE = "ernie-4.5-0.3b@tiny", "ernie-4.5-21b-a3b@tiny"  # MoE: GQA 10 / 2 heads, 16 experts
MOE_TP2 = "ernie-4.5-300b-a47b@tiny"  # MoE whose tp 2 shards all pack for sm70 (1 kv head, replicated)
BF16 = ml_dtypes.bfloat16
IDS = np.array([[1, 5, 900, 77, 3, 1000, 12]], dtype=np.int64)
TOL = 5e-5  # max abs logit error / max |logit|: library noise ~1e-6, a layout slip ~1


def raw(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def make_adapter(model: str, folder: Path, *, rank: int = 4, seed: int = 0) -> Path:
    """A paddleformers adapter folder for `model` (every ERNIEKit target, routed experts included)
    with random A and B large enough to move most bf16 weights."""
    graph = load_input(model)
    run_pipeline(graph, f"lora{{rank={rank}}}")
    rng = np.random.default_rng(seed)
    values = {name: (rng.standard_normal(p.type.shape) * (0.5 if name.endswith("lora_A") else 0.05))
              .astype(np.float32) for name, p in graph.params.items() if name.endswith(("lora_A", "lora_B"))}
    write_adapter(folder, graph, values)
    return folder


# -- the references -----------------------------------------------------------------------------


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            keys = st.keys()
            out.update({k: st.get_tensor(k) for k in keys})
    return out


def numpy_deltas(adapter: Path) -> dict[str, np.ndarray]:
    """(f32(A) @ f32(B)) * f32(scale) of every adapted weight, in numpy, from the files: by our
    param names (`ernie.` prefix; routed experts stacked [E, in, out]), qkv columns plain."""
    cfg = json.loads((adapter / "config.json").read_text())
    lcfg = json.loads((adapter / "lora_config.json").read_text())
    scale = np.float32(lcfg["scaling"])
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, t in read_safetensors(adapter).items():
        module, which = key.rsplit(".", 1)
        pairs.setdefault("ernie." + module.removeprefix("model."), {})[which] = t
    deltas: dict[str, dict[int, np.ndarray]] = {}
    for module, ab in pairs.items():
        a, b = ab["lora_A"].astype(np.float32), ab["lora_B"].astype(np.float32)
        if module.endswith("qkv_proj") and nkv < nh:  # [q_g | k_g | v_g] per KV group -> [Q | K | V]
            per = b.reshape(b.shape[0], nkv, (nh // nkv + 2) * hd)
            q = per[..., : nh // nkv * hd].reshape(b.shape[0], -1)
            k = per[..., nh // nkv * hd: (nh // nkv + 1) * hd].reshape(b.shape[0], -1)
            v = per[..., (nh // nkv + 1) * hd:].reshape(b.shape[0], -1)
            b = np.concatenate([q, k, v], axis=1)
        head, _, tail = module.rpartition(".")
        expert_head, _, e = head.rpartition(".")
        if expert_head.endswith(".mlp.experts") and e.isdigit():
            deltas.setdefault(f"{expert_head}.{tail}.weight", {})[int(e)] = (a @ b) * scale
        else:
            deltas.setdefault(f"{module}.weight", {})[-1] = (a @ b) * scale
    return {name: per[-1] if -1 in per else np.stack([per[e] for e in range(len(per))])
            for name, per in deltas.items()}


def numpy_merged(model: str, adapter: Path) -> dict[str, np.ndarray]:
    """The base's params with the adapter merged as paddleformers' mergekit does:
    dtype(f32(W) + delta), every tensor in its own dtype."""
    merged = {n: np.asarray(p.read()) for n, p in load_input(model).params.items()}
    for name, delta in numpy_deltas(adapter).items():
        merged[name] = (merged[name].astype(np.float32) + delta).astype(merged[name].dtype)
    return merged


def quant_dequant(w: np.ndarray, bits: int) -> np.ndarray:
    """Paddle's per-output-channel weight-only quantization of w [..., in, out], dequantized."""
    qmax = np.float32(2 ** (bits - 1) - 1)
    wf = w.astype(np.float32)
    scale = (np.abs(wf).max(axis=-2, keepdims=True) / qmax).astype(BF16).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)
    t = (wf / safe).astype(np.float64)  # the float32 quotient; rounding half away from zero, exactly
    q = np.clip(np.sign(t) * np.floor(np.abs(t) + 0.5), -qmax, qmax).astype(np.float32)
    return q * scale


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    # the dense adapter as a training run leaves it: checkpoints/run-1-step-4/adapter/
    return {DENSE: make_adapter(DENSE, root / "run-1-step-4" / "adapter", seed=1).parent,
            MOE: make_adapter(MOE, root / "moe", seed=2),
            MOE_TP2: make_adapter(MOE_TP2, root / "moe2", seed=3)}


# -- the merge itself ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", [DENSE, MOE])
def test_merge_is_exact_in_float32_and_rounds_once(model: str, adapters: dict[str, Path]) -> None:
    adapter = adapters[model]
    graph = load_input(model)
    result = run_pipeline(graph, f'lora-import{{path="{adapter}"}},lora-merge',  # a checkpoint folder too
                          adapter_reader=read_adapter)
    assert result.stats["2:lora-merge"]["merged"] > 0
    assert not any(n.op in ("lora", "moe_experts_lora") for n in graph)
    folder = adapter if (adapter / "lora_config.json").exists() else adapter / "adapter"
    want = numpy_merged(model, folder)
    base = {n: p.read() for n, p in load_input(model).params.items()}
    assert set(graph.params) == set(want)
    moved = 0
    for name, p in graph.params.items():
        got = p.read()
        assert got.dtype == want[name].dtype == base[name].dtype and got.shape == want[name].shape, name
        assert raw(got) == raw(want[name]), f"{name}: not bf16(f32(W) + (f32(A) @ f32(B)) * scale)"
        moved += int(np.sum(got != base[name]))
    assert moved > 1000  # the adapter moves the weights: a merge that did nothing would fail
    # The check tells one rounding from two: a merge in bf16 arithmetic (the delta rounded to bf16
    # before the sum is) gives other bits on some elements, so it would fail above.
    differ = 0
    for name, delta in numpy_deltas(folder).items():
        twice = (base[name].astype(np.float32) + delta.astype(BF16).astype(np.float32)).astype(BF16)
        differ += int(np.sum(twice.view(np.uint16) != want[name].view(np.uint16)))
    assert differ > 0


# -- --merge-lora into a FastDeploy checkpoint --------------------------------------------------


def _compile(capsys: pytest.CaptureFixture[str], model: str, out: Path, *extra: str, tp: int = 2) -> Path:
    code, _, err = cli(capsys, "compile", model, "--target", "cuda", "--cuda-arch", "70", "--quant",
                       "wint8mix", "--tp", str(tp), "--emit", "fastdeploy", "--out", str(out), *extra)
    assert code == 0, err
    return out


def _fd_files(art: Path) -> dict[str, object]:
    """The FastDeploy checkpoint's config (without `num_nextn_predict_layers`, which an export sets
    to 0: it writes no MTP head) and each rank's weight bytes."""
    config = json.loads((art / "config.json").read_text())
    config.pop("num_nextn_predict_layers", None)
    files: dict[str, object] = {"config.json": config}
    for rank in sorted(art.glob("rank*")):
        files[rank.name] = (rank / "model.safetensors").read_bytes()
    return files


@pytest.mark.slow
@pytest.mark.parametrize("model, tp", [(DENSE, 2), (MOE_TP2, 1), (MOE, 1)])
def test_merged_fastdeploy_checkpoint(model: str, tp: int, adapters: dict[str, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    adapter = adapters[model]
    art = _compile(capsys, model, tmp_path / "merged", "--lora-adapter", str(adapter), "--merge-lora", tp=tp)
    manifest = verify_artifact(art)
    passes = [p.split("{")[0] for p in manifest.pipeline.split(",")]
    assert passes[:2] == ["lora-import", "lora-merge"] and ("split" in passes) == (tp > 1)
    assert passes.index("lora-merge") < min(passes.index(p) for p in passes if "quant" in p)
    record = manifest.lora_adapter
    assert record["merged"] is True and "lora_config.json" in record["files"]
    folder = adapter if (adapter / "lora_config.json").exists() else adapter / "adapter"
    assert Path(record["path"]) == folder  # a training checkpoint folder resolves to its adapter/
    # (1) the same bytes as exporting the merged float model and compiling that
    code, stdout, err = cli(capsys, "export", model, "--lora-adapter", str(adapter), "--out",
                            str(tmp_path / "float"))
    assert code == 0 and "merged" in stdout, err
    ref = _compile(capsys, str(tmp_path / "float"), tmp_path / "ref", tp=tp)
    assert _fd_files(art) == _fd_files(ref)
    # (2) read back as FastDeploy would: the quantized merged weights, exactly
    ckpt = load_fastdeploy_checkpoint(art)
    q = ckpt.quantization
    dense_bits = {"wint8": 8, "wint4": 4}[q.get("dense_quant_type", q["quantization"])]
    moe_bits = {"wint8": 8, "wint4": 4}[q.get("moe_quant_type", q["quantization"])]
    got = merge_ranks(ckpt)
    want = numpy_merged(model, folder)
    base = {n: p.read() for n, p in load_input(model).params.items()}
    # MoE: the bf16 folder FastDeploy quantizes at load, each weight on the grid of its code and scale
    on_grid = not q["is_quantized"]
    with safe_open(str(art / "rank0" / "weights.safetensors"), framework="numpy") as st:
        keys = st.keys()
    quantized = {k.removesuffix(".quant_weight") + ".weight" for k in keys if k.endswith(".quant_weight")}
    assert quantized
    changed = 0
    for key, value in got.items():
        name, e = key, None
        parts = key.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            e, name = int(parts[i + 1]), ".".join(parts[: i + 1] + parts[i + 2:])
        w = want[name] if e is None else want[name][e]
        if key in quantized:
            bits = moe_bits if e is not None else dense_bits
            expect = quant_dequant(w, bits)
            if on_grid:  # code x absmax / bound in bf16: within 2^-7 of code x scale (grid_weight)
                value = value.astype(np.float32)
                assert np.all(np.abs(value - expect) <= np.abs(expect) * 2.0 ** -7), key
            else:
                assert np.array_equal(value, expect), f"{key}: not the quantized merged weight"
            b = base[name] if e is None else base[name][e]
            changed += not np.allclose(value, quant_dequant(b, bits), rtol=2.0 ** -7, atol=0)
        else:
            assert raw(value) == raw(w), key
    assert changed > 0  # the merge reached the quantized weights


# -- the model's own adapters, and inputs that cannot merge ---------------------------------------


def test_merge_lora_on_a_graph_with_adapters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = load_input(DENSE)
    run_pipeline(graph, "lora{rank=2}")
    rng = np.random.default_rng(3)
    for name, p in graph.params.items():
        if name.endswith("lora_B"):
            p.set_data((rng.standard_normal(p.type.shape) * 0.05).astype(np.float32))
    folder = tmp_path / "with-lora"
    save_graph(graph, folder)
    art = _compile(capsys, str(folder), tmp_path / "a", "--merge-lora")
    assert "lora-merge{require=true}" in verify_artifact(art).pipeline
    code, stdout, err = cli(capsys, "export", str(folder), "--out", str(tmp_path / "f"))
    assert code == 0 and "adapted layer(s) merged" in stdout, err
    assert _fd_files(art) == _fd_files(_compile(capsys, str(tmp_path / "f"), tmp_path / "b"))
    code, stdout, err = cli(capsys, "show", str(folder), "--merge-lora")
    assert code == 0 and "lora_A" not in stdout and "lora-merge" not in err


def test_pipeline_order(adapters: dict[str, Path]) -> None:
    from ernie_ir.passes.quant.cli_flags import QuantFlagError, pipeline_for

    ckpt = adapters[DENSE]  # a training checkpoint folder: its adapter/ is imported
    imported = f'lora-import{{path="{ckpt / "adapter"}"}}'
    assert pipeline_for("wint8mix", None, None, None, None, ckpt) == f"wint8mix,{imported}"
    assert pipeline_for("wint8mix", None, None, None, None, ckpt, merge_lora=True) == \
        f"{imported},lora-merge,wint8mix"
    assert pipeline_for("wint4", None, None, None, None, None, merge_lora=True) == \
        "lora-merge{require=true},wint4"
    with pytest.raises(QuantFlagError, match="fresh one whose B is zero"):
        pipeline_for(None, None, None, 16.0, None, None, merge_lora=True)


@pytest.mark.parametrize("args, message", [
    (["--merge-lora"], "no LoRA adapter to merge"),
    (["--merge-lora", "--lora-rank", "8"], "fresh one whose B is zero"),
    (["--merge-lora", "--lora-adapter", "{dense}", "--mode", "training"],
     "--mode training keeps the adapter"),
    (["--merge-lora", "--lora-adapter", "{moe}"], r"targets ernie\.layers\.\S+, which is not a linear"),
    (["--merge-lora", "--lora-adapter", "{nope}"], "not a LoRA adapter folder"),
])
def test_bad_merges_are_one_line(args: list[str], message: str, adapters: dict[str, Path], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    import re

    args = [a.format(dense=adapters[DENSE], moe=adapters[MOE], nope=tmp_path) for a in args]
    line = user_error(capsys, "compile", DENSE, "--target", "cuda", "--out", str(tmp_path / "a"), *args)
    assert re.search(message, line), line
    assert not (tmp_path / "a").exists()


def test_adapter_shapes_that_do_not_fit(adapters: dict[str, Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The dense adapter (hidden 64, head_dim 16, FFN 192) on ernie-4.5-300b-a47b@tiny, whose
    dense layers are 64 wide but head_dim 8, FFN 224: one line naming the module and both shapes."""
    line = user_error(capsys, "compile", "ernie-4.5-300b-a47b@tiny", "--target", "cuda", "--merge-lora",
                      "--lora-adapter", str(adapters[DENSE]), "--out", str(tmp_path / "a"))
    assert "adapter for ernie.layers." in line and "has lora_A [" in line and "needs [" in line, line


def test_merge_into_a_quantized_base_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = load_input(DENSE)
    run_pipeline(graph, "wint8,lora{rank=2}")
    save_graph(graph, tmp_path / "q")
    line = user_error(capsys, "compile", str(tmp_path / "q"), "--target", "cuda", "--merge-lora",
                      "--out", str(tmp_path / "a"))
    assert "quantized base" in line


# -- export: the merged float checkpoint, read back and loaded by paddleformers --------------------


@pytest.mark.slow
def test_export_reads_back_bit_for_bit(adapters: dict[str, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "moe-merged"
    code, _, err = cli(capsys, "export", MOE, "--lora-adapter", str(adapters[MOE]), "--out", str(out))
    assert code == 0, err
    merged = load_input(MOE)
    run_pipeline(merged, f'lora-import{{path="{adapters[MOE]}"}},lora-merge', adapter_reader=read_adapter)
    back = load_input(str(out))
    assert back.metadata["layout"] == "paddle" and set(back.params) == set(merged.params)
    for name, p in merged.params.items():
        a, b = p.read(), back.params[name].read()
        assert a.dtype == b.dtype and raw(a) == raw(b), name
    with safe_open(str(out / "model.safetensors"), framework="numpy") as st:
        keys = set(st.keys())
    assert "ernie.layers.1.mlp.experts.15.down_proj.weight" in keys  # one key per expert, as published
    assert not any("lora" in k or ".experts.up_gate" in k or ".experts.down" in k for k in keys)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    record = json.loads((out / "ernie_ir_export.json").read_text())
    assert record["lora_adapter"]["merged"] and record["files"]["model.safetensors"]
    # replaced only with --force, and only a folder export wrote
    assert "already exists" in user_error(capsys, "export", MOE, "--out", str(out))
    assert cli(capsys, "export", MOE, "--out", str(out), "--force")[0] == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert "ernie-ir export did not write it" in user_error(capsys, "export", MOE, "--out",
                                                            str(tmp_path / "other"), "--force")
    assert "not ERNIE 4.5" in user_error(capsys, "export", "gpt-345m@tiny", "--out", str(tmp_path / "g"))
    assert "not a weight of the published float checkpoint" in user_error(
        capsys, "export", MOE, "--pipeline", "wint8", "--out", str(tmp_path / "q"))
    assert not (tmp_path / "g").exists() and not (tmp_path / "q").exists()


@pytest.mark.reference
@pytest.mark.slow
def test_export_loads_in_paddleformers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """paddleformers' LoRAModel (adapter on) and paddleformers loading our merged export agree, and
    both agree with our graph; tied MQA, where paddleformers' in-memory layout is the published one."""
    pf = run_reference("pf_lora.py", {"num_key_value_heads": 1, "head_dim": 16, "tie_word_embeddings": True,
                                      "r": 4, "lora_alpha": 8}, tmp_path / "pf_lora")
    ids = np.load(pf / "input_ids.npy")
    with_adapter, base_logits = np.load(pf / "logits.npy"), np.load(pf / "base_logits.npy")
    assert np.abs(with_adapter - base_logits).max() > 0.1  # the adapter matters
    out = tmp_path / "merged"
    code, _, err = cli(capsys, "export", str(pf / "base"), "--lora-adapter", str(pf / "adapter"), "--out",
                       str(out))
    assert code == 0, err
    loaded = run_reference("pf_ernie_dense.py", {"load_from": str(out), "input_ids": ids.tolist()},
                           tmp_path / "pf_loaded")
    meta = json.loads((loaded / "meta.json").read_text())
    assert meta["layout"] == "paddle" and meta["state_equal_file"] is True
    theirs = np.load(loaded / "logits.npy")
    ours = run_graph(load_input(str(out)), {"input_ids": ids})["logits"]
    scale = float(np.abs(with_adapter).max())
    err_pf = float(np.abs(theirs - with_adapter).max()) / scale
    err_ours = float(np.abs(ours - theirs).max()) / scale
    print(f"\n[cross-check] paddleformers on our merged export vs its LoRAModel: {err_pf:.2e}; "
          f"ours vs paddleformers on the export: {err_ours:.2e}")
    assert err_pf < TOL and err_ours < TOL
    merged = load_input(str(pf / "base"))
    run_pipeline(merged, f'lora-import{{path="{pf / "adapter"}"}},lora-merge', adapter_reader=read_adapter)
    back = load_input(str(out))
    for name, p in merged.params.items():
        assert raw(p.read()) == raw(back.params[name].read()), name
    shutil.rmtree(loaded / "loaded_ckpt", ignore_errors=True)
