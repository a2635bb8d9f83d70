"""Start the ranks of a multi-rank artifact as paddle.distributed processes on this machine's CPU.

    logits = run_distributed(Path("art"), ids, world=2)                    # 2 gloo processes
    result = generate_distributed(Path("art"), decoder_texts, prompts, DecodeOptions())

One `python -m paddle.distributed.launch` per call runs the rank worker
(ernie_ir/backends/paddle/rank_worker.py) once per rank over gloo, with the rendezvous on a port
picked free for this run (`--ips 127.0.0.1 --start_port P`), so concurrent runs do not
collide. The call is bounded by a timeout. The launcher and each rank run in their own
sessions, so on a failure, a timeout or an interrupt every process the call started is
killed, found by a token only they carry in their environment, and `DistributedRunError`
names the failing rank with its one-line error and carries the tail of its log
(`log_tail`). Nothing is printed: the logs live in a temporary folder removed at the end.

Several nodes: inside `with multi_node(NodeSpec(nnodes, node_rank, "HOST:PORT")):` each call
is this node's share of a job of `nnodes` launches (`--nnodes N --rank R --master HOST:PORT
--nproc_per_node processes/N`, the job id derived from the master, so every node names the same
job). Node R runs global ranks R*k .. R*k+k-1. Node 0 holds rank 0, so it writes the results and
publishes the checkpoints (the other nodes' ranks only stage their own shard files, which rank 0
merges: the artifact must be at the same path on every node, a shared filesystem for
checkpoints); on any other node a successful call raises `NodeFinished` instead of returning.
Until every node has joined, `master_timeout_s` bounds the wait (then every process is killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.backends.paddle.launch_files import (
    DECODE_LOGITS,
    DECODE_REQUEST,
    DECODE_RESULT,
    DECODE_TOKENS,
    DECODER_GRAPH,
    ERROR_FILE,
    write_decode_request,
)
from ernie_ir.ir import ErnieIRError
from ernie_ir.runtime.decoding import DecodeResult

RUN_TIMEOUT_S = 600.0
MASTER_TIMEOUT_S = 60.0
"""Seconds a node of a multi-node launch waits for every node to join at the master."""
WORKER = "ernie_ir.backends.paddle.rank_worker"
"""The inference rank worker's module (`run`, `generate`), started with `python -m`."""
TOKEN_ENV = "ERNIE_IR_LAUNCH_TOKEN"
HOST = "127.0.0.1"
# A CPU run: the launcher must not pick devices from the caller's environment.
_DEVICE_ENV = ("CUDA_VISIBLE_DEVICES", "XPU_VISIBLE_DEVICES", "XPULINK_VISIBLE_DEVICES",
               "ASCEND_RT_VISIBLE_DEVICES", "NPU_VISIBLE_DEVICES", "PADDLE_XCCL_BACKEND")


def device_env(artifact: Path) -> set[str]:
    """The environment variables that pick devices for `artifact`: the built-in targets' and
    those its launch recipes set (`*/launch.json` "env": a plugin target's own, such as
    HIP_VISIBLE_DEVICES). A recipe that cannot be read adds nothing (verify reports it)."""
    names = set(_DEVICE_ENV)
    for recipe in sorted(Path(artifact).glob("*/launch.json")):
        with contextlib.suppress(OSError, ValueError, RecursionError):
            env = json.loads(recipe.read_text(encoding="utf-8")).get("env")
            if isinstance(env, dict):
                names.update(k for k in env if isinstance(k, str))
    return names
_NOISE = ("ccache", "warnings.warn(warning_message)")
TAIL_LINES = 20


