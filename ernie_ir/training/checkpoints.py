"""Training checkpoints: their folder, what `--resume` reads back, and the pieces that one-rank
training (`training.loop.train_artifact`) and each rank of a multi-rank run
(`training.rank_worker.train_rank`)
share. Imports neither of them (both import this module), nor Paddle at module level.

Every checkpoint is a folder, published whole (written under a temp name, renamed and listed
with its sha256 in the manifest under the artifact's lock):

    training/checkpoints/run-K-step-N/
      params.safetensors              every trained param + QAT state at global names and shapes
      rank{r}.safetensors             several ranks only: rank r's slices, as its graph holds them
                                      (data parallel: replica 0's; the replicas hold the same)
      optimizer.rank{r}.safetensors   rank r's AdamW state (data parallel: replica 0's ranks, or
                                      with sharding every process g's own share), keyed
                                      `<param>/moment1`, `/moment2`,
                                      `/beta1_pow_acc`, `/beta2_pow_acc` (`/master_weight` with
                                      master weights): the IR param names, so the keys do not
                                      depend on the names Paddle gave a Layer's tensors
      trainer_state.json              see `trainer_state_base`

K numbers the runs of the artifact (1 + the largest K there when a run publishes its first
checkpoint); every checkpoint of one run has its K. A resumed run is a new run: its checkpoints
are run-K'-step-N with a new K' and `resumed_from` naming the checkpoint it started from, so it
never collides with what the run it resumed wrote. "Newest" is the largest (K, N).

`trainer_state.json`: format tag and version, `step` reached, `steps` (the run's total, which
the learning-rate schedule decays to), `run_id` (random, per run), `world_size` (the
model-parallel ranks), `dp` and `sharding` (the data-parallel layout), `artifact`
(sha256 over the manifest's digests of every rank's graph.ir and weights.safetensors),
`options` (the resolved TrainOptions), `data` (batch count, sha256 of the batch arrays, the
position: batches taken = step x grad_accum), `loss` and `eval_loss` at that step,
`resumed_from`, and `rng_state` (each process's Paddle generator states, CPU and device: rank{g}
for every one of the dp x world processes).

Resuming (`find_checkpoint`, `read_resume_point`, `restore_rank`) restores the trained params,
the optimizer state, the RNG state and the step; the batches and the learning rate follow from
the step (both are functions of the step index), so a resumed run continues the run it resumed
bit for bit when given the checkpoint's `steps`. Refused, one line each: no checkpoint, another
artifact, another world size, another data-parallel layout (dp, sharding: named both), other
data, `steps` not above the checkpoint's step, and another
value of an option that fixes the schedule or the data position (`MATCHED_OPTIONS`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.artifacts.manifest import Manifest
from ernie_ir.backends.paddle.launch_files import CHECKPOINTS
from ernie_ir.ir import ErnieIRError

STATE_FORMAT = "ernie-ir-trainer-state"
STATE_VERSION = 1
FILE_FORMAT = "ernie-ir-training-checkpoint"
PARAMS = "params.safetensors"
RANK_PARAMS = "rank{rank}.safetensors"
OPTIMIZER = "optimizer.rank{rank}.safetensors"
TRAINER_STATE = "trainer_state.json"
_RNG_STAGED = ".rng.rank{rank}.json"
"""Each rank's RNG state, staged for rank 0 to fold into trainer_state.json."""
_NAME = re.compile(r"^run-(\d+)-step-(\d+)(?:\.safetensors)?$")
MATCHED_OPTIONS = ("lr", "schedule", "warmup_steps", "batch_size", "grad_accum")
"""Options a resumed run must share with its checkpoint: they fix the learning rate of each step
and which batches each step takes."""
LATEST = "latest"


