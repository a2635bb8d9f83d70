"""ERNIEKit's export config as it is (issue 39 item 1): `ernie-ir export CONFIG.yaml key=value ...`
exports the run in the config's output_dir, as `erniekit export CONFIG.yaml key=value ...` does:
a LoRA run's newest adapter merged into model_name_or_path.

The config is ERNIEKit's published export config (quoted below verbatim), run unmodified except by
overrides (the model path and output_dir) on a LoRA run trained here by `ernie-ir train` with
ERNIEKit's published `run_sft_lora_8k.yaml` (the fixtures of test_erniekit_config.py). The
exported folder, read back by the frontend, holds the base weights with the trained adapter
merged, computed here from the checkpoint's params independently of the merge pass
(`W + (A @ B) * alpha / rank`). The same adapter in ERNIEKit's own output layout
(`output_dir/checkpoint-N/`) exports to `output_dir/export`, as erniekit writes it, with the same
bytes. Refusals (an unknown key by name, an upload, lora contradicting the run, a hub id) are one
line, exit 2, nothing written; the training keys of the config are named in one note.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_erniekit_config import _overrides, _run, files  # noqa: F401  (files: the module fixture)

from ernie_ir.ir.weights import SafetensorsFile
from ernie_ir.load import load_input
from ernie_ir.training.erniekit_config import ErnieKitConfigError, erniekit_export

# ERNIEKit's export config for ERNIE-4.5-0.3B, as its web UI's export step runs it (`erniekit export`
# with this file): https://github.com/PaddlePaddle/ERNIE/blob/fec4aa6c83a1f130e79f18d4782954a04e33c54a/erniekit/webui/config/execute/export.yaml
# (examples/configs/ERNIE-4.5-0.3B/run_export.yaml is the command-line copy of the same keys)
EXPORT_YAML = """\
### model
model_name_or_path: baidu/ERNIE-4.5-0.3B
fine_tuning: LoRA

### split
max_shard_size: 5
hf_hub_id: null
output_dir: ./output

### performance
tensor_parallel_degree: 1
pipeline_parallel_degree: 1
sharding_parallel_degree: 1
sharding: stage1
pipeline_parallel_config: disable_partial_send_recv enable_clear_every_step_cache
sequence_parallel: True
compute_type: bf16
fp16_opt_level: O2
"""


@pytest.fixture(scope="module")
def lora_run(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # noqa: F811
    """`ernie-ir train run_sft_lora_8k.yaml` (2 steps at a learning rate that moves the adapter),
    and the export config written beside it."""
    pytest.importorskip("paddle")
    root = tmp_path_factory.mktemp("erniekit_export")
    out = root / "output"
    code, _, stderr = _run("train", str(files["lora"]), *_overrides(files, out), "learning_rate=1e-2",
                           "warmup_steps=0", "--json", "--no-progress")
    assert code == 0, stderr
    config = root / "run_export.yaml"
    config.write_text(EXPORT_YAML, encoding="utf-8")
    return {"root": root, "out": out, "config": config, "model": files["model"],
            "checkpoint": out / "training" / "checkpoints" / "run-001-step-2"}


def _merged_by_hand(model: Path, checkpoint: Path) -> dict[str, np.ndarray]:
    """The base weights with the checkpoint's adapter merged, W + (A @ B) * alpha / rank, in float32
    rounded once to the weight's dtype, from the files alone."""
    base = load_input(str(model))
    params = SafetensorsFile(checkpoint / "params.safetensors")
    lora = json.loads((checkpoint / "adapter" / "lora_config.json").read_text())
    scale = lora["lora_alpha"] / lora["r"]
    want = {name: p.read() for name, p in base.params.items()}
    adapted = {n.removesuffix(".lora_A") for n in params if n.endswith(".lora_A")}
    assert adapted, "the run trained no adapter"
    for module in adapted:
        a = np.asarray(params.read(f"{module}.lora_A"), np.float32)
        b = np.asarray(params.read(f"{module}.lora_B"), np.float32)
        w = want[f"{module}.weight"]
        want[f"{module}.weight"] = (w.astype(np.float32) + (a @ b) * scale).astype(w.dtype)
    return want


@pytest.mark.slow
def test_published_export_config_merges_the_trained_adapter(lora_run: dict[str, Path],
                                                             tmp_path: Path) -> None:
    out, model = lora_run["out"], lora_run["model"]
    code, stdout, stderr = _run("export", str(lora_run["config"]), f"model_name_or_path={model}",
                                f"output_dir={out}")
    assert code == 0, stderr
    dest = out.parent / "output-export"  # output_dir is the artifact: the export goes beside it
    assert f"exported {model} -> {dest}" in stdout and "adapted layer(s)" in stdout
    notes = [line for line in stderr.splitlines() if line.startswith("note: ")]
    assert any(n.startswith("note: max_shard_size: accepted without effect") for n in notes), stderr
    training = next(n for n in notes if "training keys, accepted without effect on export" in n)
    for key in ("tensor_parallel_degree", "sharding", "sequence_parallel", "compute_type", "fp16_opt_level"):
        assert key in training
    assert any(f"written to {dest}, beside output_dir" in n for n in notes), stderr

    back = load_input(str(dest))
    want = _merged_by_hand(model, lora_run["checkpoint"])
    base = load_input(str(model))
    assert set(back.params) == set(want)
    moved = 0
    for name, p in back.params.items():
        got = p.read()
        assert got.dtype == want[name].dtype and np.array_equal(got, want[name]), name
        moved += not np.array_equal(got, base.params[name].read())
    assert moved > 0  # the adapter trained, and the export holds it

    # ERNIEKit's own output layout: output_dir/checkpoint-N holding the adapter -> output_dir/export
    kit = tmp_path / "erniekit_output"
    shutil.copytree(lora_run["checkpoint"] / "adapter", kit / "checkpoint-2")
    code, _, stderr = _run("export", str(lora_run["config"]), f"model_name_or_path={model}",
                           f"output_dir={kit}", "lora=True")
    assert code == 0, stderr
    again = load_input(str(kit / "export"))
    for name, p in again.params.items():
        assert np.array_equal(p.read(), want[name]), name