class DistributedRunError(ErnieIRError):
    """A rank failed, or the ranks did not finish in time. The message is one line; `log_tail`
    holds the last lines of the failing rank's log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


@dataclass(frozen=True)
class NodeSpec:
    """This machine's place in a multi-node launch: node `node_rank` of `nnodes`, meeting the
    others at `master` (HOST:PORT, on node 0: paddle.distributed.launch's rendezvous)."""

    nnodes: int
    node_rank: int
    master: str
    master_timeout_s: float = MASTER_TIMEOUT_S

    def processes_per_node(self, processes: int) -> int:
        """`processes` / nnodes; ErnieIRError when nnodes does not divide it."""
        if processes % self.nnodes:
            raise ErnieIRError(f"--nnodes {self.nnodes} does not divide the {processes} processes of this "
                               f"run: give a divisor of {processes} (each node runs processes / nnodes)")
        return processes // self.nnodes

    @property
    def job_id(self) -> str:
        """The same on every node of the job (paddle's rendezvous keys are per job)."""
        return "ernie-ir-" + re.sub(r"[^A-Za-z0-9]+", "-", self.master)


class NodeFinished(Exception):
    """This node's share of a multi-node launch finished; node 0 reports the results."""

    def __init__(self, node_rank: int, nnodes: int) -> None:
        super().__init__(f"node {node_rank} of {nnodes} done: node 0 reports the results")
        self.node_rank, self.nnodes = node_rank, nnodes


def parse_nodes(nnodes: int | None, node_rank: int | None, master: str | None,
                master_timeout_s: float | None = None) -> NodeSpec | None:
    """The NodeSpec of the `--nnodes/--node-rank/--master/--master-timeout` flags (None: one
    node, no flag given, or --nnodes 1); ErnieIRError (one line) for a bad combination."""
    if nnodes is None:
        given = [f for f, v in (("--node-rank", node_rank), ("--master", master),
                                ("--master-timeout", master_timeout_s)) if v is not None]
        if given:
            raise ErnieIRError(f"{'/'.join(given)} {'needs' if len(given) == 1 else 'need'} --nnodes N "
                               "(a launch over N nodes)")
        return None
    if nnodes < 1:
        raise ErnieIRError(f"--nnodes {nnodes}: give at least 1 node")
    if node_rank is None and nnodes > 1:
        raise ErnieIRError(f"--nnodes {nnodes} needs --node-rank R (0 .. {nnodes - 1}: this machine's node)")
    rank = 0 if node_rank is None else node_rank
    if not 0 <= rank < nnodes:
        raise ErnieIRError(f"--node-rank {rank}: outside [0, {nnodes}) (the nodes are 0 .. {nnodes - 1})")
    if master_timeout_s is not None and not 0 < master_timeout_s < float("inf"):
        raise ErnieIRError(f"--master-timeout {master_timeout_s}: give a finite number of seconds above 0")
    if nnodes == 1:
        return None
    if master is None:
        raise ErnieIRError(f"--nnodes {nnodes} needs --master HOST:PORT (node 0's address and a free port)")
    host, sep, port = master.rpartition(":")
    bad_host = not host or any(c.isspace() for c in host)
    if not sep or bad_host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ErnieIRError(f"--master {master!r}: expected HOST:PORT (node 0's address and a free port "
                           "in 1 .. 65535), e.g. 10.0.0.1:36000")
    return NodeSpec(nnodes, rank, f"{host}:{int(port)}",
                    MASTER_TIMEOUT_S if master_timeout_s is None else float(master_timeout_s))


_NODES: ContextVar[NodeSpec | None] = ContextVar("ernie_ir_nodes", default=None)


@contextlib.contextmanager
def multi_node(spec: NodeSpec | None) -> Iterator[None]:
    """Every launch inside runs as this node's share of `spec`'s job (None: one node)."""
    token = _NODES.set(spec)
    try:
        yield
    finally:
        _NODES.reset(token)


def current_nodes() -> NodeSpec | None:
    """The NodeSpec of the enclosing `multi_node` (None: one node)."""
    return _NODES.get()


def free_port_block(n: int) -> int:
    """A port P with P .. P+n-1 free on 127.0.0.1 (the launcher gives rank r port P+r; rank 0
    serves the rendezvous on P). Random, so concurrent runs rarely even try the same one."""
    rng = random.SystemRandom()
    for _ in range(200):
        base = rng.randint(20000, 60000 - n)
        if all(_port_free(base + i) for i in range(n)):
            return base
    raise DistributedRunError(f"no {n} free TCP ports on {HOST} for the rendezvous: free some ports "
                              "and retry")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _tagged(token: str) -> Iterator[int]:
    """pids of the live processes whose environment carries this launch's token."""
    needle = f"{TOKEN_ENV}={token}".encode()
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    yield int(name)
        except OSError:
            continue


def _kill_tagged(token: str) -> None:
    deadline = time.monotonic() + 5.0
    while True:
        pids = list(_tagged(token))
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if line.strip() and not any(n in line for n in _NOISE)]
    return "\n".join(kept[-lines:])


