"""`train_artifact`: the training executable of a `--mode training` artifact, on this machine.

Reads `training/train.json` (written at compile time) and `rank0/` (graph + weights), builds the
Paddle Layer (ernie_ir.runtime.paddle_layer; trainable: the params the IR marks trainable, every
other param frozen), and runs a real AdamW loop (`paddle.optimizer.AdamW` over the trainable
params only, per-param learning-rate multipliers such as PACT's 1000x) on next-token
cross-entropy. QAT moving-average state is written back into its params after every step.

Data: a jsonl file of `{"input_ids": [...]}` lines, cut into batches of `batch_size` (padded
with 0, padding ignored by the loss), taken in order and cycled; without data, one fixed
synthetic batch (seeded) is used on every step.

Results: `rank0/` is never modified. With `save=True` the trained params and QAT state go to
`training/checkpoints/run-K-step-N.safetensors` (one per run) and the manifest lists that file with its sha256
(rewritten atomically), so `verify` keeps passing.

A multi-rank artifact (`--tp`/`--ep`) trains on one paddle.distributed gloo process per rank
(ernie_ir.runtime.launcher, ernie_ir.runtime.paddle_dist) with the same batches, optimizer and
loss as here, and exact tensor-parallel gradients, so its losses are the one-rank losses; its
checkpoint is `training/checkpoints/run-K-step-N/` (each rank's params and their merge to
global names and shapes).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.ir import ErnieIRError

from .paddle_layer import require_paddle

RECIPE = Path("training") / "train.json"
IGNORE = -100


def _read_data(path: Path, vocab: int, max_len: int | None = None) -> list[list[int]]:
    seqs: list[list[int]] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ErnieIRError(f"cannot read training data {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ErnieIRError(f"{path}: not UTF-8 text: training data is JSON lines "
                           '{"input_ids": [...]}') from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)["input_ids"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ErnieIRError(f'{path}:{i}: expected a JSON object {{"input_ids": [...]}}') from None
        if (not isinstance(ids, list) or len(ids) < 2
                or not all(isinstance(t, int) and 0 <= t < vocab for t in ids)):
            raise ErnieIRError(f"{path}:{i}: input_ids must be a list of >= 2 token ids in [0, {vocab})")
        if max_len is not None and len(ids) > max_len:
            raise ErnieIRError(f"{path}:{i}: {len(ids)} tokens, but the model has {max_len} positions: "
                               "split the sequence")
        seqs.append(ids)
    if not seqs:
        raise ErnieIRError(f"{path} holds no sequences")
    return seqs


def _batches(seqs: list[list[int]], size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for i in range(0, len(seqs), size):
        chunk = seqs[i:i + size]
        width = max(len(s) for s in chunk)
        ids = np.zeros((len(chunk), width), np.int64)
        labels = np.full((len(chunk), width), IGNORE, np.int64)
        for r, s in enumerate(chunk):
            ids[r, :len(s)] = s
            labels[r, :len(s)] = s
        out.append((ids, labels))
    return out


def read_training_artifact(root: Path) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(manifest, recipe, world size) of a training artifact, every rank's files and the recipe
    checked against the manifest's sha256 (ErnieIRError naming the first problem)."""
    mf = root / "manifest.json"
    if not mf.is_file():
        raise ErnieIRError(f"{root} is not an ernie-ir artifact (no manifest.json)")
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ErnieIRError(f"{mf} is not valid JSON: the artifact is corrupt") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        raise ErnieIRError(f"{mf} is not an ernie-ir artifact manifest")
    if manifest.get("mode") != "training" or not (root / RECIPE).is_file():
        raise ErnieIRError(f"{root} is not a training artifact: compile it with --mode training "
                           "(and --lora-rank R or --quant qat-int8)")
    parallel = manifest.get("parallel")
    world = int(parallel.get("world_size", 1)) if isinstance(parallel, dict) else 1
    names = [f"rank{r}/{f}" for r in range(world) for f in ("graph.ir", "weights.safetensors")]
    for name in (*names, RECIPE.as_posix()):
        if not (root / name).is_file():
            raise ErnieIRError(f"artifact {root}: {name} is missing (listed in manifest.json)")
        digest = hashlib.sha256((root / name).read_bytes()).hexdigest()
        if manifest.get("files", {}).get(name) != digest:
            raise ErnieIRError(f"artifact {root}: {name} was modified (sha256 does not match the manifest)")
    recipe = json.loads((root / RECIPE).read_text(encoding="utf-8"))
    return manifest, recipe, world


