"""A fourth target through the `ernie_ir.targets` entry-point group, end to end.

A tiny package is built and pip-installed (`ernie_ir.testing.plugins.install_plugin`: no
network) during the test. It adds the target `dcu` (a Hygon DCU-like device on Paddle's ROCm
build: weight-only int8 per-channel only, no fused MoE kernel, launch flag --gpus, visible
devices HIP_VISIBLE_DEVICES, collective backend nccl (rccl)) with legalization rules of its own
(they annotate the layout its kernel reads). `ernie-ir` then runs in a subprocess with the
package on PYTHONPATH, as for a user who pip-installed it: `compile --help` lists the target,
`ernie-4.5-21b-a3b@tiny --target dcu --quant wint8mix` compiles (its int4 experts fall back, as its
capability table says), verifies and runs on the interpreter, equal to the quantized model
and within the wint8mix budget of the float model. A second package is broken: the built-in
targets never notice, and asking for its target names it in one line.

The plugin's source is the example of docs/targets.md "Adding a target", word for word.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ernie_ir
from ernie_ir.testing.plugins import install_plugin

ROOT = Path(ernie_ir.__file__).resolve().parents[1]  # the ernie_ir the subprocesses must import
ERNIE_IR = str(Path(sys.executable).parent / "ernie-ir")
DOC = ROOT / "docs" / "targets.md"
MODEL = "ernie-4.5-21b-a3b@tiny"
IDS = np.random.default_rng(5).integers(0, 1024, size=(2, 9)).astype(np.int64)

DCU = '''\
"""Hygon DCU (Paddle's ROCm build) as an ernie-ir target."""
from ernie_ir.ir import Param
from ernie_ir.targets import HardwareTarget, LegalizationRules, WeightOnlyKernel


class DcuRules(LegalizationRules):
    """The DCU kernel reads int8 [K, N] (the logical layout): annotate it, then record the kernel."""

    def dense(self, lz, node, bits, kernel):
        q = node.inputs[1]
        if isinstance(q, Param):
            q.annotations = {**q.annotations, "device_layout": {"layout": "dcu", "shape": "[K, N]"}}
        super().dense(lz, node, bits, kernel)


DCU = HardwareTarget(
    name="dcu",
    description="Hygon DCU (Paddle ROCm build)",
    dtypes=("f32", "f16", "bf16"),
    weight_only=WeightOnlyKernel(kernel="weight_only_linear_dcu", bits=(8,), group_sizes=(-1,),
                                 source="the vendor's kernel docs"),
    fused_moe=None,  # no fused MoE kernel: expert stacks stay portable
    fp8=False,
    fp8_note="no FP8 kernels",
    collective_backend="nccl (rccl)",
    launch_flag="--gpus",
    visible_devices_env="HIP_VISIBLE_DEVICES",
    paddle_device="gpu:0",  # ROCm Paddle calls the device "gpu"
    inference_config="config.enable_use_gpu(memory_pool_init_size_mb, 0)",
    onnx_runtime="ROCm EP",
    packing="int8 [K, N] + per-channel scales [N] (the logical layout)",
    sources=("the vendor's kernel docs",),
    rules=DcuRules(),
)
'''

BROKEN = '''\
raise ImportError("this target plugin needs the vendor SDK")
'''


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("target-plugins")
    np.save(root / "ids.npy", IDS)
    good = install_plugin(root, "ernie-ir-dcu", {"ernie_ir_dcu": DCU},
                          {"ernie_ir.targets": {"dcu": "ernie_ir_dcu:DCU"}})
    broken = install_plugin(root, "ernie-ir-tpu", {"ernie_ir_tpu": BROKEN},
                            {"ernie_ir.targets": {"tpu": "ernie_ir_tpu:TPU"}})
    return {"root": root, "good": good, "broken": broken}


def tool(sites: dict[str, Path], *argv: str, plugins: tuple[str, ...] = ("good",),
         timeout: int = 300) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([*(str(sites[p]) for p in plugins), str(ROOT)])
    env = {k: v for k, v in os.environ.items() if k != "ERNIE_IR_UPDATE_GOLDENS"}
    env.update(PYTHONPATH=path, COLUMNS="240", NO_COLOR="1")
    return subprocess.run([ERNIE_IR, *argv], env=env, cwd=sites["root"], capture_output=True, text=True,
                          timeout=timeout)


def ok(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def one_error_line(run: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and "Traceback" not in run.stderr and len(lines) == 1, run.stderr
    return lines[0]


def logits(sites: dict[str, Path], model: str, name: str, *argv: str) -> np.ndarray:
    dest = sites["root"] / f"{name}.npy"
    ok(tool(sites, "run", model, "--tokens", "ids.npy", "--save-logits", str(dest), *argv))
    return np.load(dest)


@pytest.fixture(scope="module")
def compiled(sites: dict[str, Path]) -> dict[str, object]:
    art = sites["root"] / "art-dcu"
    out = ok(tool(sites, "compile", MODEL, "--target", "dcu", "--quant", "wint8mix", "--out", str(art),
                  "--json"))
    return {"art": art, "report": json.loads(out.strip().splitlines()[-1])}


def test_the_docs_example_is_the_plugin_this_test_installs() -> None:
    assert DCU in DOC.read_text(encoding="utf-8")


def test_the_cli_knows_the_built_in_targets_without_importing_them() -> None:
    from ernie_ir.cli.common import BUILTIN_TARGETS
    from ernie_ir.targets.registry import BUILTIN

    assert tuple(t.name for t in BUILTIN) == BUILTIN_TARGETS


@pytest.mark.slow
def test_compile_help_lists_the_plugin_target(sites: dict[str, Path]) -> None:
    for command in ("compile", "plan"):
        text = " ".join(ok(tool(sites, command, "--help")).split())
        assert "cuda, ascend, kunlun or dcu (built in, or added by a plugin)" in text, text
    text = " ".join(ok(tool(sites, "compile", "--help", plugins=())).split())
    assert "cuda, ascend or kunlun (built in, or added by a plugin)" in text


@pytest.mark.slow
def test_the_model_compiles_for_the_plugin_target(sites: dict[str, Path], compiled: dict) -> None:
    report, art = compiled["report"], compiled["art"]
    assert report["target"] == "dcu" and report["cuda_arch"] is None
    assert report["pipeline"].endswith(",legalize-dcu") and report["passes_run"][-1] == "legalize-dcu"
    # the default of a HardwareTarget, and ONNX for one small rank of inference (ONNX_DEFAULT_MAX_BYTES)
    assert report["emit"] == ["paddle", "onnx"]
    kernels = {k["kernel"] for k in report["kernel_plan"]}
    assert kernels == {"weight_only_linear_dcu(int8)", "dequantize(int4) + moe_experts (portable)"}
    # int4 experts fall back: no fused MoE kernel in its table
    assert report["fallbacks"] and {(f["op"], f["reason"]) for f in report["fallbacks"]} == {
        ("dequantize", "no fused MoE kernel")}
    assert all(f["scope"].endswith("mlp.experts") for f in report["fallbacks"])
    rank = (art / "rank0" / "graph.ir").read_text()
    assert 'lowered:dcu' in rank and 'target = "dcu"' in rank
    dense = [k for k in report["kernel_plan"] if k["kernel"] == "weight_only_linear_dcu(int8)"]
    assert len(dense) == 12  # q/k/v, o, up/gate, down of 3 layers (shared experts in the MoE ones)
    assert rank.count('device_layout = {layout = "dcu"') == 12  # its rules ran on every one
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"] == "dcu" and "cuda_arch" not in manifest
    recipe = json.loads((art / "inference" / "launch.json").read_text())
    assert (recipe["flag"], recipe["env"], recipe["collective_backend"], recipe["paddle_device"]) == (
        "--gpus", {"HIP_VISIBLE_DEVICES": "0"}, "nccl (rccl)", "gpu:0")
    script = (art / "inference" / "launch.sh").read_text()
    assert 'export HIP_VISIBLE_DEVICES="${HIP_VISIBLE_DEVICES:-0}"' in script
    assert re.search(r'--gpus "\$\{HIP_VISIBLE_DEVICES\}" .* run "\$ARTIFACT" --device gpu', script)


@pytest.mark.slow
def test_the_artifact_verifies_and_runs_against_the_float_model(sites: dict[str, Path],
                                                                compiled: dict) -> None:
    art = compiled["art"]
    assert ok(tool(sites, "verify", str(art))).startswith(f"ok: {art} (")
    lowered = logits(sites, str(art), "dcu", "--backend", "interpreter")  # the lowered rank graph itself
    quantized = logits(sites, MODEL, "wint8mix", "--quant", "wint8mix")
    float_ = logits(sites, MODEL, "float")
    assert lowered.shape == (2, 9, 1024) and np.isfinite(lowered).all()
    # legalization keeps every value: the kernel reads the quantized weights, the experts stay portable
    np.testing.assert_array_equal(lowered, quantized)
    rel = np.linalg.norm(lowered - float_) / np.linalg.norm(float_)
    assert rel < 0.10, rel  # the wint8mix budget (docs/quantization.md)


@pytest.mark.slow
def test_the_runtime_reads_the_device_kind_from_the_artifact(compiled: dict,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from ernie_ir.backends.paddle import devices
    from ernie_ir.backends.paddle.session import paddle_device_for

    monkeypatch.setattr(devices, "available_kinds", lambda: {"gpu"})
    assert "dcu" not in devices.TARGET_KINDS
    assert paddle_device_for(compiled["art"]) == "gpu:0"  # launch.json's paddle_device
    monkeypatch.setattr(devices, "available_kinds", lambda: set())
    assert paddle_device_for(compiled["art"]) == "cpu"


@pytest.mark.slow
def test_a_pipeline_may_name_the_plugin_legalize_pass(sites: dict[str, Path]) -> None:
    text = ok(tool(sites, "show", MODEL, "--pipeline", "wint8,legalize-dcu"))
    assert "lowered:dcu" in text and "weight_only_linear_dcu(int8)" in text


@pytest.mark.slow
def test_the_plugin_target_refuses_what_it_lacks_in_one_line(sites: dict[str, Path]) -> None:
    assert one_error_line(tool(sites, "compile", MODEL, "--target", "dcu", "--cuda-arch", "80")) == (
        "error: --cuda-arch applies to --target cuda only, not dcu: drop it")
    line = one_error_line(tool(sites, "compile", MODEL, "--target", "dcu", "--emit", "fastdeploy"))
    assert line.startswith("error: --emit fastdeploy is a cuda inference checkpoint; not --target dcu")
    line = one_error_line(tool(sites, "compile", MODEL, "--target", "dcu", "--quant", "fp8"))
    assert line.startswith("error: --quant fp8 needs FP8 kernels, which dcu lacks")


@pytest.mark.slow
def test_a_broken_target_plugin_never_breaks_the_others(sites: dict[str, Path], tmp_path: Path) -> None:
    out = ok(tool(sites, "compile", "ernie-4.5-0.3b@tiny", "--target", "dcu", "--out",
                  str(tmp_path / "a"), "--json", plugins=("good", "broken")))
    assert json.loads(out.strip().splitlines()[-1])["target"] == "dcu"
    ok(tool(sites, "compile", "ernie-4.5-0.3b@tiny", "--target", "ascend", "--out", str(tmp_path / "b"),
            plugins=("broken",)))
    assert one_error_line(tool(sites, "compile", MODEL, "--target", "tpu", plugins=("good", "broken"))) == (
        "error: unknown target 'tpu': choose one of cuda, ascend, kunlun, dcu; target plugin 'tpu' "
        "(ernie_ir_tpu:TPU) failed to load: ImportError: this target plugin needs the vendor SDK")


def test_the_registry_refuses_what_is_not_a_target_it_can_add(monkeypatch: pytest.MonkeyPatch) -> None:
    from ernie_ir.targets import registry
    from ernie_ir.targets.registry import BUILTIN, TargetRegistry

    class EntryPoint:
        def __init__(self, name: str, value: object) -> None:
            self.name, self.value, self._obj = name, f"pkg:{name}", value

        def load(self) -> object:
            return self._obj

    renamed = BUILTIN[1].model_copy(update={"name": "npu2"})
    eps = [EntryPoint("npu2", lambda: renamed), EntryPoint("other", renamed), EntryPoint("cuda", BUILTIN[0]),
           EntryPoint("junk", object())]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps if group == "ernie_ir.targets" else [])
    reg = TargetRegistry(BUILTIN)
    assert list(reg) == ["cuda", "ascend", "kunlun", "npu2"]  # a function giving the target is fine
    assert reg.origins["npu2"] == "plugin npu2 (pkg:npu2)"
    assert [b.describe() for b in reg.broken] == [
        "target plugin 'other' (pkg:other) failed to load: ValueError: the entry point is named 'other' "
        "but its target is 'npu2'",
        "target plugin 'cuda' (pkg:cuda) failed to load: ValueError: target 'cuda' is already registered "
        "(built-in)",
        "target plugin 'junk' (pkg:junk) failed to load: TypeError: entry point gives object, not a "
        "HardwareTarget"]
