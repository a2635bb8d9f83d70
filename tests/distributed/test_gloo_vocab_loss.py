"""The vocabulary-parallel loss of tensor-parallel training (ernie_ir/training/vocab_parallel.py).

- The PyLayer on 2 gloo ranks equals paddle.nn.functional.cross_entropy on the whole logits, the
  per-token loss and d logits (each rank's slice), with ignore_index positions, labels on each
  rank's shard, uneven vocabulary ranges and a maximum held by one rank only.
- The training rank graph keeps its vocabulary shard: no [B, S, V] all_gather, half the logits
  bytes per rank at tp 2; the artifact's graphs (inference) still gather the whole logits.
- tp 2 LoRA training of a dense and a MoE @tiny model with the loss on the shards (the default)
  equals the one-rank run, losses and the merged trained params (so the gradients), as the
  gathered loss does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from _dist_testkit import compile_art, leftover_processes, processes_with_env
from safetensors.numpy import load_file

from ernie_ir.backends.paddle.launch import free_port_block
from ernie_ir.backends.paddle.layer import require_paddle
from ernie_ir.backends.paddle.rank_worker import load_rank_graph
from ernie_ir.ir.storage import load_graph
from ernie_ir.planning.graph_memory import tensor_bytes
from ernie_ir.training.loop import train_artifact
from ernie_ir.training.vocab_parallel import VOCAB_LOSS, keep_vocab_shards

STEPS = 3
WORKER = Path(__file__).with_name("_vocab_loss_worker.py")
TOKEN_ENV = "ERNIE_IR_VOCAB_TEST_TOKEN"


def _tagged(token: str) -> list[int]:
    return processes_with_env(TOKEN_ENV, token)


def _launch_two_ranks(folder: Path, timeout_s: float = 120) -> None:
    """The worker on 2 gloo ranks; every process this launch started is killed before returning."""
    token = uuid.uuid4().hex
    port = free_port_block(2)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--ips", "127.0.0.1",
           "--start_port", str(port), "--log_dir", str(folder / "logs"), "--job_id", f"vocab-{token[:8]}",
           str(WORKER), str(folder)]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update({TOKEN_ENV: token, "ERNIE_IR_PARENT_PID": str(os.getpid()), "PADDLE_DISTRI_BACKEND": "gloo",
                "GLOG_minloglevel": "2"})
    with open(folder / "launch.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=folder, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        for pid in _tagged(token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while _tagged(token) and time.monotonic() < deadline:
            time.sleep(0.1)
    logs = "\n".join(p.read_text(errors="replace")[-2000:]
                     for p in sorted((folder / "logs").glob("workerlog.*")))
    assert code == 0, f"the 2 ranks failed ({code}):\n{logs}"
    assert not _tagged(token)


def _cases() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    out = []
    # even ranges; uneven ranges (3 | 7) with the maximum on rank 0 only, 120 above rank 1's logits;
    # every label on rank 1's shard or ignored
    for n, v, cuts, labels in ((12, 10, [0, 5, 10], [0, 4, 5, 9, -100, 2, 7, 3, -100, 6, 1, 8]),
                               (6, 10, [0, 3, 10], [1, 9, -100, 0, 4, 2]),
                               (5, 10, [0, 7, 10], [7, 8, -100, 9, 9])):
        logits = (rng.standard_normal((n, v)) * 4).astype(np.float32)
        if cuts[1] == 3:
            logits[:3, 1] += 120.0  # beyond Paddle's clip of logit - max at -64
        out.append({"logits": logits, "labels": np.array(labels, np.int64),
                    "grad": rng.uniform(0.5, 2.0, n).astype(np.float32), "cuts": np.array(cuts)})
    return out


def test_pylayer_on_two_gloo_ranks_equals_cross_entropy_on_whole_logits(tmp_path: Path) -> None:
    paddle = require_paddle()
    cases = _cases()
    np.savez(tmp_path / "cases.npz", count=len(cases),
             **{f"{k}{c}": a for c, case in enumerate(cases) for k, a in case.items()})
    began = time.monotonic()
    _launch_two_ranks(tmp_path)
    took = time.monotonic() - began
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    for c, case in enumerate(cases):
        x = paddle.to_tensor(case["logits"], stop_gradient=False)
        want = paddle.nn.functional.cross_entropy(x, paddle.to_tensor(case["labels"]), reduction="none",
                                                  ignore_index=-100).reshape([-1])
        (want * paddle.to_tensor(case["grad"])).sum().backward()
        for r in range(2):
            np.testing.assert_allclose(ranks[r][f"loss{c}"], want.numpy(), rtol=1e-6, atol=1e-6,
                                       err_msg=f"case {c} rank {r}")
        got = np.concatenate([ranks[0][f"grad{c}"], ranks[1][f"grad{c}"]], axis=-1)
        np.testing.assert_allclose(got, x.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"case {c}")
        ignored = case["labels"] == -100
        assert ignored.any() and not got[ignored].any() and not ranks[0][f"loss{c}"][ignored].any()
        err = float(np.abs(got - x.grad.numpy()).max())
        print(f"[vocab-loss] case {c}: cuts {case['cuts'].tolist()}, max |d loss| "
              f"{float(np.abs(ranks[0][f'loss{c}'] - want.numpy()).max()):.1e}, max |d grad| {err:.1e}")
    print(f"[vocab-loss] 2-rank launch {took:.1f} s")
    assert not leftover_processes()


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("vocab-loss")
    kw = {"mode": "training", "lora_rank": 4}
    return {"dense-one": compile_art(tmp, "ernie-4.5-0.3b@tiny", "dense-one", **kw),
            "dense-tp2": compile_art(tmp, "ernie-4.5-0.3b@tiny", "dense-tp2", tp=2, **kw),
            "moe-one": compile_art(tmp, "ernie-4.5-300b-a47b@tiny", "moe-one", **kw),
            "moe-tp2": compile_art(tmp, "ernie-4.5-300b-a47b@tiny", "moe-tp2", tp=2, **kw)}


def test_training_rank_graph_keeps_its_vocabulary_shard(arts: dict[str, Path]) -> None:
    """What train_rank does to the loaded rank graph: no [B, S, V] all_gather, half the logits."""
    env = {"B": 4, "S": 16}
    one = load_graph(arts["dense-one"] / "rank0")
    vocab = int(one.outputs[0].type.shape[-1])
    whole = tensor_bytes(one.outputs[0].type, env)
    for r in range(2):
        _, g = load_rank_graph(arts["dense-tp2"], r, 2)
        (gather,) = [n for n in g if n.op == "all_gather" and n.outputs[0].type.shape[-1] == vocab]
        assert g.outputs[0] is gather.outputs[0]  # on disk (inference): the whole logits
        shard = keep_vocab_shards(g)
        assert shard is not None
        assert (shard.start, shard.stop, shard.size) == (r * vocab // 2, (r + 1) * vocab // 2, vocab)
        assert g.metadata[VOCAB_LOSS] == {"vocab_start": shard.start, "vocab_stop": shard.stop,
                                          "vocab_size": vocab, "world_size": 2}
        assert not [n for n in g if n.op == "all_gather"]
        assert g.outputs[0].producer.op == "lm_head"
        assert tuple(g.outputs[0].type.shape) == ("B", "S", vocab // 2)
        assert tensor_bytes(g.outputs[0].type, env) * 2 == whole
        assert keep_vocab_shards(g) == shard  # idempotent
    print(f"[vocab-loss] per-rank f32 logits at B=4, S=16: 1 rank / gathered {whole} B, "
          f"tp 2 shard {whole // 2} B")
    assert keep_vocab_shards(one) is None  # one rank: nothing gathered


def _close(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.subtract(a, b)) / np.abs(b)))


def _params(art: Path) -> dict[str, np.ndarray]:
    return load_file(str(art / f"training/checkpoints/run-001-step-{STEPS}/params.safetensors"))


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_tp2_vocab_parallel_loss_equals_one_rank(arts: dict[str, Path], model: str) -> None:
    one = train_artifact(arts[f"{model}-one"], STEPS).losses
    began = time.monotonic()
    sharded = train_artifact(arts[f"{model}-tp2"], STEPS, timeout_s=120).losses
    took = time.monotonic() - began
    ref, got = _params(arts[f"{model}-one"]), _params(arts[f"{model}-tp2"])
    gathered = train_artifact(arts[f"{model}-tp2"], STEPS, save=False, timeout_s=120,
                              options={"use_sparse_head_and_loss_fn": False}).losses
    err, err_g = _close(sharded, one), _close(gathered, one)
    print(f"[vocab-loss] {model} LoRA tp 2, {STEPS} steps ({took:.1f} s): max rel vs 1 rank: vocab-parallel "
          f"{err:.2e}, gathered {err_g:.2e}; vocab-parallel vs gathered {_close(sharded, gathered):.2e}")
    assert err < 1e-5 and err_g < 1e-5
    assert sorted(got) == sorted(ref)
    for name, want in ref.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5, err_msg=name)
    assert not leftover_processes()
