"""FastDeploy folders read by FastDeploy's own loader (issue: "checked against its code, not our
reading of it"): tests/reference/fd_load_check.py drives FastDeploy's worker config parsing, its
loaders and the ERNIE 4.5 model classes, unmodified, in the `fd` reference environment
(tests/reference/install_envs.sh, from ../shared/fastdeploy). Names, shapes and dtypes of every
tensor per tp rank; the last line of a clean folder is `ok`.

Checked here: one folder per preset FastDeploy loads at tp 2 (dense wint8, wint4, wint8mix,
wint8mix-erniekit; MoE wint2), tp 1 and tp 4, a LoRA-merged folder, the bf16 form of weight-only
MoE experts (FastDeploy quantizes it at load, its only route for them), and the harness's negative
control. The presets and layouts FastDeploy cannot load are refused at compile
(tests/targets/test_fastdeploy_checkpoint.py); the whole matrix (every preset x tp 1/2/4 x
dense/MoE) is scripts/fastdeploy_matrix.py, whose table is in docs/targets.md.

The folders are compiled once and the loader runs on them two at a time (one child process per
rank, about 10 s each: the harness's cost is the import of FastDeploy and Paddle)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ernie_ir.targets import CompileOptions, compile_model, verify_artifact

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from _parallel_testkit import tiny_config, write_paddle_checkpoint
from fastdeploy_loader import HARNESS, LoadResult, available, fastdeploy_load

pytestmark = [pytest.mark.reference, pytest.mark.slow]

DENSE, MOE = "ernie-4.5-0.3b@tiny", "ernie-4.5-21b-a3b@tiny"  # hidden 64 / 80: pack for sm70
SIZES = {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 32, "vocab_size": 1024}  # every linear packs at sm80 on 1, 2 and 4 ranks
MOE_SIZES = {**SIZES, "moe_intermediate_size": 512, "moe_num_shared_experts": 1, "moe_num_experts": 8,
             "moe_k": 2}


@dataclass(frozen=True)
class Case:
    model: str  # a built-in, or "dense" / "moe": checkpoint folders that pack at sm80
    quant: str
    tp: int = 2
    arch: int = 70
    load_choices: str = "default_v1"


CASES = {
    **{f"dense-{q}": Case(DENSE, q) for q in ("wint8", "wint4", "wint8mix")},
    "moe-wint2": Case("moe", "wint2", arch=80),
    "dense-wint8mix-erniekit": Case("dense", "wint8mix-erniekit", arch=80),
    "dense-wint8-tp4": Case("dense", "wint8", tp=4, arch=80),
    "tp1": Case(DENSE, "wint4", tp=1, load_choices="default"),
    "tp1-v1": Case(DENSE, "wint4", tp=1),
    **{f"bf16-{q}": Case(MOE, q, tp=1, load_choices="default") for q in ("wint8mix", "wint8", "wint4")},
    "bf16-v1": Case(MOE, "wint8mix", tp=1),
}


def lora_adapter(folder: Path) -> Path:
    """A paddleformers adapter folder for DENSE (qkv/o/up_gate/down), non-zero A and B."""
    from ernie_ir.formats.paddleformers_adapter import write_adapter
    from ernie_ir.load import load_input
    from ernie_ir.passes import run_pipeline

    graph = load_input(DENSE)
    run_pipeline(graph, "lora{rank=4}")
    rng = np.random.default_rng(3)
    values = {name: (rng.standard_normal(p.type.shape) * 0.05).astype(np.float32)
              for name, p in graph.params.items() if name.endswith(("lora_A", "lora_B"))}
    write_adapter(folder, graph, values)
    return folder


def negative_control(folder: Path) -> Path:
    """Six faults in rank 0 of a copy of `folder` (the harness README's control)."""
    from safetensors.numpy import load_file, save_file

    weights = folder / "rank0" / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["ernie.layers.0.self_attn.o_proj.weight_scale"]  # missing
    qkv = "ernie.layers.0.self_attn.qkv_proj.quant_weight"
    tensors[qkv] = np.ascontiguousarray(tensors[qkv].T)  # transposed
    tensors["ernie.layers.1.self_attn.o_proj.quant_weight"] = tensors[
        "ernie.layers.1.self_attn.o_proj.quant_weight"].view(np.uint8)  # wrong dtype
    scale = "ernie.layers.1.mlp.down_proj.weight_scale"
    tensors[scale] = tensors[scale][:-1].copy()  # short
    tensors["ernie.layers.0.not_a_tensor_of_fastdeploy"] = np.zeros(4, np.float32)  # extra key
    f32 = "ernie.layers.1.mlp.up_gate_proj.weight_scale"
    tensors[f32] = tensors[f32].astype(np.float32)  # accepted: FastDeploy casts it at load
    weights.unlink()  # a link to weights.safetensors: write a file of its own
    save_file(tensors, str(weights))
    return folder


def published_bf16(folder: Path, dest: Path) -> Path:
    """The bf16 folder's weights as a published checkpoint (no quantization_config)."""
    dest.mkdir()
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (dest / "config.json").write_text(json.dumps(config))
    os.symlink(folder / "model.safetensors", dest / "model.safetensors")
    return dest


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, LoadResult]]:
    """Every case compiled, then read by FastDeploy's loader, two folders at a time."""
    why = available()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("fd")
    for kind, name, sizes in (("dense", "ernie-4.5-0.3b", SIZES), ("moe", "ernie-4.5-21b-a3b", MOE_SIZES)):
        write_paddle_checkpoint(root / "src" / kind, {**tiny_config(name), **sizes})
    folders: dict[Case, Path] = {}
    runs: dict[str, tuple[Path, Case]] = {}
    for key, case in CASES.items():
        same = Case(case.model, case.quant, case.tp, case.arch)  # one folder for both loaders
        if same not in folders:
            model = str(root / "src" / case.model) if case.model in ("dense", "moe") else case.model
            folders[same] = Path(compile_model(model, "cuda", CompileOptions(
                quant=case.quant, tp=case.tp, cuda_arch=case.arch, emit="fastdeploy", out=root / key)).out)
        runs[key] = (folders[same], case)
    runs["lora"] = (Path(compile_model(DENSE, "cuda", CompileOptions(
        quant="wint8", tp=2, cuda_arch=70, emit="fastdeploy", lora_adapter=lora_adapter(root / "adapter"),
        merge_lora=True, out=root / "lora")).out), Case(DENSE, "wint8"))
    control = shutil.copytree(runs["dense-wint8"][0], root / "control", symlinks=True)
    runs["control"] = (negative_control(control), Case(DENSE, "wint8"))
    runs["plain-v1"] = (published_bf16(runs["bf16-v1"][0], root / "plain"), Case(MOE, "wint8mix", tp=1))

    def load(item: tuple[str, tuple[Path, Case]]) -> tuple[str, tuple[Path, LoadResult]]:
        key, (folder, case) = item
        work = root / "work" / key
        work.mkdir(parents=True)
        return key, (folder, fastdeploy_load(folder, work, load_choices=case.load_choices, arch=case.arch))

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(load, runs.items()))