@dataclass(frozen=True)
class TrainResult:
    """What `train_artifact` returns."""

    losses: list[float]
    """The loss of each step this run took: steps first_step .. steps."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, mean next-token loss over the evaluation data) every eval_steps and at the end."""
    checkpoints: list[Path] = field(default_factory=list)
    """The checkpoint folders this run published that are still there (save_total_limit removes
    older ones), oldest first."""
    first_step: int = 1
    """The step number of losses[0]: 1, or the resumed checkpoint's step + 1."""
    rank_stats: list[dict[str, Any]] = field(default_factory=list)
    """Per process (rank order), measured at the end of the run: `optimizer_state_bytes` (the
    optimizer's state tensors held), `gradient_bytes` (the gradients held at the last step,
    after the data-parallel reduce), `peak_rss_bytes`, `dp_index`, `mp_rank`."""
    precision: str = ""
    """One line: the run's dtypes (a CPU run: f32) and those the recipe keeps on a device
    (training.precision.Precision.cpu_line); "" for an artifact that records no recipe."""


@dataclass(frozen=True)
class RankPlace:
    """Where a process sits in a run: it runs rank graph `rank` of the `world` rank graphs of one
    replica (pp stages x the model-parallel ranks) and is process `process` of `processes`
    (data parallel: dp x world, process g being replica g // world). One rank: the defaults."""

    rank: int = 0
    world: int = 1
    process: int = 0
    processes: int = 1

    @property
    def replica(self) -> int:
        """The data-parallel replica this process belongs to."""
        return self.process // self.world

    @property
    def first_replica(self) -> bool:
        """Replica 0: the one whose params (and unsharded optimizer state) a checkpoint holds."""
        return self.process < self.world


# -- names -------------------------------------------------------------------------------------


def checkpoint_order(name: str) -> tuple[int, int] | None:
    """(K, N) of a checkpoint named run-K-step-N (a folder, or an earlier layout's single
    .safetensors file); None for any other name."""
    m = _NAME.match(name)
    return (int(m[1]), int(m[2])) if m else None


def list_checkpoints(root: Path) -> list[Path]:
    """The artifact's checkpoints, oldest first (by run, then step)."""
    folder = Path(root) / CHECKPOINTS
    if not folder.is_dir():
        return []
    ranked = sorted((key, p) for p in folder.iterdir() if (key := checkpoint_order(p.name)) is not None)
    return [p for _, p in ranked]


def prune_checkpoints(root: Path, keep: int, spare: Callable[[str], bool] | None = None) -> list[Path]:
    """Keep the artifact's `keep` newest checkpoints; the older ones are deleted and unlisted
    from the manifest (under the artifact's lock). Names `spare` accepts are neither counted nor
    removed (checkpoints whose on_checkpoint has not run yet). Returns those removed."""
    from ernie_ir.artifacts.publish import retire_published

    folder = Path(root) / CHECKPOINTS
    if not folder.is_dir():
        return []

    def order(name: str) -> tuple[int, int] | None:
        return None if spare is not None and spare(name) else checkpoint_order(name)

    return retire_published(Path(root), folder, keep, order)


# -- fingerprints --------------------------------------------------------------------------------


def artifact_fingerprint(manifest: Manifest, world: int) -> str:
    """sha256 over the manifest's digests of every rank's graph and weights: the same for two
    artifacts only when they hold the same model, split the same way."""
    files = manifest.files
    names = [f"rank{r}/{f}" for r in range(world) for f in ("graph.ir", "weights.safetensors")]
    return hashlib.sha256(json.dumps({n: files.get(n) for n in names}, sort_keys=True).encode()).hexdigest()


