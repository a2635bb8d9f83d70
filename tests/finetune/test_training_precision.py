"""The engines' mixed-precision recipe of a training artifact (ernie_ir.training.precision): bf16
params, bf16 gradients, f32 master weights, f32 (or `--moment-dtype bf16`) AdamW moments, optionally
offloaded to host memory (`--offload-optimizer`).

Checked:

- compile records it, in train.json (`precision`) and the manifest (`training_precision`);
- `plan` sizes the same thing: at tp 2 / tp 2 ep 2 with dp 2 and sharding stage1 / stage2, each
  rank's gradients, optimizer moments and master weights (device and host) in the plan of the
  source model and in the plan of the artifact equal the bytes computed here from the rank
  graphs' trainable params and the recorded recipe; plan of an artifact takes its recorded
  moment dtype and offload, and refuses a different one;
- `train` on CPU trains in f32 and says, in one line, what a device run keeps;
- the optimizer: on a CPU, the recipe adds nothing (plain f32 AdamW); the device's arguments
  (multi_precision, use_lowprecision_moment) are ones this Paddle's AdamW takes, and with f32
  params one step with them equals plain AdamW (Paddle's CPU AdamW has no bf16 kernel, so the
  bf16-params step itself runs only on a device);
- bad input, one line, exit 2, nothing written: an unknown --moment-dtype, --moment-dtype or
  --offload-optimizer without --mode training, a plan flag that contradicts the artifact.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _cli_kit import cli, user_error

from ernie_ir.artifacts import artifact_mapping, read_manifest
from ernie_ir.ir.storage import load_graph
from ernie_ir.planning import PlanRequest, plan_memory
from ernie_ir.targets import CompileOptions, compile_model
from ernie_ir.training.precision import Precision, moment_dtype

DENSE, MOE = "ernie-4.5-0.3b@tiny", "ernie-4.5-21b-a3b@tiny"
STATES = ("gradients", "optimizer_moments", "master_weights")
HOST = ("optimizer_moments", "master_weights")


def _compile(tmp: Path, model: str, **flags: Any) -> Path:
    out = tmp / "art"
    compile_model(model, "cuda", CompileOptions(mode="training", out=out, **flags))
    return out


def _recorded_bytes(art: Path) -> list[tuple[dict[str, int], dict[str, int]]]:
    """Per rank of one replica: (device bytes, host bytes) of gradients, moments and master
    weights, from the rank graph's trainable params and train.json's recipe, with the layout's
    ZeRO division (an even split, rounded up) and offload."""
    recipe = json.loads((art / "training" / "train.json").read_text(encoding="utf-8"))["precision"]
    mapping = artifact_mapping(read_manifest(art))
    moment = {"f32": 4, "bf16": 2}[recipe["moments"]]
    divided = {"none": (), "stage1": HOST, "stage2": (*HOST, "gradients")}[mapping.sharding or "none"]
    out = []
    for r in range(mapping.world_size):
        trained = [p for p in load_graph(art / f"rank{r}").params.values() if p.trainable]
        size = {p.name: int(np.prod(p.type.shape)) for p in trained}
        device = {"gradients": sum(size[p.name] * p.type.dtype.bits // 8 for p in trained),
                  "optimizer_moments": sum(2 * size[p.name] * moment for p in trained),
                  "master_weights": sum(size[p.name] * 4 for p in trained if str(p.type.dtype) != "f32")}
        for c in divided:
            device[c] = -(-device[c] // mapping.dp)
        host = dict.fromkeys(HOST, 0)
        if recipe["offload_optimizer"]:
            for c in HOST:
                host[c], device[c] = device[c], 0
        out.append((device, host))
    return out


# -- what compile records ------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "flags", "params", "moments", "offload"), [
    (DENSE, {}, "bf16", "f32", False),
    (DENSE, {"moment_dtype": "bf16", "offload_optimizer": True}, "bf16", "bf16", True),
    (MOE, {"moment_dtype": "float32"}, "bf16+f32", "f32", False),  # its router weights are f32
])
def test_compile_records_the_recipe(tmp_path: Path, model: str, flags: dict[str, Any], params: str,
                                    moments: str, offload: bool) -> None:
    art = _compile(tmp_path, model, **flags)
    recipe = json.loads((art / "training" / "train.json").read_text(encoding="utf-8"))
    want = {"params": params, "gradients": params, "master_weights": "f32", "moments": moments,
            "offload_optimizer": offload}
    assert {k: recipe["precision"][k] for k in want} == want
    assert recipe["precision"]["device_optimizer"] == (
        f"paddle.optimizer.AdamW(multi_precision=True, use_lowprecision_moment={moments == 'bf16'})")
    assert json.loads((art / "manifest.json").read_text(encoding="utf-8"))["training_precision"] == want
    assert Precision.from_recipe(recipe) == Precision(params, moments, offload)


def test_moment_dtype_spellings() -> None:
    assert [moment_dtype(x) for x in ("float32", "fp32", "F32", "bf16", " bfloat16 ")] == [
        "f32", "f32", "f32", "bf16", "bf16"]
    assert Precision("f32").master_weights == "none"  # f32 params keep no master copy
    assert Precision("bf16+f32").master_weights == "f32"


# -- plan sizes what compiles --------------------------------------------------------------------


LAYOUTS = [
    (DENSE, {"tp": 2, "dp": 2, "sharding": "stage1"}, {}),
    (DENSE, {"tp": 2, "dp": 2, "sharding": "stage2"}, {"moment_dtype": "bf16"}),
    (DENSE, {"tp": 2, "dp": 2, "sharding": "stage1"}, {"offload_optimizer": True}),
    (MOE, {"tp": 2, "ep": 2, "dp": 2, "sharding": "stage2"}, {"offload_optimizer": True}),
    (MOE, {"tp": 2, "dp": 2, "sharding": "stage1"}, {"moment_dtype": "bf16"}),
]
# per rank, (gradients, moments, master weights) device bytes, for the report and the docs
EXPECTED = {
    (DENSE, "stage1", ""): (180864, 361728, 180864),
    (DENSE, "stage2", "moment_dtype"): (90432, 180864, 180864),
    (DENSE, "stage1", "offload_optimizer"): (180864, 0, 0),
    (MOE, "stage2", "offload_optimizer"): (230960, 0, 0),
    (MOE, "stage1", "moment_dtype"): (461920, 456800, 451680),
}


@pytest.mark.parametrize(("model", "layout", "flags"), LAYOUTS)
def test_plan_bytes_equal_the_artifacts(tmp_path: Path, model: str, layout: dict[str, Any],
                                        flags: dict[str, Any]) -> None:
    art = _compile(tmp_path, model, **layout, **flags)
    recorded = _recorded_bytes(art)
    short = PlanRequest(seq_len=16, batch=1)
    of_source = plan_memory(model, "cuda", CompileOptions(mode="training", **layout),
                            PlanRequest(seq_len=16, batch=1, **flags))
    of_artifact = plan_memory(str(art), "cuda", CompileOptions(mode="training"), short)  # the recorded recipe
    for plan in (of_source, of_artifact):
        assert plan.trainable in ("full", "graph") and plan.dp == 2 and plan.sharding == layout["sharding"]
        assert len(plan.per_rank) == len(recorded)
        for rank, (device, host) in zip(plan.per_rank, recorded, strict=True):
            assert {c: rank.by_category[c] for c in STATES} == device
            assert rank.host_by_category == host
    # the same trainable params: compile's full-param pass and the planner's full-parameter rule
    assert of_source.trainable_params == of_artifact.trainable_params
    device = recorded[0][0]
    assert tuple(device[c] for c in STATES) == EXPECTED[model, layout["sharding"], next(iter(flags), "")]


def test_plan_of_an_artifact_keeps_its_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art = _compile(tmp_path, DENSE, moment_dtype="bf16")
    code, out, _ = cli(capsys, "plan", str(art), "-t", "cuda", "--mode", "training", "--seq-len", "16",
                       "--json")
    assert code == 0, out
    plan = json.loads(out)
    assert plan["assumptions"]["moment_dtype"] == "bf16"
    line = user_error(capsys, "plan", str(art), "-t", "cuda", "--mode", "training", "--moment-dtype", "fp32")
    assert line == (f"error: --moment-dtype fp32: {art} records AdamW moments in bf16 (compile "
                    "--moment-dtype): drop --moment-dtype (or plan its source model)")
    line = user_error(capsys, "plan", str(art), "-t", "cuda", "--mode", "training", "--offload-optimizer")
    assert line.startswith(f"error: --offload-optimizer: {art} was compiled without it")


# -- train on CPU -------------------------------------------------------------------------------


def test_cpu_train_says_what_a_device_run_keeps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("paddle")
    art = _compile(tmp_path, DENSE, moment_dtype="bf16", offload_optimizer=True)
    code, out, err = cli(capsys, "train", str(art), "--steps", "1", "--no-progress")
    line = ("precision: this CPU run trains in f32 (no bf16 matmuls on CPU); a device run keeps params bf16, "
            "gradients bf16, master weights f32, AdamW moments bf16, optimizer states in host memory "
            "(paddle.optimizer.AdamW multi_precision=True)")
    assert code == 0, err
    assert line in err.splitlines() and out.startswith("step    1  loss")
    code, out, _ = cli(capsys, "train", str(art), "--steps", "1", "--json")
    assert code == 0 and json.loads(out)["precision"] == line


def test_optimizer_arguments(tmp_path: Path) -> None:
    paddle = pytest.importorskip("paddle")
    from ernie_ir.training.loop import TrainOptions, make_optimizer

    recipe = Precision("bf16", "bf16")
    paddle.set_device("cpu")
    assert recipe.adamw_kwargs(paddle) == {}  # CPU: f32 training, plain AdamW
    gpu = SimpleNamespace(device=SimpleNamespace(get_device=lambda: "gpu:0"))
    assert recipe.adamw_kwargs(gpu) == {"multi_precision": True, "use_lowprecision_moment": True}
    assert Precision("bf16").adamw_kwargs(gpu) == {"multi_precision": True, "use_lowprecision_moment": False}

    # the device's arguments are this Paddle's: with f32 params (no master copies, f32 moments)
    # one step with them equals plain AdamW's, as our construction's on the CPU does
    rng = np.random.default_rng(0)
    w0, x = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((2, 4)).astype(np.float32)
    opts = TrainOptions(lr=0.1, weight_decay=0.01)

    def step(build: Any) -> np.ndarray:
        w = paddle.create_parameter([4, 3], "float32", default_initializer=paddle.nn.initializer.Assign(w0))
        opt = build([w])
        (paddle.matmul(paddle.to_tensor(x), w) ** 2).sum().backward()
        opt.step()
        return w.numpy()

    plain = step(lambda ps: paddle.optimizer.AdamW(learning_rate=0.1, parameters=ps, weight_decay=0.01))
    ours = step(lambda ps: make_optimizer(paddle, ps, opts, None, recipe))
    device_args = step(lambda ps: paddle.optimizer.AdamW(learning_rate=0.1, parameters=ps, weight_decay=0.01,
                                                         **recipe.adamw_kwargs(gpu)))
    assert not np.array_equal(plain, w0)
    np.testing.assert_array_equal(ours, plain)
    np.testing.assert_allclose(device_args, plain, rtol=0, atol=1e-7)


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "expect"), [
    (["--mode", "training", "--moment-dtype", "fp8"],
     "error: --moment-dtype 'fp8': choose float32 (AdamW's f32 moments, the default) or bf16 (Paddle's "
     "use_lowprecision_moment)"),
    (["--moment-dtype", "bf16"],
     "error: --moment-dtype bf16 sets a training artifact's optimizer states, and --mode inference keeps "
     "none: add --mode training (or drop it)"),
    (["--offload-optimizer"],
     "error: --offload-optimizer sets a training artifact's optimizer states, and --mode inference keeps "
     "none: add --mode training (or drop it)"),
])
def test_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], expect: str) -> None:
    out = tmp_path / "out"
    assert user_error(capsys, "compile", DENSE, "--target", "cuda", *flags, "--out", str(out)) == expect
    assert not out.exists()