def _refused(argv: list[str], says: str, where: Path) -> None:
    before = sorted(p.name for p in where.iterdir())
    code, stdout, stderr = _run(*argv)
    lines = stderr.strip().splitlines()
    assert code == 2 and stdout == "" and lines[-1].startswith("error: "), stderr
    assert says in lines[-1], lines[-1]
    assert sorted(p.name for p in where.iterdir()) == before  # nothing written


@pytest.mark.slow
def test_refusals_are_one_line_and_write_nothing(lora_run: dict[str, Path]) -> None:
    root, out, config = lora_run["root"], lora_run["out"], lora_run["config"]
    base = ["export", str(config), f"model_name_or_path={lora_run['model']}", f"output_dir={out}"]
    _refused([*base, "lorra=True"], "unknown export option 'lorra' (did you mean lora?)", root)
    _refused([*base, "hf_hub_id=me/model"], "hf_hub_id 'me/model': ernie-ir uploads nothing", root)
    _refused([*base, "lora=False"], f"output_dir {out} trained LoRA adapters, and the config says lora=False",
             root)
    _refused(["export", str(config), f"output_dir={out}"],
             "'baidu/ERNIE-4.5-0.3B' is a model hub id, and ernie-ir downloads nothing", root)
    _refused([*base[:3], f"output_dir={root / 'none'}"], f"output_dir {root / 'none'} does not exist", root)
    _refused(["export", str(lora_run["model"]), "lora=True", "--out", str(root / "x")],
             "lora=True: key=value overrides follow an ERNIEKit export config", root)
    _refused(["export", str(lora_run["model"])], "--out: not given", root)  # a model still needs --out


def test_export_keys_read_as_erniekit_reads_them(tmp_path: Path) -> None:
    config = tmp_path / "run_export.yaml"
    config.write_text(EXPORT_YAML, encoding="utf-8")
    kit = erniekit_export(config, ["output_dir=out/lora"])
    assert (kit.output_dir, kit.model_name, kit.lora) == (Path("out/lora"), "baidu/ERNIE-4.5-0.3B", True)
    assert erniekit_export(config, ["lora=false"]).lora is False  # lora wins over fine_tuning
    assert erniekit_export(config, ["fine_tuning=Full"]).lora is False
    no_effect = erniekit_export(config, ["copy_tokenizer=False"]).notes
    assert any(n.startswith("copy_tokenizer: False: accepted without effect") for n in no_effect)
    with pytest.raises(ErnieKitConfigError, match="mergekit_task_config: merging several models"):
        erniekit_export(config, ["mergekit_task_config=merge.yaml"])
    with pytest.raises(ErnieKitConfigError, match="output_dir: not given"):
        erniekit_export(config, ["output_dir="])


def test_a_full_parameter_run_exports_its_trained_weights(tmp_path: Path) -> None:
    """fine_tuning: Full: the run's newest weights (load_trained's, rounded once to the model's
    dtype) are written; model_name_or_path, the hub id as published, is not needed and is said to
    have no effect."""
    pytest.importorskip("paddle")
    from ernie_ir.load import load_trained
    from ernie_ir.targets.compile import CompileOptions, compile_model
    from ernie_ir.training.loop import train_artifact

    art = tmp_path / "output"
    compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(mode="training", out=art))
    train_artifact(art, 1, options={"lr": 1e-2})
    config = tmp_path / "run_export.yaml"
    config.write_text(EXPORT_YAML, encoding="utf-8")
    dest = tmp_path / "merged"
    code, stdout, stderr = _run("export", str(config), f"output_dir={art}", "fine_tuning=Full",
                                "--out", str(dest))
    assert code == 0, stderr
    assert "trained weights: training/checkpoints/run-001-step-1" in stdout
    assert "note: model_name_or_path: a full-parameter run holds its own weights: no effect" in stderr
    ours, back = load_trained(art), load_input(str(dest))
    base = load_input("ernie-4.5-0.3b@tiny")
    assert set(back.params) == set(ours.params)
    for name, p in back.params.items():
        assert np.array_equal(p.read(), ours.params[name].read()), name
    assert any(not np.array_equal(p.read(), base.params[n].read()) for n, p in back.params.items())