def batches_fingerprint(batches: list[tuple[np.ndarray, np.ndarray]]) -> str:
    """sha256 of the batch arrays, in order (shapes, dtypes and bytes)."""
    h = hashlib.sha256()
    for ids, labels in batches:
        for a in (ids, labels):
            a = np.ascontiguousarray(a)
            h.update(f"{a.dtype.str}{list(a.shape)}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def checkpoint_expected(manifest: Manifest) -> dict[str, Any]:
    """What publishing a checkpoint checks the artifact against: the manifest's files except the
    checkpoints (which this or another run adds and removes meanwhile)."""
    prefix = CHECKPOINTS.as_posix() + "/"
    return {"files": {n: d for n, d in manifest.files.items() if not n.startswith(prefix)}}


# -- RNG -----------------------------------------------------------------------------------------


def _state_json(state: Any) -> list[Any]:
    out: list[Any] = []
    for item in state.__getstate__():
        if isinstance(item, (list, tuple)) and all(isinstance(b, int) and 0 <= b < 256 for b in item):
            out.append({"bytes": base64.b64encode(bytes(item)).decode("ascii")})
        else:
            out.append(item)
    return out


def _state_object(paddle: Any, data: list[Any]) -> Any:
    cls = type(paddle.get_rng_state("cpu")[0])
    state = cls.__new__(cls)
    state.__setstate__(tuple(list(base64.b64decode(x["bytes"])) if isinstance(x, dict) else x for x in data))
    return state


def rng_state(paddle: Any) -> dict[str, Any]:
    """Paddle's generator states: the CPU's, and the current device's when it is not the CPU."""
    out: dict[str, Any] = {"cpu": [_state_json(s) for s in paddle.get_rng_state("cpu")]}
    device = str(paddle.device.get_device())
    if not device.startswith("cpu"):
        out["device"] = [_state_json(s) for s in paddle.get_rng_state()]
    return out


def set_rng_state(paddle: Any, state: dict[str, Any]) -> None:
    paddle.set_rng_state([_state_object(paddle, s) for s in state["cpu"]], device="cpu")
    if "device" in state and not str(paddle.device.get_device()).startswith("cpu"):
        paddle.set_rng_state([_state_object(paddle, s) for s in state["device"]])


# -- optimizer state ---------------------------------------------------------------------------------

_ACC = re.compile(r"^(?P<acc>[A-Za-z][A-Za-z0-9_]*?)_\d+$")


def optimizer_arrays(optimizer: Any, layer: Any) -> dict[str, np.ndarray]:
    """The optimizer's state (`optimizer.state_dict()`) as numpy, keyed `<IR param>/<accumulator>`:
    Paddle names an accumulator `<tensor name>_<accumulator>_<k>`, and a Layer's tensor names
    depend on how many Layers the process built before it; the IR names do not."""
    by_tensor = {layer.tensor(n).name: n for n in layer.trainable_names}
    out: dict[str, np.ndarray] = {}
    for key, value in optimizer.state_dict().items():
        if key == "LR_Scheduler":
            continue
        if key == "master_weights":
            for tname, t in value.items():
                out[f"{by_tensor[tname]}/master_weight"] = np.ascontiguousarray(t.numpy())
            continue
        owner = None
        for i, ch in enumerate(key):  # the longest tensor name that key starts with, then "_"
            if ch == "_" and key[:i] in by_tensor:
                owner = key[:i]
        m = _ACC.match(key[len(owner) + 1:]) if owner is not None else None
        if owner is None or m is None:
            raise ErnieIRError(f"optimizer state {key!r} belongs to no trained param: cannot checkpoint it")
        out[f"{by_tensor[owner]}/{m['acc']}"] = np.ascontiguousarray(value.numpy())
    return out


def load_optimizer_arrays(paddle: Any, optimizer: Any, layer: Any, arrays: dict[str, np.ndarray],
                          where: str) -> None:
    """Give a fresh optimizer (no step taken yet) the state `optimizer_arrays` wrote, through
    `set_state_dict`: each key under the name Paddle will give that accumulator when the first
    step creates it."""
    from paddle.base import unique_name

    ids = getattr(getattr(unique_name, "generator", None), "ids", {})
    state: dict[str, Any] = {}
    masters: dict[str, Any] = {}
    trained = set(layer.trainable_names)
    for key, arr in arrays.items():
        name, _, acc = key.rpartition("/")
        if name not in trained or not acc:
            raise ErnieIRError(f"{where}: optimizer state {key!r} names no trained param of this artifact")
        tensor = layer.tensor(name)
        if acc == "master_weight":
            masters[tensor.name] = paddle.to_tensor(arr)
            continue
        if acc.startswith("moment") and tuple(arr.shape) != tuple(tensor.shape):
            raise ErnieIRError(f"{where}: optimizer state {key!r} is {list(arr.shape)}, the param "
                               f"{list(tensor.shape)}")
        base = f"{tensor.name}_{acc}"
        state[f"{base}_{ids.get(base, 0)}"] = arr
    held = getattr(optimizer, "param_names", trained)  # a sharded optimizer holds its own params only
    missing = sorted(n for n in held if f"{n}/moment1" not in arrays)
    if missing:
        raise ErnieIRError(f"{where}: the optimizer state lacks trained param {missing[0]}")
    if masters:
        state["master_weights"] = masters
    optimizer.set_state_dict(state)


# -- writing ----------------------------------------------------------------------------------------


def stage_rank_state(stage: Path, paddle: Any, layer: Any, optimizer: Any, names: list[str],
                     place: RankPlace, step: int, *, params: bool = True,
                     optimizer_state: bool = True) -> None:
    """Write rank `place.rank`'s part of a checkpoint into `stage`: its params (params.safetensors
    on one rank, rank{r}.safetensors on several), its optimizer state and its RNG state. Data
    parallel: its optimizer and RNG files are named by `place.process`, the process's global
    rank; `params` / `optimizer_state` False where replica 0 writes them."""
    from safetensors.numpy import save_file

    rank, world, g = place.rank, place.world, place.process
    meta = {"format": FILE_FORMAT, "step": str(step), "rank": str(rank), "world_size": str(world),
            **({"process": str(g)} if g != rank else {})}
    if params:
        held = [n for n in names if n in layer.param_attrs]
        file = PARAMS if world == 1 else RANK_PARAMS.format(rank=rank)
        save_file({n: np.ascontiguousarray(a) for n, a in layer.state_numpy(held).items()}, str(stage / file),
                  metadata={**meta, **({"layout": "global"} if world == 1 else {})})
    if optimizer_state:
        save_file(optimizer_arrays(optimizer, layer), str(stage / OPTIMIZER.format(rank=g)), metadata=meta)
    (stage / _RNG_STAGED.format(rank=g)).write_text(json.dumps(rng_state(paddle)), encoding="utf-8")


def trainer_state_base(*, steps: int, world: int, fingerprint: str, options: dict[str, Any],
                       batches: list[tuple[np.ndarray, np.ndarray]],
                       resumed_from: str | None, synthetic: bool = False) -> dict[str, Any]:
    """The part of trainer_state.json that every checkpoint of a run shares (the data-parallel
    layout from `options`: dp, sharding; `synthetic`: the run trained on the recipe's synthetic
    batch, no --data, which `data.synthetic` records)."""
    data: dict[str, Any] = {"batches": len(batches), "fingerprint": batches_fingerprint(batches)}
    if synthetic:
        data["synthetic"] = True
    return {"format": STATE_FORMAT, "version": STATE_VERSION, "steps": steps, "run_id": uuid.uuid4().hex,
            "world_size": world, "dp": int(options.get("dp", 1)), "sharding": options.get("sharding"),
            "artifact": fingerprint, "options": options, "data": data, "resumed_from": resumed_from}


def write_trainer_state(stage: Path, base: dict[str, Any], step: int, loss: float,
                        eval_loss: float | None) -> None:
    """trainer_state.json in `stage`, with every rank's staged RNG state folded in."""
    processes = int(base["world_size"]) * int(base.get("dp", 1))
    rng = {}
    for r in range(processes):
        staged = stage / _RNG_STAGED.format(rank=r)
        rng[f"rank{r}"] = json.loads(staged.read_text(encoding="utf-8"))
        staged.unlink()
    accum = int(base["options"]["grad_accum"])
    count = base["data"]["batches"]
    data = {**base["data"], "batches_taken": step * accum, "next_batch": step * accum % count}
    state = {**base, "step": step, "data": data, "loss": loss, "eval_loss": eval_loss, "rng_state": rng}
    (stage / TRAINER_STATE).write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")


@dataclass
class CheckpointRun:
    """The run number of this run's checkpoints: chosen when the first one is published."""

    number: int | None = None

    def name(self, step: int) -> str:
        return f"run-{{run:03d}}-step-{step}" if self.number is None else f"run-{self.number:03d}-step-{step}"


@dataclass(frozen=True)
class CheckpointContext:
    """What every checkpoint of a run shares: the artifact `root`, the params it saves (`names`:
    the trainable ones and the QAT state), the trainer state's common part (`base`,
    `trainer_state_base`), the run number (`run`) and what publishing checks the artifact
    against (`expected`, `checkpoint_expected`)."""

    root: Path
    names: list[str]
    base: dict[str, Any]
    run: CheckpointRun = field(default_factory=CheckpointRun)
    expected: dict[str, Any] | None = None


def publish_checkpoint(root: Path, stage: Path, step: int, run: CheckpointRun,
                       expected: dict[str, Any] | None) -> Path:
    """Move the complete folder `stage` to training/checkpoints/run-K-step-N and list its files
    in the manifest (under the artifact's lock); returns the published folder."""
    from ernie_ir.artifacts import publish_into

    out = publish_into(root, stage, root / CHECKPOINTS, run.name(step), expected)
    if run.number is None:
        run.number = (checkpoint_order(out.name) or (0, 0))[0]
    return out


def save_checkpoint(root: Path, write: Callable[[Path], None], step: int, run: CheckpointRun,
                    expected: dict[str, Any] | None, then: Callable[[Path], Any] | None = None) -> Path:
    """A checkpoint written by this process alone: `write(stage)` fills a fresh temp folder in
    training/checkpoints/, which is then published (`publish_checkpoint`) and handed to
    `then(folder)` (a LoRA run's adapter, the pruning of older ones) with SIGINT and SIGTERM held
    back (`interrupts.deferred_signals`): an interrupt while it is written removes the temp
    folder, one while it is published waits until the checkpoint is whole."""
    from ernie_ir.artifacts import temp_name
    from ernie_ir.artifacts.publish import test_pause
    from ernie_ir.training.interrupts import deferred_signals

    folder = root / CHECKPOINTS
    folder.mkdir(parents=True, exist_ok=True)
    stage = temp_name(folder, "checkpoint")
    stage.mkdir()
    try:
        write(stage)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    with deferred_signals():
        out = publish_checkpoint(root, stage, step, run, expected)
        test_pause("checkpoint")  # tests/finetune/test_train_live_output.py signals the run here
        if then is not None:
            then(out)
    return out


def drop_unlisted_checkpoints(root: Path) -> list[Path]:
    """Remove the `run-K-step-N` folders of training/checkpoints that the manifest does not list
    (a rank killed between renaming its checkpoint and listing it), under the artifact's lock so
    that no publish is half done meanwhile; returns what was removed."""
    from ernie_ir.artifacts import artifact_lock, read_manifest
    from ernie_ir.artifacts.publish import CHECKPOINT_WAIT_S

    folder = Path(root) / CHECKPOINTS
    if not folder.is_dir():
        return []
    removed = []
    with artifact_lock(Path(root), wait_s=CHECKPOINT_WAIT_S, what="artifact"):
        listed = {Path(rel).parts[2] for rel in read_manifest(Path(root)).files
                  if rel.startswith(CHECKPOINTS.as_posix() + "/") and len(Path(rel).parts) > 3}
        for path in folder.iterdir():
            if path.is_dir() and checkpoint_order(path.name) is not None and path.name not in listed:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


# -- resuming -------------------------------------------------------------------------------------


def find_checkpoint(root: Path, resume: str | Path | bool) -> Path:
    """The checkpoint folder `resume` names: True or "latest": the artifact's newest one that can
    be resumed; a folder path; or the name of a folder in the artifact's training/checkpoints."""
    root = Path(root)
    if resume is True or resume == LATEST:
        found = [p for p in list_checkpoints(root) if (p / TRAINER_STATE).is_file()]
        if not found:
            raise ErnieIRError(f"--resume: {root / CHECKPOINTS} holds no checkpoint to resume from: train "
                               "first (checkpoints are written at the end and every --save-steps)")
        return found[-1]
    path = Path(str(resume))
    if path.is_dir():
        return path
    inside = root / CHECKPOINTS / str(resume)
    if not path.is_absolute() and "/" not in str(resume) and inside.is_dir():
        return inside
    raise ErnieIRError(f"--resume-from {resume}: no such checkpoint folder: give a folder such as "
                       f"{root / CHECKPOINTS / 'run-001-step-10'} or its name")


def _option_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint checked against the run that resumes from it."""

    folder: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def name(self) -> str:
        return self.folder.name

    def params(self, rank: int, world: int) -> dict[str, np.ndarray]:
        from safetensors.numpy import load_file

        return load_file(str(self.folder / (PARAMS if world == 1 else RANK_PARAMS.format(rank=rank))))

    @property
    def layout(self) -> tuple[int, str | None]:
        """(dp, sharding) of the run that wrote it (older checkpoints: one replica)."""
        return int(self.state.get("dp", 1) or 1), self.state.get("sharding")

    def optimizer(self, rank: int) -> dict[str, np.ndarray]:
        from safetensors.numpy import load_file

        return load_file(str(self.folder / OPTIMIZER.format(rank=rank)))

    def rng(self, rank: int) -> dict[str, Any]:
        return dict(self.state["rng_state"][f"rank{rank}"])


def resume_point(root: Path, resume: str | Path | bool | None, *, world: int, fingerprint: str, steps: int,
                 options: dict[str, Any], batches: list[tuple[np.ndarray, np.ndarray]]) -> ResumePoint | None:
    """The point `resume` names (None / False: a fresh run, None returned; True: the newest
    checkpoint; a path: that one), checked by `read_resume_point`."""
    if resume is None or resume is False:
        return None
    return read_resume_point(root, find_checkpoint(root, resume), world=world, fingerprint=fingerprint,
                             steps=steps, options=options, batches=batches)


def read_resume_point(root: Path, folder: Path, *, world: int, fingerprint: str, steps: int,
                      options: dict[str, Any], batches: list[tuple[np.ndarray, np.ndarray]]) -> ResumePoint:
    """The checkpoint at `folder`, refused (ErnieIRError, one line) unless this run can continue
    it: same artifact (fingerprint) and world size, `steps` above its step, the same
    MATCHED_OPTIONS and the same batches. A checkpoint inside the artifact is checked against the
    manifest's sha256 first."""
    root = Path(root)
    where = f"--resume {folder}"
    state_file = folder / TRAINER_STATE
    if not state_file.is_file():
        raise ErnieIRError(f"{where}: not a training checkpoint folder (no {TRAINER_STATE}); an earlier "
                           "layout's run-K-step-N.safetensors cannot be resumed")
    try:
        head = json.loads(state_file.read_text(encoding="utf-8"))
        ckpt_world, ckpt_dp, ckpt_sharding = head.get("world_size"), head.get("dp", 1), head.get("sharding")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, AttributeError):
        ckpt_world, ckpt_dp, ckpt_sharding = None, 1, None
    ok_world = isinstance(ckpt_world, int) and 0 < ckpt_world <= 4096
    ranks = range(ckpt_world if ok_world else 0)
    ok_dp = isinstance(ckpt_dp, int) and ckpt_dp > 0 and ok_world and ckpt_dp * ckpt_world <= 4096
    shards = range(ckpt_dp * ckpt_world if ok_dp and ckpt_sharding else len(ranks))
    files = [TRAINER_STATE, *((PARAMS,) if ckpt_world == 1 else (RANK_PARAMS.format(rank=r) for r in ranks)),
             *(OPTIMIZER.format(rank=r) for r in shards)]
    if folder.resolve().parent == (root / CHECKPOINTS).resolve():
        from ernie_ir.artifacts import check_files, read_manifest

        check_files(root, read_manifest(root), [f"{CHECKPOINTS.as_posix()}/{folder.name}/{f}" for f in files])
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
        ok = (isinstance(state, dict) and state.get("format") == STATE_FORMAT
              and isinstance(state.get("step"), int) and isinstance(state.get("options"), dict)
              and isinstance(state.get("data"), dict) and isinstance(state.get("rng_state"), dict))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        ok = False
    if not ok:
        raise ErnieIRError(f"{where}: {TRAINER_STATE} is not an ernie-ir trainer state: the checkpoint is "
                           "corrupt")
    if state.get("version") != STATE_VERSION:
        raise ErnieIRError(f"{where}: trainer state version {state.get('version')!r}, this ernie-ir reads "
                           f"{STATE_VERSION}")
    if state.get("world_size") != world:
        raise ErnieIRError(f"{where}: the checkpoint was trained on {state.get('world_size')} rank(s), "
                           f"{root} has {world}: resume on the artifact it was trained on")
    then = (state.get("dp", 1), state.get("sharding"))
    now = (int(options.get("dp", 1)), options.get("sharding"))
    if then != now:
        from ernie_ir.ir.mapping import layout_name

        raise ErnieIRError(f"{where}: the checkpoint was trained on {layout_name(then[0], then[1], world)}, "
                           f"this run is {layout_name(now[0], now[1], world)}: its optimizer state and RNG "
                           f"streams are laid out per process; resume with --dp {then[0]} "
                           f"--sharding {then[1] or 'none'}")
    if state.get("artifact") != fingerprint:
        raise ErnieIRError(f"{where}: the checkpoint belongs to another artifact (its rank graphs and "
                           f"weights are not {root}'s): resume on the artifact it was trained on")
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise ErnieIRError(f"{where}: the checkpoint is incomplete ({missing[0]} is missing)")
    if steps <= state["step"]:
        raise ErnieIRError(f"--steps {steps} must be greater than the step {state['step']} of the "
                           f"checkpoint {folder.name} to resume from it (--steps is the run's total)")
    for key in MATCHED_OPTIONS:
        then, now = state["options"].get(key), options.get(key)
        if then != now:
            listed = ", ".join(_option_flag(k) for k in MATCHED_OPTIONS)
            raise ErnieIRError(f"{where}: {_option_flag(key)} {now!r} differs from the checkpoint's "
                               f"{then!r}; "
                               f"a resumed run keeps the schedule and the data position, so {listed} "
                               "must be the checkpoint's")
    if state["data"].get("fingerprint") != batches_fingerprint(batches):
        raise ErnieIRError(f"{where}: the training data differs from the checkpoint's run (another --data, "
                           "--pad-id, --ignore-index or synthetic --seed): resume with the same data")
    return ResumePoint(folder, state)


