"""write_adapter: trained LoRA adapters written as paddleformers adapter folders.

- Round trip: adapters with random non-zero values, written and attached again with
  `lora-import`, come back bit for bit (values, dtype, scale) and give equal logits: dense
  ERNIE 4.5 with GQA (whose qkv lora_B columns are reordered per KV group and back), MQA,
  MoE (experts unstacked and stacked again), GPT, bf16 adapters, rsLoRA with an odd rank.
- The folder itself: keys, the per-KV-group qkv order (built here independently), experts,
  index, lora_config.json and config.json fields.
- A rank graph of a split (tp=2, ep=2) with the merged values writes the same bytes.
- Cross-check with paddleformers (tests/reference/pf_lora_load.py, float32 on CPU): it builds
  and saves a random base, we load that base, add LoRA with random values and write the
  adapter, and paddleformers' `LoRAModel.from_pretrained(base, our folder)` loads it. Dense
  GQA: its logits equal ours (and are wrong without the qkv reorder). MoE: paddleformers'
  MoE forward has no CPU kernel, so its merged weights (`get_merge_state_dict`) are
  compared with ours after lora-merge instead.
"""

from __future__ import annotations

import filecmp
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _quant_testkit import logits, run_reference, token_ids

from ernie_ir.formats import paddleformers_adapter as pfa
from ernie_ir.formats.paddleformers_adapter import adapter_params, graph_adapters, read_adapter, write_adapter
from ernie_ir.frontends import load_model
from ernie_ir.frontends.builtins import builtin_config
from ernie_ir.frontends.config import parse_config
from ernie_ir.frontends.loader import GeneratedWeights, build_graph
from ernie_ir.ir import DType, Graph
from ernie_ir.ir.weights import SafetensorsFile
from ernie_ir.load import load_input
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.lora.insert import LoraError

DENSE = "ernie-4.5-0.3b"  # tiny: 8 heads : 1 KV head (MQA)
MOE = "ernie-4.5-21b-a3b"  # tiny: 10 heads : 2 KV heads, 16 experts, 2 shared
IDS = token_ids(1024, (2, 9), seed=3)
TOL = 5e-5  # max abs logit error / max |logit| against paddleformers (as test_lora_import)


def _tiny(name: str, **overrides: object) -> Graph:
    """A built-in tiny model with config overrides, built without metadata config (so head
    counts come from the graph's ops)."""
    cfg = {**builtin_config(name, "tiny"), **overrides}
    return build_graph(parse_config(cfg, f"{name}@tiny+{overrides}"), GeneratedWeights(0), name=name)


def _dense_gqa() -> Graph:
    return _tiny(DENSE, num_key_value_heads=2)