class RankProcesses:
    """One launch of the rank worker: `start`, then `wait` (which always leaves no process)."""

    def __init__(self, artifact: Path, command: str | None, args: list[str], world: int, workdir: Path,
                 *, worker: str = WORKER) -> None:
        """`worker`: the module each rank runs (`python -m`), `command` its subcommand (None: none)."""
        self.artifact, self.command, self.args, self.worker = artifact, command, args, worker
        self.world, self.workdir = world, workdir
        self.token = uuid.uuid4().hex
        self.nodes = current_nodes()
        self.logs = workdir / "logs"
        self.proc: subprocess.Popen[bytes] | None = None
        if self.nodes is None:
            self.per_node, self.first_rank = world, 0
            self.port = free_port_block(world)
            self.master = f"{HOST}:{self.port}"
            self.rendezvous: str | None = self.master
        else:
            self.per_node = self.nodes.processes_per_node(world)
            self.first_rank = self.nodes.node_rank * self.per_node
            self.master = self.nodes.master
            self.rendezvous = None  # the ranks' PADDLE_MASTER, read from them once they run

    def start(self) -> None:
        if self.nodes is None:
            where = ["--nproc_per_node", str(self.world), "--ips", HOST, "--start_port", str(self.port),
                     "--job_id", f"ernie-ir-{self.token[:8]}"]
        else:
            where = ["--nnodes", str(self.nodes.nnodes), "--rank", str(self.nodes.node_rank),
                     "--master", self.master, "--nproc_per_node", str(self.per_node),
                     "--job_id", self.nodes.job_id]
        cmd = [sys.executable, "-m", "paddle.distributed.launch", *where, "--log_dir", str(self.logs),
               sys.executable, "-m", self.worker, *([self.command] if self.command else []),
               str(self.artifact.resolve()), *self.args]
        strip = device_env(self.artifact)
        # An inherited launch variable would override the flags (PADDLE_TRAINER_ID the node rank).
        env = {k: v for k, v in os.environ.items() if k not in strip and not k.startswith("PADDLE_")}
        env.update({TOKEN_ENV: self.token, "ERNIE_IR_PARENT_PID": str(os.getpid()),
                    "ERNIE_IR_WORKDIR": str(self.workdir), "PADDLE_DISTRI_BACKEND": "gloo",
                    "PYTHONUNBUFFERED": "1"})
        env.setdefault("GLOG_minloglevel", "2")  # Paddle's C++ INFO lines would bury the rank's error
        with open(self.workdir / "launch.log", "wb") as log:
            try:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=env, cwd=self.workdir,
                                             start_new_session=True)
            except OSError as e:
                raise DistributedRunError(f"cannot start paddle.distributed.launch ({e.strerror or e}): "
                                          "check the Python environment") from None

    def wait(self, timeout_s: float, on_poll: Callable[[], Any] | None = None) -> None:
        """Until every rank exits; DistributedRunError on a failure or after `timeout_s`."""
        assert self.proc is not None
        begun = time.monotonic()
        deadline = begun + timeout_s
        formed = self.nodes is None
        try:
            while True:
                try:
                    code = self.proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if on_poll is not None:
                    on_poll()
                if not formed:
                    formed = self._check_formed(time.monotonic() - begun)
                if formed and self.rendezvous is None:
                    self.rendezvous = self._ranks_master()
                if time.monotonic() > deadline:
                    self.stop()
                    raise DistributedRunError(
                        f"the {self.world} ranks did not finish within {timeout_s:g} s: stopped them; "
                        "allow more time (--timeout SECONDS) for a larger model",
                        log_tail(self.logs / "workerlog.0"))
            if on_poll is not None:
                on_poll()
        finally:
            self.stop()
        if code != 0:
            raise self.failure(code)

    def _check_formed(self, waited_s: float) -> bool:
        """Whether every node has joined (paddle.distributed.launch starts this node's ranks, and
        so their logs, only then); DistributedRunError past the master timeout."""
        assert self.nodes is not None
        if any(self.logs.glob("workerlog.*")):
            return True
        if waited_s > self.nodes.master_timeout_s:
            self.stop()
            n = self.nodes
            raise DistributedRunError(
                f"node {n.node_rank} of {n.nnodes}: the {n.nnodes} nodes did not meet at the master "
                f"{n.master} within {n.master_timeout_s:g} s (--master-timeout): stopped this node's "
                "processes; start every node's command with the same --nnodes and --master (node 0's "
                "reachable address and a free port)")  # one line: the launcher's log only says "waiting"
        return False

    def _ranks_master(self) -> str | None:
        """PADDLE_MASTER of this launch's ranks (the same on every node: it names the
        checkpoint staging folder), read from a running rank's environment."""
        for pid in _tagged(self.token):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            except OSError:
                continue
            if b"PADDLE_TRAINER_ID" in env and b"PADDLE_MASTER" in env:
                return env[b"PADDLE_MASTER"].decode(errors="replace")
        return None

    def stop(self) -> None:
        """Kill every process of this launch: the launcher and its ranks (each in its own
        session, so no single process group holds them), found by their token."""
        if self.proc is None:
            return
        _kill_tagged(self.token)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        _kill_tagged(self.token)  # anything the launcher started while it was being killed

    def failure(self, code: int) -> DistributedRunError:
        """The error of a failed launch: the rank that failed first, its line, its log's tail."""
        errors = sorted(self.workdir.glob(ERROR_FILE.format(rank="*")),
                        key=lambda p: (p.stat().st_mtime, p.name))
        if errors:
            rank = int(re.findall(r"\d+", errors[0].name)[-1])
            line = errors[0].read_text(encoding="utf-8").strip() or "failed"
            return DistributedRunError(f"rank {rank} of {self.world} failed: {line}",
                                       log_tail(self.logs / f"workerlog.{rank - self.first_rank}"))
        for local in range(self.per_node):  # the log names count this node's ranks from 0
            rank = self.first_rank + local
            log = self.logs / f"workerlog.{local}"
            if "Traceback" in log_tail(log, 10_000) or "Error" in log_tail(log, 5):
                return DistributedRunError(f"rank {rank} of {self.world} exited with an error (launcher "
                                           f"exit code {code}); see the log tail", log_tail(log))
        return DistributedRunError(f"paddle.distributed.launch failed (exit code {code}) before any rank "
                                   "reported an error; see the log tail",
                                   log_tail(self.workdir / "launch.log"))


