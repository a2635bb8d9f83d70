"""A multi-node launch (`--nnodes N --node-rank R --master HOST:PORT`) tried on this machine.

Two `ernie-ir` processes on 127.0.0.1 are node 0 and node 1 of a 2-node job of a tp 2 artifact
(one gloo process per node): node 0's logits (`run --backend paddle`) and losses (`train`)
equal one launch's, node 0 publishes the checkpoint, node 1 prints one line. Each pair is
bounded in time; on any failure SIGTERM, then SIGKILL, reaches every process the test started
(found by a token only they carry in their environment). Bad flags and a master nobody
answers: one line, exit 2, nothing left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from _dist_testkit import IDS, compile_art, leftover_processes, processes_with_env

from ernie_ir.backends.paddle.launch import free_port_block
from ernie_ir.backends.sessions import run_artifact
from ernie_ir.cli.app import main
from ernie_ir.training.loop import train_artifact

MODEL = "ernie-4.5-0.3b@tiny"
PAIR_TIMEOUT_S = 180.0
TOKEN_ENV = "ERNIE_IR_MULTI_NODE_TEST_TOKEN"
CLI = [sys.executable, "-c", "from ernie_ir.cli.app import main; main()"]


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("gloo-multi-node")
    return {"run": compile_art(tmp, MODEL, "tp2", tp=2),
            "train": compile_art(tmp, MODEL, "tp2-train", tp=2, mode="training", lora_rank=4)}


def _tagged(token: str) -> list[int]:
    return processes_with_env(TOKEN_ENV, token)


def _kill_all(token: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the CLIs (each stops its own launch), then SIGKILL whatever of this test is left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    deadline = time.monotonic() + 10
    while (pids := _tagged(token)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    for p in procs:
        p.wait()


def _two_nodes(tmp: Path, args: list[str]) -> tuple[list[int], list[str], list[str]]:
    """`ernie-ir ARGS --nnodes 2 --node-rank R --master 127.0.0.1:PORT` as node 0 and node 1 at
    once: (exit codes, stdouts, stderrs); every process it started is gone when it returns."""
    token = uuid.uuid4().hex
    master = f"127.0.0.1:{free_port_block(1)}"
    env = {**os.environ, TOKEN_ENV: token}
    procs: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as files:
        try:
            for r in (0, 1):
                outs = (files.enter_context(open(tmp / f"node{r}.out", "wb")),
                        files.enter_context(open(tmp / f"node{r}.err", "wb")))
                cmd = [*CLI, *args, "--nnodes", "2", "--node-rank", str(r), "--master", master]
                procs.append(subprocess.Popen(cmd, stdout=outs[0], stderr=outs[1], stdin=subprocess.DEVNULL,
                                              env=env, cwd=tmp, start_new_session=True))
            deadline = time.monotonic() + PAIR_TIMEOUT_S
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            _kill_all(token, procs)
    assert not _tagged(token)
    texts = [(tmp / f"node{r}.{k}").read_text(errors="replace") for k in ("out", "err") for r in (0, 1)]
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"exit codes {codes} (negative: stopped after {PAIR_TIMEOUT_S:g} s)\n{texts}"
    return codes, texts[:2], texts[2:]


def test_two_nodes_run_equals_one_launch(arts: dict[str, Path], tmp_path: Path) -> None:
    art = arts["run"]
    np.save(tmp_path / "ids.npy", IDS)
    one = run_artifact(art, IDS, "paddle", timeout_s=120)
    began = time.monotonic()
    _, outs, errs = _two_nodes(tmp_path, ["run", str(art), "--tokens", str(tmp_path / "ids.npy"), "--backend",
                                          "paddle", "--save-logits", str(tmp_path / "logits.npy"),
                                          "--timeout", "150"])
    print(f"[multi-node] run, 2 nodes x 1 process: {time.monotonic() - began:.1f} s")
    assert np.array_equal(np.load(tmp_path / "logits.npy"), one)
    assert outs[0].startswith(f"logits {list(one.shape)}")
    assert outs[1].strip() == "node 1 of 2 done: node 0 reports the results"
    # node 0 prints every node's command first (stderr)
    assert "node 0: ernie-ir run" in errs[0] and "--node-rank 1 --master 127.0.0.1:" in errs[0]
    assert not errs[1].strip()
    assert not leftover_processes()


def test_two_nodes_train_equals_one_launch_and_node_0_checkpoints(arts: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    art = arts["train"]
    one = train_artifact(art, 3, save=False, timeout_s=120).losses
    began = time.monotonic()
    _, outs, _ = _two_nodes(tmp_path, ["train", str(art), "--steps", "3", "--json", "--no-progress",
                                       "--timeout", "150"])
    print(f"[multi-node] train 3 steps, 2 nodes x 1 process: {time.monotonic() - began:.1f} s")
    report = json.loads(outs[0])
    assert report["losses"] == one
    assert json.loads(outs[1]) == {"node_rank": 1, "nnodes": 2, "done": True}
    [folder] = report["checkpoints"]
    names = {p.name for p in Path(folder).iterdir()}
    assert {"params.safetensors", "rank0.safetensors", "rank1.safetensors", "trainer_state.json"} <= names
    assert not list((art / "training" / "checkpoints").glob(".partial-*"))  # nothing staged is left
    with pytest.raises(SystemExit) as done:
        main(["verify", str(art)])
    assert done.value.code in (0, None)


@pytest.mark.parametrize("flags,message", [
    (["--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:1234"], "--node-rank 2: outside [0, 2)"),
    (["--nnodes", "2", "--node-rank", "-1", "--master", "127.0.0.1:1234"], "--node-rank -1: outside [0, 2)"),
    (["--nnodes", "4", "--node-rank", "0", "--master", "127.0.0.1:1234"], "--nnodes 4 does not divide the 2"),
    (["--nnodes", "2", "--node-rank", "0", "--master", "localhost"], "expected HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "0", "--master", "h:70000"], "expected HOST:PORT"),
    (["--node-rank", "1"], "--node-rank needs --nnodes N"),
    (["--nnodes", "2", "--master", "127.0.0.1:1234"], "--nnodes 2 needs --node-rank R"),
    (["--nnodes", "2", "--node-rank", "1"], "--nnodes 2 needs --master HOST:PORT"),
])
@pytest.mark.parametrize("command", ["run", "train"])
def test_bad_node_flags_are_one_line_and_exit_2(arts: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                flags: list[str], message: str, command: str) -> None:
    args = (["run", str(arts["run"]), "--tokens", "1,2", "--backend", "paddle"] if command == "run"
            else ["train", str(arts["train"]), "--steps", "1"])
    with pytest.raises(SystemExit) as done:
        main([*args, *flags])
    out, err = capsys.readouterr()
    assert done.value.code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not leftover_processes()


def test_node_flags_need_a_multi_rank_paddle_run(arts: dict[str, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        # (without --backend, `auto` takes paddle for a multi-node launch)
        main(["run", str(arts["run"]), "--tokens", "1,2", "--backend", "interpreter", "--nnodes", "2",
              "--node-rank", "1", "--master", "127.0.0.1:1234"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "runs a multi-rank artifact with --backend paddle" in err


def test_unreachable_master_times_out_in_one_line_and_leaves_nothing(
        arts: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Node 1 alone: nobody else joins at the master; after --master-timeout every process is killed."""
    master = f"127.0.0.1:{free_port_block(1)}"
    began = time.monotonic()
    with pytest.raises(SystemExit) as done:
        main(["run", str(arts["run"]), "--tokens", "1,2", "--backend", "paddle", "--nnodes", "2",
              "--node-rank", "1", "--master", master, "--master-timeout", "3", "--timeout", "60"])
    took = time.monotonic() - began
    out, err = capsys.readouterr()
    assert done.value.code == 2 and not out
    assert err.strip().splitlines() == [
        f"error: node 1 of 2: the 2 nodes did not meet at the master {master} within 3 s (--master-timeout): "
        "stopped this node's processes; start every node's command with the same --nnodes and --master "
        "(node 0's reachable address and a free port)"]
    assert took < 60, took
    assert not leftover_processes()