def _randomize(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Random non-zero values for every adapter param (A and B), set in the graph; returned by name."""
    rng = np.random.default_rng(seed)
    values: dict[str, np.ndarray] = {}
    for ad in graph_adapters(graph):
        for p in (ad.a, ad.b):
            values[p.name] = (0.1 * rng.standard_normal(p.type.shape) + 0.01).astype(p.type.dtype.numpy)
            p.set_data(values[p.name])
    return values


def _lora(make: Callable[[], Graph], pipeline: str, seed: int = 0) -> tuple[Graph, dict[str, np.ndarray]]:
    g = make()
    run_pipeline(g, pipeline)
    return g, _randomize(g, seed)


CASES: dict[str, tuple[Callable[[], Graph], str]] = {
    "dense-gqa": (_dense_gqa, "lora{rank=4}"),
    "dense-mqa-metadata": (lambda: load_model(f"{DENSE}@tiny"), "lora{rank=8,alpha=32}"),
    "moe-gqa-metadata": (lambda: load_model(f"{MOE}@tiny"), "lora{rank=4}"),
    "moe-gqa": (lambda: _tiny(MOE), 'lora{rank=2,targets=[".*"]}'),
    "dense-bf16": (_dense_gqa, "lora{rank=4,dtype=bf16}"),
    "dense-rslora-rank3": (_dense_gqa, "lora{rank=3,alpha=5,rslora=true}"),
    "gpt": (lambda: load_model("gpt-345m@tiny"), 'lora{rank=4,targets=[".*"]}'),
}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_exact(case: str, tmp_path: Path) -> None:
    make, pipeline = CASES[case]
    g, values = _lora(make, pipeline)
    files = write_adapter(tmp_path / "adapter", g, values)
    assert [f.name for f in files] == ["lora_config.json", "peft_model-00001-of-00001.safetensors",
                                       "peft_model.safetensors.index.json", "config.json"]
    back = make()
    run_pipeline(back, f'lora-import{{path="{tmp_path / "adapter"}"}}', adapter_reader=read_adapter)
    lora_names = {n for n in back.params if n.endswith((".lora_A", ".lora_B"))}
    assert lora_names == set(values)
    for name, want in values.items():
        p = back.params[name]
        assert p.type == g.params[name].type and p.source is not None
        got = np.asarray(p.source.read())
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
    assert [(n.op, n.attrs) for n in back if n.op in ("lora", "moe_experts_lora")] == \
           [(n.op, n.attrs) for n in g if n.op in ("lora", "moe_experts_lora")]  # scale exactly too
    np.testing.assert_array_equal(logits(back, IDS), logits(g, IDS))


def _grouped(b: np.ndarray, nh: int, nkv: int, hd: int) -> np.ndarray:
    """paddleformers' per-KV-group qkv columns, built column block by column block."""
    q, k, v = b[:, : nh * hd], b[:, nh * hd: (nh + nkv) * hd], b[:, (nh + nkv) * hd:]
    group = nh // nkv
    blocks = []
    for g in range(nkv):
        blocks += [q[:, (g * group + i) * hd: (g * group + i + 1) * hd] for i in range(group)]
        blocks += [k[:, g * hd: (g + 1) * hd], v[:, g * hd: (g + 1) * hd]]
    return np.concatenate(blocks, axis=1)


def _file(folder: Path) -> dict[str, np.ndarray]:
    st = SafetensorsFile(folder / "peft_model-00001-of-00001.safetensors")
    return {k: np.asarray(st.read(k)) for k in st}


def test_the_folder_dense_gqa(tmp_path: Path) -> None:
    g, values = _lora(_dense_gqa, "lora{rank=4,alpha=12}")
    write_adapter(tmp_path, g, values)
    tensors = _file(tmp_path)
    assert sorted(tensors) == sorted(f"model.layers.{layer}.{m}.{w}" for layer in (0, 1)
                                     for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_gate_proj",
                                               "mlp.down_proj") for w in ("lora_A", "lora_B"))
    b = values["ernie.layers.1.self_attn.qkv_proj.lora_B"]
    assert b.shape == (4, (8 + 2 * 2) * 16)
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.qkv_proj.lora_B"], _grouped(b, 8, 2, 16))
    assert not np.array_equal(_grouped(b, 8, 2, 16), b)  # GQA: the order really differs
    for key in ("self_attn.o_proj.lora_B", "mlp.up_gate_proj.lora_B", "mlp.down_proj.lora_A",
                "self_attn.qkv_proj.lora_A"):  # as they are: [in, r], [r, out], up_gate [gate | up]
        np.testing.assert_array_equal(tensors[f"model.layers.0.{key}"], values[f"ernie.layers.0.{key}"])
    index = json.loads((tmp_path / "peft_model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                     "weight_map": dict.fromkeys(tensors, "peft_model-00001-of-00001.safetensors"),
                     "type": "lora"}
    cfg = json.loads((tmp_path / "lora_config.json").read_text())
    assert {k: cfg[k] for k in ("r", "lora_alpha", "scaling", "rslora", "lora_dropout", "dtype",
                                "tensor_model_parallel_size", "merge_weights")} == {
        "r": 4, "lora_alpha": 12, "scaling": 3.0, "rslora": False, "lora_dropout": 0.0, "dtype": "float32",
        "tensor_model_parallel_size": 1, "merge_weights": False}
    patterns = cfg["target_modules"]
    assert all(any(re.fullmatch(p, k.rsplit(".", 1)[0]) for p in patterns) for k in tensors)
    base = json.loads((tmp_path / "config.json").read_text())
    assert {k: base.get(k) for k in ("architectures", "model_type", "hidden_size", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "intermediate_size",
                                     "num_hidden_layers", "vocab_size", "tie_word_embeddings")} == {
        "architectures": ["Ernie4_5ForCausalLM"], "model_type": "ernie4_5", "hidden_size": 64,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 192,
        "num_hidden_layers": 2, "vocab_size": 1024, "tie_word_embeddings": True}


def test_the_folder_moe_experts_and_targets(tmp_path: Path) -> None:
    g, values = _lora(lambda: load_model(f"{MOE}@tiny"), 'lora{rank=4,targets=[".*experts.*"]}')
    write_adapter(tmp_path, g, values)
    tensors = _file(tmp_path)
    stacked = values["ernie.layers.2.mlp.experts.down_proj.lora_B"]
    assert stacked.shape == (16, 4, 80)
    for e in (0, 7, 15):
        np.testing.assert_array_equal(tensors[f"model.layers.2.mlp.experts.{e}.down_proj.lora_B"], stacked[e])
    assert len(tensors) == 2 * (16 + 1) * 2 * 2  # MoE layers 1, 2 x (16 experts + shared) x 2 linears x A, B
    cfg = json.loads((tmp_path / "lora_config.json").read_text())
    assert cfg["target_modules"] == [r"model\.layers\.\d+\.mlp\.experts\.\d+\.up_gate_proj",
                                     r"model\.layers\.\d+\.mlp\.experts\.\d+\.down_proj",
                                     r"model\.layers\.\d+\.mlp\.shared_experts\.up_gate_proj",
                                     r"model\.layers\.\d+\.mlp\.shared_experts\.down_proj"]
    base = json.loads((tmp_path / "config.json").read_text())
    assert base["architectures"] == ["Ernie4_5_MoeForCausalLM"] and base["model_type"] == "ernie4_5_moe"
    assert base["moe_num_experts"] == 16 and base["num_key_value_heads"] == 2


def test_targets_that_would_match_a_module_without_adapter_are_spelled_out(tmp_path: Path) -> None:
    g, values = _lora(_dense_gqa, r'lora{rank=2,targets=["ernie\\.layers\\.1\\.mlp\\.down_proj"]}')
    write_adapter(tmp_path, g, values)
    cfg = json.loads((tmp_path / "lora_config.json").read_text())
    assert cfg["target_modules"] == [r"model\.layers\.1\.mlp\.down_proj"]


@pytest.mark.parametrize(("model", "split", "tp"), [
    ("dense", "split{tp=2,rank=1}", 2),
    ("moe", "split{tp=2,rank=0}", 2),
    ("moe", "split{ep=2,rank=1}", 1),
])
def test_a_rank_graph_writes_the_same_adapter(model: str, split: str, tp: int, tmp_path: Path) -> None:
    make = (lambda: load_model(f"{DENSE}@tiny")) if model == "dense" else (lambda: load_model(f"{MOE}@tiny"))
    g, values = _lora(make, "lora{rank=4}")
    whole = write_adapter(tmp_path / "whole", g, values)
    rank, _ = _lora(make, "lora{rank=4}")
    run_pipeline(rank, split)
    assert any(p.annotations.get("shard") for n, p in rank.params.items() if n.endswith("lora_B"))
    ranked = write_adapter(tmp_path / "rank", rank, values, tp=tp)
    assert [filecmp.cmp(a, b, shallow=False) for a, b in zip(whole, ranked, strict=True)] == [True] * 4
    if tp == 2:
        with pytest.raises(LoraError, match=r"rank graph of a tp=2 split, but tp=1 was given: pass tp=2"):
            write_adapter(tmp_path / "tp1", rank, values, tp=1)


def test_head_counts_of_a_rank_graph_without_config() -> None:
    """8 heads : 1 KV head cut 2 ways: each rank holds 4 heads and the KV head replicated, so the
    KV heads come from the global qkv width, not the rank's count x tp."""
    g = load_model(f"{DENSE}@tiny")
    run_pipeline(g, "lora{rank=4},split{tp=2,rank=1}")
    g.metadata.pop("config")
    assert pfa.head_counts({}, g, tp=2) == (8, 1, 16)
    moe = _tiny(MOE)
    run_pipeline(moe, "split{tp=2,rank=0}")
    assert pfa.head_counts({}, moe, tp=2) == (10, 2, 8)


def test_alpha_gives_the_scale_exactly_where_a_float_can() -> None:
    """paddleformers recomputes scaling = lora_alpha / r; no float alpha gives 0.1 with r = 3."""
    for rank in (1, 3, 7, 12, 48, 64):
        for scale in (2.0, 5 / math.sqrt(3), 16 / math.sqrt(7), 0.1, 1 / 3, 0.7):
            alpha = pfa._alpha(scale, rank)
            assert abs(alpha / rank - scale) <= math.ulp(scale)
            if rank & (rank - 1) == 0 or scale in (2.0, 1 / 3):
                assert alpha / rank == scale
    assert pfa._alpha(0.1, 3) / 3 != 0.1


def test_refusals(tmp_path: Path) -> None:
    plain = load_model(f"{DENSE}@tiny")
    with pytest.raises(LoraError, match="the graph has no LoRA adapters"):
        write_adapter(tmp_path / "a", plain, {})
    g, values = _lora(_dense_gqa, "lora{rank=4}")
    missing = {k: v for k, v in values.items() if "layers.1.mlp" not in k}
    with pytest.raises(LoraError, match=r"lack 4 of the graph's trainable LoRA params \(e\.g\. "
                                        r"ernie\.layers\.1\.mlp\.up_gate_proj\.lora_A\)"):
        write_adapter(tmp_path / "b", g, missing)
    wrong = {**values, "ernie.layers.0.mlp.down_proj.lora_A": np.zeros((192, 8), np.float32)}
    with pytest.raises(LoraError, match=r"down_proj\.lora_A has shape \[192, 8\], the graph's adapter "
                                        r"\[192, 4\]"):
        write_adapter(tmp_path / "c", g, wrong)
    bad = {**values, "ernie.layers.0.mlp.down_proj.lora_B": np.full((4, 64), np.nan, np.float32)}
    with pytest.raises(LoraError, match="holds 256 NaN/Inf"):
        write_adapter(tmp_path / "d", g, bad)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "old.safetensors").write_bytes(b"")
    with pytest.raises(LoraError, match="is not empty"):
        write_adapter(tmp_path / "e", g, values)
    with pytest.raises(LoraError, match=r"base_config gives heads/kv heads/head_dim \[8, 8, 16\], the graph "
                                        r"\[8, 2, 16\]"):
        write_adapter(tmp_path / "f", g, values,
                      base_config={"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16})


def test_frozen_adapter_params_and_other_entries(tmp_path: Path) -> None:
    """A frozen adapter param missing from the values is written from the graph; entries that are
    no adapter (QAT state, base weights) are ignored; float64 values are cast to the adapter dtype."""
    g, values = _lora(_dense_gqa, "lora{rank=4}")
    frozen = "ernie.layers.0.mlp.down_proj.lora_A"
    g.params[frozen].trainable = False
    given = {k: v.astype(np.float64) for k, v in values.items() if k != frozen}
    given["ernie.layers.0.mlp.down_proj.weight"] = np.zeros((1,), np.float32)
    write_adapter(tmp_path, g, given)
    tensors = _file(tmp_path)
    np.testing.assert_array_equal(tensors["model.layers.0.mlp.down_proj.lora_A"], values[frozen])
    assert {t.dtype for t in tensors.values()} == {np.dtype(np.float32)}
    assert adapter_params(g).keys() == values.keys()


def test_base_config_is_written_as_given(tmp_path: Path) -> None:
    g, values = _lora(_dense_gqa, "lora{rank=4}")
    base = {"architectures": ["Ernie4_5ForCausalLM"], "hidden_size": 64, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 16, "custom": [1, 2]}
    write_adapter(tmp_path, g, values, base_config=base)
    assert json.loads((tmp_path / "config.json").read_text()) == base


# -- paddleformers ----------------------------------------------------------------------------


def _export(base: Path, out: Path, seed: int = 1) -> Graph:
    """Our side: the reference's base, LoRA (ERNIEKit targets) with random values, written to out."""
    g = load_input(str(base))
    assert g.params["ernie.layers.0.self_attn.qkv_proj.weight"].type.dtype == DType.F32
    run_pipeline(g, "lora{rank=4,alpha=8}")
    write_adapter(out, g, _randomize(g, seed))
    return g


@pytest.fixture(scope="module")
def pf_dense(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Graph]:
    root = tmp_path_factory.mktemp("pf_lora_load_dense")
    run_reference("pf_lora_load.py", {}, root / "base_run")
    g = _export(root / "base_run" / "base", root / "ours")
    spec = {"base": str(root / "base_run" / "base"), "adapter": str(root / "ours")}
    run_reference("pf_lora_load.py", spec, root / "load")
    return root, root / "load", g


def _meta_clean(run: Path) -> dict:
    meta = json.loads((run / "meta.json").read_text())
    assert meta["keys_not_in_file"] == [] and meta["file_keys_not_loaded"] == []
    assert meta["values_differ_from_file"] == []
    return meta


@pytest.mark.reference
@pytest.mark.slow
def test_paddleformers_loads_our_dense_gqa_adapter(pf_dense: tuple[Path, Path, Graph]) -> None:
    root, run, g = pf_dense
    meta = _meta_clean(run)
    assert meta["model_class"] == "Ernie4_5ForCausalLM" and len(meta["loaded_keys"]) == 16
    assert meta["lora_config"]["scaling"] == 2.0 and meta["lora_config"]["r"] == 4
    ids = np.load(run / "input_ids.npy")
    ref, ref_base = np.load(run / "logits.npy"), np.load(run / "base_logits.npy")
    assert np.abs(ref - ref_base).max() > 0.1  # the adapter matters, so the check can fail
    ours = logits(g, ids)
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    print(f"\n[cross-check] write_adapter -> paddleformers LoRAModel.from_pretrained (dense GQA 4:2): "
          f"max rel {err:.2e}")
    assert err < TOL
    assert np.abs(np.load(root / "base_run" / "base_logits.npy") - ref_base).max() == 0.0


@pytest.mark.reference
@pytest.mark.slow
def test_paddleformers_logits_need_the_qkv_reorder(pf_dense: tuple[Path, Path, Graph], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    root, _, g = pf_dense
    monkeypatch.setattr(pfa, "plain_to_kv_group", lambda b, *a: b)
    _export(root / "base_run" / "base", tmp_path / "ours")
    spec = {"base": str(root / "base_run" / "base"), "adapter": str(tmp_path / "ours")}
    run_reference("pf_lora_load.py", spec, tmp_path / "load")
    ref = np.load(tmp_path / "load" / "logits.npy")
    ours = logits(g, np.load(tmp_path / "load" / "input_ids.npy"))
    assert float(np.abs(ours - ref).max() / np.abs(ref).max()) > 1e-2


@pytest.mark.reference
@pytest.mark.slow
def test_paddleformers_loads_our_moe_adapter(tmp_path: Path) -> None:
    run_reference("pf_lora_load.py", {"model": "moe"}, tmp_path / "base_run")
    g = _export(tmp_path / "base_run" / "base", tmp_path / "ours")
    spec = {"base": str(tmp_path / "base_run" / "base"), "adapter": str(tmp_path / "ours")}
    run_reference("pf_lora_load.py", spec, tmp_path / "load")
    meta = _meta_clean(tmp_path / "load")
    assert meta["model_class"] == "Ernie4_5_MoeForCausalLM"
    # 3 layers: qkv, o; layer 0 dense up_gate, down; layers 1-2: 8 experts + shared, up_gate and down
    assert len(meta["adapted_layers"]) == 3 * 2 + 2 + 2 * 2 * 9
    merged_pf = SafetensorsFile(tmp_path / "load" / "merged_state.safetensors")
    run_pipeline(g, "lora-merge")
    nh, nkv, hd = 4, 2, 16
    worst = 0.0
    for key in merged_pf:
        theirs = np.asarray(merged_pf.read(key))
        path = "ernie." + key[len("model."):]
        if m := re.fullmatch(r"(.+\.experts)\.(\d+)\.(\w+\.weight)", path):  # one expert of our stack
            ours = np.asarray(g.params[f"{m[1]}.{m[3]}"].source.read())[int(m[2])]  # type: ignore[union-attr]
        else:
            ours = np.asarray(g.params[path].source.read())  # type: ignore[union-attr]
            if path.endswith("qkv_proj.weight"):
                ours = _grouped(ours, nh, nkv, hd)
        worst = max(worst, float(np.abs(ours - theirs).max() / np.abs(theirs).max()))
    print(f"\n[cross-check] write_adapter -> paddleformers (MoE, merged weights of {len(list(merged_pf))} "
          f"adapted linears): max rel {worst:.2e}")
    assert worst < 1e-6