def require_paddle() -> None:
    from ernie_ir.backends.paddle.layer import require_paddle

    require_paddle()


def run_distributed(artifact: Path, input_ids: np.ndarray, world: int, *,
                    timeout_s: float = RUN_TIMEOUT_S) -> np.ndarray:
    """Logits [B, S, V] of a multi-rank artifact, run by `world` gloo processes (rank 0's)."""
    require_paddle()
    workdir = Path(tempfile.mkdtemp(prefix="ernie-ir-dist-"))
    try:
        np.save(workdir / "ids.npy", np.ascontiguousarray(input_ids, dtype=np.int64))
        out = workdir / "logits.npy"
        ranks = RankProcesses(Path(artifact), "run", ["--tokens", str(workdir / "ids.npy"),
                                                      "--save-logits", str(out)], world, workdir)
        ranks.start()
        ranks.wait(timeout_s)
        finish_node(ranks)
        if not out.is_file():
            raise DistributedRunError("rank 0 finished without writing its logits",
                                      log_tail(ranks.logs / "workerlog.0"))
        return np.load(out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


StepCallback = Callable[[int, np.ndarray, list[bool]], Any]
"""on_step(step, tokens [B], live): as `decode`'s on_tokens, called as rank 0 reports each step."""


def generate_distributed(artifact: Path, decoders: Sequence[str], prompts: list[list[int]], options: Any,
                         *, on_step: StepCallback | None = None,
                         timeout_s: float = RUN_TIMEOUT_S) -> DecodeResult:
    """Generate with a multi-rank artifact on len(decoders) gloo processes: rank r builds its
    Paddle Layer from `decoders[r]` (the text of its decoder graph, the kv-cache pass applied;
    its params are read from the artifact's rank{r}/weights.safetensors) and every rank runs
    the generation loop in lockstep; rank 0's DecodeResult. `options` is a DecodeOptions;
    sampling without a seed gets a random one here (every rank draws from the same one)."""
    require_paddle()
    if not options.sampling.greedy and options.sampling.seed is None:
        seed = random.SystemRandom().getrandbits(63)
        options = replace(options, sampling=replace(options.sampling, seed=seed))
    world = len(decoders)
    workdir = Path(tempfile.mkdtemp(prefix="ernie-ir-dist-"))
    try:
        write_decode_request(workdir / DECODE_REQUEST, prompts, options)
        for rank, text in enumerate(decoders):
            (workdir / DECODER_GRAPH.format(rank=rank)).write_text(text, encoding="utf-8")
        steps = workdir / DECODE_TOKENS
        seen = 0

        def poll() -> None:
            nonlocal seen
            if on_step is None or not steps.is_file():
                return
            lines = steps.read_text(encoding="utf-8").splitlines(keepends=True)
            for line in lines[seen:]:
                if not line.endswith("\n"):
                    break  # rank 0 is still writing it
                record = json.loads(line)
                on_step(int(record["step"]), np.asarray(record["tokens"], np.int64), list(record["live"]))
                seen += 1

        ranks = RankProcesses(Path(artifact), "generate", ["--workdir", str(workdir)], world, workdir)
        ranks.start()
        ranks.wait(timeout_s, poll)
        finish_node(ranks)
        done = workdir / DECODE_RESULT
        if not done.is_file():
            raise DistributedRunError("rank 0 finished without writing its result",
                                      log_tail(ranks.logs / "workerlog.0"))
        data = json.loads(done.read_text(encoding="utf-8"))
        logits = list(np.load(workdir / DECODE_LOGITS)) if options.keep_logits else []
        return DecodeResult(prompts=[list(p) for p in prompts], new_tokens=data["new_tokens"],
                            finish_reasons=data["finish_reasons"], prefill_ms=float(data["prefill_ms"]),
                            decode_ms=[float(t) for t in data["decode_ms"]], step_logits=logits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def finish_node(ranks: RankProcesses) -> None:
    """NodeFinished on a node other than 0 (whose ranks hold no result) once its ranks exited well."""
    if ranks.nodes is not None and ranks.nodes.node_rank != 0:
        raise NodeFinished(ranks.nodes.node_rank, ranks.nodes.nnodes)
