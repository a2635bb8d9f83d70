"""`ernie-ir train` as a user watches it (issue 41 item 3), a real process with stdout a pipe:

- a line per step reaches the pipe while the run goes on (not at its end);
- without --data, one line on stderr says it trains on the synthetic batch and names --data, and
  its checkpoints' trainer_state.json records `"synthetic": true`;
- SIGINT exits 130 after printing the last step, the newest checkpoint and the command that
  continues it, which works (run here for one more step); the artifact verifies, no temp folder;
- SIGTERM while a checkpoint is being published (the test-only pause "checkpoint": listed in the
  manifest, its LoRA adapter not yet written) waits until the checkpoint is whole, then exits 143;
  `compile` of that artifact warns that its checkpoint was trained on the synthetic batch.

Each test starts one `train` process of the built-in ernie-4.5-0.3b@tiny (LoRA rank 4), bounded
in time and killed if still running at the end; the timing bounds are generous limits, not
measurements.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cli_kit import run_cli as _cli

pytest.importorskip("paddle")

pytestmark = pytest.mark.slow

BOUND_S = 180.0
"""The most any wait here may take (a loaded 2-core machine), never a measured time."""
STEP = re.compile(r"^step +(\d+)  loss \S+  lr \S+  \S+ tok/s$")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("live") / "art"
    code, _, err = _cli("compile", "ernie-4.5-0.3b@tiny", "--mode", "training", "--lora-rank", "4",
                        "--target", "cuda", "--out", str(out))
    assert code == 0, err
    return out


@pytest.fixture()
def art(compiled: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(compiled, tmp_path / "art"))


def _start(art: Path, *argv: str, **env: str) -> subprocess.Popen[str]:
    """`ernie-ir train ART ARGV` in its own session, SIGINT at its default (a shell's background
    job would inherit it ignored), stdout and stderr pipes."""
    cmd = [sys.executable, "-c", "from ernie_ir.cli.app import main; main()", "train", str(art), *argv]
    return subprocess.Popen(cmd, cwd=art.parent, env={**os.environ, **env}, text=True, bufsize=1,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    """The next stdout line, as soon as the process writes it ('' at its end)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
    assert ready, "no output line within the bound"
    return proc.stdout.readline()


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=BOUND_S)
    return proc.returncode, out, err


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _no_temp_left(art: Path) -> None:
    from ernie_ir.artifacts import verify_artifact

    verify_artifact(art)  # every listed file is there with its hash, nothing half-listed
    folder = art / "training" / "checkpoints"
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]


def test_lines_arrive_live_and_ctrl_c_says_how_to_resume(art: Path) -> None:
    proc = _start(art, "--steps", "1000", "--save-steps", "2")
    try:
        deadline = time.monotonic() + BOUND_S
        first = _read_line(proc, deadline).rstrip("\n")
        assert STEP.match(first) and STEP.match(first)[1] == "1", first
        assert proc.poll() is None  # the line came while the run goes on
        lines = [first]
        while not lines[-1].startswith("checkpoint "):
            lines.append(_read_line(proc, deadline).rstrip("\n"))
            assert lines[-1], "the run ended before its first checkpoint"
        proc.send_signal(signal.SIGINT)
        code, rest, err = _finish(proc)
    finally:
        _stop(proc)
    assert code == 130, err
    lines += rest.splitlines()
    steps = [int(m[1]) for line in lines if (m := STEP.match(line))]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 1000
    newest = [line.removeprefix("checkpoint ") for line in lines if line.startswith("checkpoint ")][-1]
    saved = int(newest.rsplit("-", 1)[1])
    err_lines = [line for line in err.splitlines() if line.strip() and line != "aborted"]
    assert err_lines[0].startswith("no --data: training on the recipe's synthetic batch"), err
    assert "give --data FILE" in err_lines[0]
    command = f"ernie-ir train {art} --steps 1000 --save-steps 2 --resume"
    assert err_lines[-2:] == [f"interrupted after step {steps[-1]} of 1000; newest checkpoint: {newest}",
                              f"continue with: {command}"], err
    _no_temp_left(art)
    state = json.loads((Path(newest) / "trainer_state.json").read_text())
    assert state["step"] == saved and state["data"]["synthetic"] is True
    # the printed command continues the run: here for one more step than the checkpoint's
    argv = shlex.split(command)[1:]
    argv[argv.index("--steps") + 1] = str(saved + 1)
    code, out, err = _cli(*argv)
    assert code == 0, err
    resumed = [STEP.match(line) for line in out.splitlines()]
    assert [int(m[1]) for m in resumed if m] == [saved + 1]


def test_sigterm_while_a_checkpoint_is_published_leaves_it_whole(art: Path) -> None:
    name = "run-001-step-1"
    listed = f"training/checkpoints/{name}/params.safetensors"
    proc = _start(art, "--steps", "1", ERNIE_IR_TEST_PAUSE_AT="checkpoint", ERNIE_IR_TEST_PAUSE_S="2")
    try:
        deadline = time.monotonic() + BOUND_S
        while listed not in (art / "manifest.json").read_text(encoding="utf-8"):
            assert proc.poll() is None and time.monotonic() < deadline, "the checkpoint was never listed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # listed, its adapter not yet written: the run waits for it
        code, out, err = _finish(proc)
    finally:
        _stop(proc)
    folder = art / "training" / "checkpoints" / name
    assert code == 143, err
    assert (folder / "adapter" / "lora_config.json").is_file()  # written after the signal came
    assert out.splitlines()[-1] == f"checkpoint {folder}"
    assert err.splitlines()[-3:] == [f"interrupted after step 1 of 1; newest checkpoint: {folder}",
                                     "every step is done: nothing to resume", "aborted"], err
    _no_temp_left(art)
    # the checkpoint compiles, and compile says it was trained on no data
    code, _, err = _cli("compile", str(art), "--target", "cuda", "--out", str(art.parent / "inference"))
    assert code == 0, err
    assert (f"warning: training/checkpoints/{name}/params.safetensors was trained on the synthetic batch "
            "(`train` without --data), not on data: train with --data FILE first") in err.splitlines()
