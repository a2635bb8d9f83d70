"""Device detection and weight-only kernel dispatch (ernie_ir.backends.paddle.devices), on CPU with
fake probes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ernie_ir.backends.paddle import devices
from ernie_ir.backends.paddle import session as paddle_backend

pytest.importorskip("paddle")


def fake_machine(monkeypatch: pytest.MonkeyPatch, *, gpus: int = 0, cc: tuple[int, int] = (8, 0),
                 custom: tuple[str, ...] = (), xpu: bool = False) -> None:
    monkeypatch.setattr(devices, "_cuda_count", lambda: gpus)
    monkeypatch.setattr(devices, "_cuda_capability", lambda: cc)
    monkeypatch.setattr(devices, "_custom_types", lambda: list(custom))
    monkeypatch.setattr(devices, "_xpu_compiled", lambda: xpu)


def test_real_cpu_machine_has_no_device() -> None:
    assert devices.available_kinds() == set()
    assert devices.run_device("cuda") == "cpu"
    assert devices.weight_only_kernel("cpu", 8) == devices.KernelChoice(devices.PORTABLE)


def test_fake_cuda_sm80_picks_weight_only_linear_arch_80(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_machine(monkeypatch, gpus=1, cc=(8, 0))
    assert devices.available_kinds() == {"gpu"}
    assert devices.run_device("cuda") == "gpu:0"
    assert devices.run_device("ascend") == "cpu"
    assert devices.cuda_arch() == 80
    choice = devices.weight_only_kernel("gpu:0", 8)
    assert choice == devices.KernelChoice("paddle.nn.quant.weight_only_linear", 80)
    assert choice.device_kernel
    assert devices.weight_only_kernel("gpu:0", 4).arch == 80
    assert devices.weight_only_kernel("gpu:0", 8, portable=True).kernel == devices.PORTABLE


@pytest.mark.parametrize(("cc", "arch"), [((7, 0), 70), ((7, 5), 75), ((8, 6), 86), ((8, 9), 89),
                                          ((9, 0), 90), ((10, 0), 90), ((6, 1), 70)])
def test_cuda_arch_from_capability(monkeypatch: pytest.MonkeyPatch, cc: tuple[int, int], arch: int) -> None:
    fake_machine(monkeypatch, gpus=1, cc=cc)
    assert devices.cuda_arch() == arch


def test_fake_npu_machine_picks_npu_op(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_machine(monkeypatch, custom=("npu",))
    assert devices.available_kinds() == {"npu"}
    assert devices.run_device("ascend") == "npu:0"
    assert devices.run_device("cuda") == "cpu"
    choice = devices.weight_only_kernel("npu:0", 8)
    assert choice.kernel == "weight_only_linear_npu" and choice.arch is None
    assert not choice.device_kernel  # the Layer runs the portable form there until checked on hardware
    assert devices.weight_only_kernel("npu:0", 4).kernel == devices.PORTABLE  # int8-only op


def test_fake_xpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_machine(monkeypatch, xpu=True, custom=("intel_gpu",))
    assert devices.available_kinds() == {"xpu"}
    assert devices.run_device("kunlun") == "xpu:0"
    assert devices.weight_only_kernel("xpu:0", 8).kernel == "weight_only_linear_xpu"


def test_launcher_selects_device_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLAGS_selected_gpus", "3")
    assert devices.set_device_string("gpu") == "gpu:3"
    assert devices.set_device_string("cpu") == "cpu"
    from ernie_ir.backends.paddle.rank_worker import device_for

    assert device_for("gpu") == "gpu:3"


def _artifact(tmp_path: Path, target: str) -> Path:
    (tmp_path / "manifest.json").write_text(json.dumps({"target": target, "files": {}}), encoding="utf-8")
    return tmp_path


def test_run_paddle_builds_on_the_device_when_paddle_has_it(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    fake_machine(monkeypatch, gpus=1, cc=(9, 0))
    seen: list[str] = []

    def fake_run_layer(paddle: object, root: Path, ids: np.ndarray, device: str) -> np.ndarray:
        seen.append(device)
        return np.zeros((*ids.shape, 4), np.float32)

    monkeypatch.setattr(paddle_backend, "_run_layer", fake_run_layer)
    root = _artifact(tmp_path, "cuda")
    (root / paddle_backend.MODEL).parent.mkdir(parents=True)
    (root / paddle_backend.MODEL).write_text("{}", encoding="utf-8")  # a CPU model is there too
    out = paddle_backend.run_paddle(root, np.array([[1, 2]]))
    assert seen == ["gpu:0"] and out.shape == (1, 2, 4)


def test_run_paddle_keeps_the_cpu_model_without_the_device(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    fake_machine(monkeypatch, custom=("npu",))  # an NPU machine, a cuda artifact: CPU path
    assert paddle_backend.paddle_device_for(_artifact(tmp_path, "cuda")) == "cpu"
    fake_machine(monkeypatch)
    assert paddle_backend.paddle_device_for(_artifact(tmp_path, "ascend")) == "cpu"
    fake_machine(monkeypatch, custom=("npu",))
    assert paddle_backend.paddle_device_for(_artifact(tmp_path, "ascend")) == "npu:0"


def _lowered(pipeline: str):
    from ernie_ir.load import load_input
    from ernie_ir.passes import run_pipeline

    g = load_input("ernie-4.5-0.3b@tiny")
    run_pipeline(g, pipeline)
    return g


def test_build_layer_on_fake_sm80_plans_the_gpu_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from ernie_ir.backends.paddle.layer import build_layer

    fake_machine(monkeypatch, gpus=1, cc=(8, 0))
    monkeypatch.setattr(devices, "set_device", lambda device: None)  # build only: no GPU here
    g = _lowered("wint8mix,legalize-cuda{cuda_arch=80}")
    assert any(n.op == "weight_only_linear_packed" for n in g)
    layer = build_layer(g, device="gpu:0")
    assert layer.device == "gpu:0"
    assert "paddle.nn.quant.weight_only_linear" in layer.kernels.values()
    dev = list(layer._device_weights.values())
    assert dev and all(d["arch"] == 80 for d in dev)
    assert {d["weight_dtype"] for d in dev} <= {"int8", "int4"}


def test_build_layer_on_fake_npu_records_the_npu_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from ernie_ir.backends.paddle.layer import build_layer

    fake_machine(monkeypatch, custom=("npu",))
    monkeypatch.setattr(devices, "set_device", lambda device: None)
    layer = build_layer(_lowered("wint8,legalize-ascend"), device="npu:0")
    assert layer.kernels and not layer._device_weights
    assert all("weight_only_linear_npu" in k for k in layer.kernels.values())