def assert_loads(result: LoadResult, ranks: int) -> None:
    assert result.last == "ok", result.ranks
    assert [r["rank"] for r in result.ranks] == list(range(ranks))
    for r in result.ranks:
        assert r["mismatches"] == [] and r["params"] > 0 and r["keys"] > 0
        assert "is_quantized=True, model_format=paddle" in r["quant"]


@pytest.mark.parametrize(("key", "ranks"), [("dense-wint8", 2), ("dense-wint4", 2), ("dense-wint8mix", 2),
                                            ("moe-wint2", 2), ("dense-wint8mix-erniekit", 2),
                                            ("dense-wint8-tp4", 4), ("lora", 2)])
def test_fastdeploy_loads_the_prequantized_folders(loaded: dict[str, tuple[Path, LoadResult]], key: str,
                                                   ranks: int) -> None:
    folder, result = loaded[key]
    config = json.loads((folder / "config.json").read_text())
    assert "dtype" in config and "torch_dtype" not in config  # FastDeploy's Paddle form
    assert_loads(result, ranks)
    if key == "lora":
        assert verify_artifact(folder).lora_adapter["merged"]


def test_one_rank_loads_from_the_top_level_with_the_v0_loader(
        loaded: dict[str, tuple[Path, LoadResult]]) -> None:
    folder, result = loaded["tp1"]
    top = folder / "model.safetensors"  # the rank bytes, linked (never a second copy)
    assert top.is_symlink() and os.readlink(top) == "rank0/weights.safetensors"
    verify_artifact(folder)  # the link is an alias of a listed file below it
    assert_loads(result, 1)
    # why the serve command names the v0 loader: FastDeploy's default one stops on this folder
    _, v1 = loaded["tp1-v1"]
    assert v1.last != "ok" and any("fd_suffix_map" in m["what"] for m in v1.findings())