def restore_rank(paddle: Any, layer: Any, optimizer: Any, point: ResumePoint, names: list[str],
                 place: RankPlace) -> None:
    """Rank `place.rank`'s trained params, optimizer state and RNG state from `point`; call it
    right before the first step (nothing in between may draw random numbers). Data parallel:
    `place.process` is the global rank (its RNG stream, and with sharding its optimizer file;
    the params and an unsharded optimizer state are replica 0's, which every replica holds)."""
    rank, world, g = place.rank, place.world, place.process
    _, sharding = point.layout
    where = f"--resume {point.folder}"
    arrays = point.params(rank, world)
    for n in (n for n in names if n in layer.param_attrs):
        if n not in arrays:
            raise ErnieIRError(f"{where}: param {n} is missing from the checkpoint")
        tensor = layer.tensor(n)
        if tuple(arrays[n].shape) != tuple(tensor.shape):
            raise ErnieIRError(f"{where}: param {n} is {list(arrays[n].shape)} in the checkpoint, "
                               f"{list(tensor.shape)} in rank {rank}'s graph")
        tensor.set_value(np.ascontiguousarray(arrays[n], dtype=np.float32))
    load_optimizer_arrays(paddle, optimizer, layer, point.optimizer(g if sharding else rank), where)
    set_rng_state(paddle, point.rng(g))
