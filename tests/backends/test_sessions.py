"""The backends' one door: `open_backend(artifact, backend)` returns the session that `run`,
`generate` and `eval` share, for every backend in the one ordered list."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli, user_error

from ernie_ir.backends import BACKENDS, BackendError, BackendSession, open_backend, run_artifact
from ernie_ir.backends import sessions as sessions_module
from ernie_ir.targets import CompileOptions, compile_model

IDS = np.array([[1, 5, 9, 2, 7], [3, 3, 8, 1, 4]], dtype=np.int64)


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sessions") / "art"
    compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(out=out, emit="onnx,paddle,paddle-inference",
                  onnx_numerics="exact"))
    return out


def test_the_one_ordered_list() -> None:
    assert BACKENDS == ("interpreter", "onnxruntime", "paddle", "paddle-inference")
    assert list(sessions_module.SESSIONS) == list(BACKENDS)
    assert all(issubclass(cls, BackendSession) and cls.name == name
               for name, cls in sessions_module.SESSIONS.items())


def test_every_backend_opens_and_agrees(art: Path) -> None:
    reference = open_backend(art, "interpreter").logits(IDS)
    scale = float(np.max(np.abs(reference)))
    for backend in BACKENDS:
        session = open_backend(art, backend)
        assert session.name == backend and session.steps_here
        got = session.logits(IDS)
        assert float(np.max(np.abs(got - reference))) <= 5e-5 * scale, backend
        np.testing.assert_array_equal(run_artifact(art, IDS, backend), got)


def test_refusals_are_one_line(art: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(BackendError, match="does not offer backend 'tensorrt'"):
        open_backend(art, "tensorrt")
    plain = tmp_path / "plain"
    compile_model("ernie-4.5-0.3b@tiny", "ascend", CompileOptions(out=plain, emit="paddle"))
    with pytest.raises(BackendError, match="does not offer backend 'onnxruntime'; it offers interpreter"):
        open_backend(plain, "onnxruntime")
    line = user_error(capsys, "run", str(art), "--tokens", "1,2", "--backend", "tpu")
    assert "unknown --backend 'tpu': choose interpreter, onnxruntime, paddle" in line


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every session opened through the door, by backend name."""
    seen: list[str] = []
    for name, cls in list(sessions_module.SESSIONS.items()):
        def init(self, root, manifest, _base=cls, _name=name) -> None:
            seen.append(_name)
            _base.__init__(self, root, manifest)

        monkeypatch.setitem(sessions_module.SESSIONS, name, type(cls.__name__, (cls,), {"__init__": init}))
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_generate_and_eval_open_every_backend_through_the_door(
        art: Path, backend: str, opened: list[str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "run", str(art), "--tokens", "1,2,3", "--backend", backend, "--json")
    assert code == 0, err
    assert opened == [backend]
    next_token = json.loads(out)["argmax"][0][-1]
    code, out, err = cli(capsys, "generate", str(art), "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                         "--ignore-eos", "--backend", backend, "--json")
    assert code == 0, err
    assert opened == [backend, backend]
    assert json.loads(out)["new_tokens"][0][0] == next_token  # greedy: the run's last argmax
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"input_ids": [1, 5, 9, 2, 7, 3, 3, 8]}) + "\n")
    code, out, err = cli(capsys, "eval", str(art), "--data", str(corpus), "--seq-len", "8",
                         "--backend", backend, "--json")
    assert code == 0, err
    assert opened == [backend, backend, backend]
    assert json.loads(out)["tokens_scored"] == 7