@pytest.mark.parametrize("quant", ["wint8mix", "wint8", "wint4"])
def test_weight_only_moe_is_a_bf16_folder_fastdeploy_quantizes_at_load(
        loaded: dict[str, tuple[Path, LoadResult]], quant: str) -> None:
    folder, result = loaded[f"bf16-{quant}"]
    config = json.loads((folder / "config.json").read_text())
    q = config["quantization_config"]
    assert q["is_quantized"] is False and config["ernie_ir"]["format"] == "fastdeploy-bf16-on-grid"
    assert q["quantization"] == ("wint8" if quant == "wint8" else "mix_quant")
    top = folder / "model.safetensors"  # FastDeploy reads the top level; the harness reads rank0/
    assert top.is_symlink() and os.readlink(top) == "rank0/model.safetensors"
    assert not (folder / "rank0" / "model.safetensors").is_symlink()  # bf16 bytes of their own
    verify_artifact(folder)
    assert result.loads_at_load_time(), result.ranks  # every tensor read, quantized at load
    assert "is_quantized=False" in result.ranks[0]["quant"]
    assert any("bfloat16 -> int8" in n for n in result.ranks[0]["notes"])  # Paddle's weight_quantize ran


def test_the_v1_loader_reads_our_bf16_folder_as_a_published_one(
        loaded: dict[str, tuple[Path, LoadResult]]) -> None:
    """FastDeploy's v1 loader on a bf16 folder: the harness cannot see its assignments (it reports the
    same parameters unassigned for a published bf16 checkpoint), so the bf16 form is checked with the
    v0 loader and served with it. The control: our folder and the same weights published give the
    same findings."""
    def unassigned(key: str) -> set[str]:
        found = loaded[key][1].findings()
        names = {m["what"].split(" ")[1] for m in found if m["kind"] == "unassigned"}
        assert names and all(m["kind"] in ("unassigned", "config") for m in found), found
        return names

    assert unassigned("bf16-v1") == unassigned("plain-v1")


def test_the_negative_control_is_caught(loaded: dict[str, tuple[Path, LoadResult]]) -> None:
    """Six faults in rank 0: each of five is reported, nothing else but their consequences, and the
    sixth is a cast FastDeploy accepts."""
    _, result = loaded["control"]
    rank0 = next(r for r in result.ranks if r["rank"] == 0)
    found = rank0["mismatches"]
    assert result.last == f"{len(found)} mismatches", result.ranks
    faults: dict[str, Any] = {  # each fault: the finding that names it
        "missing": lambda m: m["kind"] == "load" and "o_proj.weight_scale" in m["what"],
        "transposed": lambda m: m["kind"] == "shape/dtype" and "int8[96, 64]" in m["what"]
        and "int8[64, 96]" in m["what"],
        "dtype": lambda m: m["kind"] == "shape/dtype" and "uint8[64, 64]" in m["what"],
        "short": lambda m: m["kind"] == "shape/dtype" and "bfloat16[63]" in m["what"],
        "extra": lambda m: m["kind"] == "left over" and "not_a_tensor_of_fastdeploy" in m["what"],
    }
    assert {name for name, hit in faults.items() if any(hit(m) for m in found)} == set(faults)
    # nothing else: the only other findings are the missing scale's layer left unloaded
    rest = [m for m in found if not any(hit(m) for hit in faults.values())]
    assert rest and all(m["kind"] == "unassigned" and "layers.0.self_attn.o_proj" in m["what"] for m in rest)
    assert any("cast by FastDeploy at load (accepted): float32 -> bfloat16" in n for n in rank0["notes"])
    assert next(r for r in result.ranks if r["rank"] == 1)["mismatches"] == []


def test_the_harness_is_the_shared_judge() -> None:
    shared = Path(__file__).resolve().parents[3] / "shared" / "fastdeploy" / "fd_load_check.py"
    if not shared.is_file():
        pytest.skip(f"no {shared}: the shared copy of the FastDeploy loader check is not beside the checkout")
    assert HARNESS.read_bytes() == shared.read_bytes()  # improvements go into both copies