def training_batches(recipe: dict[str, Any], graph: Any, data: Path | None,
                     seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (input_ids, labels) batches of a run: `data` cut by the recipe's batch size, or one
    seeded synthetic batch. Every rank of a parallel run takes these same batches."""
    vocab = int(graph.outputs[0].type.shape[-1])
    batch = recipe.get("batch", {})
    if data is not None:
        limits = [n.attrs.limit for n in graph.nodes
                  if n.op == "position_ids" and getattr(n.attrs, "limit", None) is not None]
        max_len = min(limits) if limits else None
        return _batches(_read_data(Path(data), vocab, max_len), int(batch.get("batch_size", 4)))
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(int(batch.get("batch_size", 4)), int(batch.get("seq_len", 16))))
    return [(ids.astype(np.int64), ids.astype(np.int64))]


def make_optimizer(paddle: Any, params: list[Any], recipe: dict[str, Any], lr: float | None,
                   grad_clip: Any) -> Any:
    """AdamW over `params` with the recipe's settings (`lr` None: the recipe's rate)."""
    opt_cfg = recipe.get("optimizer", {})
    return paddle.optimizer.AdamW(
        learning_rate=float(lr if lr is not None else opt_cfg.get("learning_rate", 1e-3)),
        parameters=params, beta1=opt_cfg.get("beta1", 0.9), beta2=opt_cfg.get("beta2", 0.999),
        epsilon=opt_cfg.get("epsilon", 1e-8), weight_decay=opt_cfg.get("weight_decay", 0.0),
        grad_clip=grad_clip)


def run_steps(paddle: Any, layer: Any, optimizer: Any, batches: list[tuple[np.ndarray, np.ndarray]],
              steps: int, on_step: Callable[[int, float], Any] | None = None) -> list[float]:
    """`steps` optimizer steps over `batches` (cycled); the loss of each step. The one training
    loop of every rank count: one process here, or each paddle.distributed rank."""
    losses: list[float] = []
    for step in range(steps):
        ids, labels = batches[step % len(batches)]
        loss = next_token_loss(paddle, layer, ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        layer.commit_state()
        losses.append(float(loss.numpy()))
        if on_step is not None:
            on_step(step + 1, losses[-1])
    return losses


def next_token_loss(paddle: Any, layer: Any, ids: np.ndarray, labels: np.ndarray) -> Any:
    """Mean cross-entropy of logits[:, :-1] against labels[:, 1:] (IGNORE positions skipped)."""
    logits = layer(paddle.to_tensor(ids))
    v = logits.shape[-1]
    return paddle.nn.functional.cross_entropy(
        logits[:, :-1].reshape([-1, v]), paddle.to_tensor(labels[:, 1:].reshape(-1)),
        ignore_index=IGNORE)


def train_artifact(path: Path, steps: int, data: Path | None = None, lr: float | None = None,
                   seed: int = 0, *, save: bool = True,
                   on_step: Callable[[int, float], Any] | None = None,
                   timeout_s: float | None = None) -> list[float]:
    """Train the artifact's trainable params for `steps` AdamW steps; returns the loss of each step.

    lr None: the recipe's learning rate. `on_step(step, loss)` is called after each step.
    A multi-rank artifact runs on one paddle.distributed process per rank (gloo on this CPU,
    ernie_ir.runtime.launcher), bounded by `timeout_s` (default 3600 s).
    """
    paddle = require_paddle()
    root = Path(path)
    if steps < 1:
        raise ErnieIRError(f"--steps must be >= 1, got {steps}")
    if lr is not None and not lr > 0:
        raise ErnieIRError(f"--lr must be > 0, got {lr}")
    manifest, recipe, world = read_training_artifact(root)

    from ernie_ir.ir.storage import load_graph

    from .paddle_layer import build_layer

    graph = load_graph(root / "rank0")
    if world > 1:
        from .launcher import TRAIN_TIMEOUT_S, train_distributed

        batches = training_batches(recipe, graph, data, seed)  # bad data fails here, before any process
        return train_distributed(root, world, steps, batches, lr=lr, seed=seed, save=save,
                                 on_step=on_step,
                                 timeout_s=TRAIN_TIMEOUT_S if timeout_s is None else timeout_s)
    paddle.seed(seed)
    layer = build_layer(graph, device="cpu")
    layer.train()
    layer.track_state = True
    params = layer.trainable_parameters()
    if not params:
        raise ErnieIRError(f"{root}: the graph has no trainable params")
    clip = recipe.get("optimizer", {}).get("grad_clip_norm")
    optimizer = make_optimizer(paddle, params, recipe, lr,
                               paddle.nn.ClipGradByGlobalNorm(clip) if clip else None)
    batches = training_batches(recipe, graph, data, seed)
    losses = run_steps(paddle, layer, optimizer, batches, steps, on_step)
    if save:
        _save_checkpoint(root, manifest, layer, recipe, steps)
    return losses


def _save_checkpoint(root: Path, manifest: dict[str, Any], layer: Any, recipe: dict[str, Any],
                     steps: int) -> Path:
    from safetensors.numpy import save_file

    names = list(recipe.get("trainable", [])) + list(recipe.get("qat_state", []))
    folder = root / "training" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    # One file per run (run-001-step-30, run-002-step-30, ...): a later run never overwrites
    # an earlier one, and the file appears only once it is complete.
    run = 1 + sum(1 for _ in folder.glob("run-*-step-*.safetensors"))
    out = folder / f"run-{run:03d}-step-{steps}.safetensors"
    partial = folder / f".{out.name}.partial"
    save_file({n: np.ascontiguousarray(a) for n, a in layer.state_numpy(names).items()}, str(partial),
              metadata={"format": "ernie-ir-training-checkpoint", "steps": str(steps)})
    os.replace(partial, out)
    record_files(root, manifest, [out])
    return out


def record_files(root: Path, manifest: dict[str, Any], files: list[Path]) -> None:
    """List `files` (inside `root`) with their sha256 in the manifest, rewritten atomically."""
    for f in files:
        manifest.setdefault("files", {})[f.relative_to(root).as_posix()] = \
            hashlib.sha256(f.read_bytes()).hexdigest()
    tmp = root / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, root / "manifest.json")
