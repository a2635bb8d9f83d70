"""`train_artifact`: the training executable of a `--mode training` artifact, on this machine.

Reads `training/train.json` (written at compile time) and `rank0/` (graph + weights), builds the
Paddle Layer (ernie_ir.runtime.paddle_layer; trainable: the params the IR marks trainable, every
other param frozen), and runs a real AdamW loop (`paddle.optimizer.AdamW` over the trainable
params only, per-param learning-rate multipliers such as PACT's 1000x) on next-token
cross-entropy. QAT moving-average state is written back into its params after every step.

Options (`TrainOptions`, pydantic): batch size, gradient accumulation, clip norm, weight decay,
betas/eps, warmup + schedule (constant / linear / cosine), seed and the padding convention
(pad id, ignore index). `resolve_options(recipe, overrides)` takes the recipe's values and
replaces only the ones given (by name or by their ERNIEKit alias: `learning_rate`,
`per_device_train_batch_size`, `gradient_accumulation_steps`, `max_grad_norm`, `weight_decay`,
`adam_beta1`, `adam_beta2`, `adam_epsilon`, `warmup_steps`, `lr_scheduler_type`).

Data: a jsonl file of `{"input_ids": [...]}` lines (optionally `"labels"`, `ignore_index`
where no loss is wanted), cut into batches of `batch_size` (input ids
padded with `pad_id`, labels there `ignore_index`), taken in order and cycled; without data,
one fixed synthetic batch (seeded) is used on every step. One optimizer step takes
`gradient_accumulation_steps` consecutive batches. The loss is the mean cross-entropy over the
real target tokens of the whole step: each batch contributes its summed token losses divided
by the step's token count, so accumulating 2 batches of 2 is one batch of 4.

Progress: `on_progress(StepProgress)` after each step (step, loss, lr, tokens, elapsed); the
library never prints, the CLI draws the bar.

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

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.inputs import MAX_JSON_BYTES, read_bytes

from .paddle_layer import require_paddle

RECIPE = Path("training") / "train.json"
IGNORE = -100


Sequence = tuple[list[int], list[int]]
"""(input_ids, labels) of one line of training data."""


def _read_data(path: Path, vocab: int, max_len: int | None = None,
               ignore_index: int = IGNORE) -> list[Sequence]:
    """The lines of a jsonl file: `{"input_ids": [...]}`, optionally with `"labels"` of the same
    length (ERNIEKit's SFT convention: `ignore_index` where no loss is wanted, e.g. the prompt);
    without labels every token is a target."""
    seqs: list[Sequence] = []
    data = read_bytes(path, "training data file")  # a FIFO or device is refused, not waited on
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ErnieIRError(f"{path}: not UTF-8 text: training data is JSON lines "
                           '{"input_ids": [...]}') from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ids = row["input_ids"]
            labels = row.get("labels", ids)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ErnieIRError(f'{path}:{i}: expected a JSON object {{"input_ids": [...]}}') from None
        except RecursionError:
            raise ErnieIRError(f"{path}:{i}: the line nests JSON too deeply: expected "
                               '{"input_ids": [...]} with a flat list of token ids') from None
        except ValueError as e:  # an integer literal longer than int() converts
            raise ErnieIRError(f"{path}:{i}: {str(e).split(';')[0]}: token ids are small integers") from None
        # type(t) is int: a JSON true/false is a Python bool, an int subclass, not a token id
        if (not isinstance(ids, list) or len(ids) < 2
                or not all(type(t) is int and 0 <= t < vocab for t in ids)):
            raise ErnieIRError(f"{path}:{i}: input_ids must be a list of >= 2 token ids in [0, {vocab})")
        if (not isinstance(labels, list) or len(labels) != len(ids)
                or not all(type(t) is int and (0 <= t < vocab or t == ignore_index) for t in labels)):
            raise ErnieIRError(f"{path}:{i}: labels must be a list as long as input_ids of token ids in "
                               f"[0, {vocab}) or the ignore index {ignore_index}")
        if all(t == ignore_index for t in labels[1:]):
            raise ErnieIRError(f"{path}:{i}: every label after the first is the ignore index "
                               f"{ignore_index}: the line has nothing to learn")
        if max_len is not None and len(ids) > max_len:
            raise ErnieIRError(f"{path}:{i}: {len(ids)} tokens, but the model has {max_len} positions: "
                               "split the sequence")
        seqs.append((ids, labels))
    if not seqs:
        raise ErnieIRError(f"{path} holds no sequences")
    return seqs


def _batches(seqs: list[Sequence], size: int, pad_id: int = 0,
             ignore_index: int = IGNORE) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for i in range(0, len(seqs), size):
        chunk = seqs[i:i + size]
        width = max(len(s) for s, _ in chunk)
        ids = np.full((len(chunk), width), pad_id, np.int64)
        labels = np.full((len(chunk), width), ignore_index, np.int64)
        for r, (s, lab) in enumerate(chunk):
            ids[r, :len(s)] = s
            labels[r, :len(s)] = lab
        out.append((ids, labels))
    return out


# -- options ---------------------------------------------------------------------------------


Schedule = Literal["constant", "linear", "cosine"]
MAX_LR = 10.0
MAX_CLIP_NORM = 1e6
"""A larger global-norm clip never clips: write 0 for no clipping."""
MAX_STEPS = 100_000_000


def _alias(*names: str) -> AliasChoices:
    return AliasChoices(*names)


class TrainOptions(BaseModel):
    """Every setting of a training run. Built by `resolve_options` from the recipe's values and
    the ones a user gave; field names are the CLI's, aliases ERNIEKit's config names."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    lr: float = Field(1e-3, gt=0, le=MAX_LR, allow_inf_nan=False,
                      validation_alias=_alias("lr", "learning_rate"))
    batch_size: int = Field(4, ge=1, le=65536,
                            validation_alias=_alias("batch_size", "per_device_train_batch_size"))
    grad_accum: int = Field(1, ge=1, le=65536,
                            validation_alias=_alias("grad_accum", "gradient_accumulation_steps"))
    clip_norm: float = Field(1.0, ge=0, le=MAX_CLIP_NORM, allow_inf_nan=False,
                                    validation_alias=_alias("clip_norm", "max_grad_norm", "grad_clip_norm"))
    weight_decay: float = Field(0.0, ge=0, le=1.0, allow_inf_nan=False,
                                validation_alias=_alias("weight_decay"))
    beta1: float = Field(0.9, ge=0, lt=1, allow_inf_nan=False, validation_alias=_alias("beta1", "adam_beta1"))
    beta2: float = Field(0.999, ge=0, lt=1, allow_inf_nan=False,
                         validation_alias=_alias("beta2", "adam_beta2"))
    eps: float = Field(1e-8, gt=0, le=1.0, allow_inf_nan=False,
                       validation_alias=_alias("eps", "epsilon", "adam_epsilon"))
    warmup_steps: int = Field(0, ge=0, le=10_000_000, validation_alias=_alias("warmup_steps"))
    schedule: Schedule = Field("constant", validation_alias=_alias("schedule", "lr_scheduler_type"))
    seed: int = Field(0, ge=0, lt=2**32, validation_alias=_alias("seed"))
    pad_id: int = Field(0, ge=0, lt=2**31, validation_alias=_alias("pad_id", "pad_token_id"))
    ignore_index: int = Field(IGNORE, ge=-(2**31), lt=2**31, validation_alias=_alias("ignore_index"))

    @model_validator(mode="after")
    def _no_collision(self) -> TrainOptions:
        if self.ignore_index == self.pad_id:
            raise ValueError(f"ignore_index {self.ignore_index} equals pad_id: the ignored label must not "
                             "be a token id")
        return self

    def lr_at(self, step: int, steps: int) -> float:
        """The learning rate of optimizer step `step` (0-based) of `steps`: linear warmup from 0
        over `warmup_steps`, then constant, linear decay to 0 or cosine decay to 0 at `steps`
        (the formulas of PaddleNLP / ERNIEKit `get_*_schedule_with_warmup`)."""
        if step < self.warmup_steps:
            return self.lr * step / max(1, self.warmup_steps)
        if self.schedule == "constant":
            return self.lr
        progress = (step - self.warmup_steps) / max(1, steps - self.warmup_steps)
        if self.schedule == "linear":
            return self.lr * max(0.0, 1.0 - progress)
        return self.lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    def clip(self) -> float | None:
        """The global-norm clip; None (no clipping) for 0, as ERNIEKit's max_grad_norm."""
        return self.clip_norm if self.clip_norm else None


OPTION_ALIASES: dict[str, str] = {a: name for name, f in TrainOptions.model_fields.items()
                                  for a in (f.validation_alias.choices  # type: ignore[union-attr]
                                            if f.validation_alias is not None else ())}
"""Every accepted key (field names and aliases) -> the field it sets."""


def _recipe_values(recipe: dict[str, Any]) -> dict[str, Any]:
    opt = recipe.get("optimizer", {})
    batch = recipe.get("batch", {})
    sched = recipe.get("schedule", {})
    pad = recipe.get("padding", {})
    pairs = {"lr": opt.get("learning_rate"), "beta1": opt.get("beta1"), "beta2": opt.get("beta2"),
             "eps": opt.get("epsilon"), "weight_decay": opt.get("weight_decay"),
             "clip_norm": opt.get("grad_clip_norm"), "batch_size": batch.get("batch_size"),
             "grad_accum": batch.get("gradient_accumulation_steps"), "seed": batch.get("synthetic_seed"),
             "warmup_steps": sched.get("warmup_steps"), "schedule": sched.get("name"),
             "pad_id": pad.get("pad_id"), "ignore_index": pad.get("ignore_index")}
    return {k: v for k, v in pairs.items() if v is not None}


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def resolve_options(recipe: dict[str, Any], overrides: dict[str, Any] | None = None) -> TrainOptions:
    """The recipe's options with `overrides` applied: a key whose value is None is absent (the
    recipe's value stays). Keys: TrainOptions field names or their aliases. ErnieIRError, one
    line, for an unknown key or a bad value."""
    given: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        field = OPTION_ALIASES.get(key)
        if field is None:
            known = ", ".join(sorted(OPTION_ALIASES))
            raise ErnieIRError(f"unknown training option {key!r}; known: {known}")
        given[field] = value
    values = {**_recipe_values(recipe), **given}
    try:
        return TrainOptions.model_validate(values)
    except ValidationError as e:
        first = e.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        shown = values.get(field, first.get("input")) if field else None
        kit = [a for a in OPTION_ALIASES if OPTION_ALIASES[a] == field and a != field][:1]
        where = f"{_flag(field)}{f' ({kit[0]})' if kit else ''}" if field else "training options"
        msg = str(first["msg"]).removeprefix("Value error, ")
        raise ErnieIRError(f"{where}: {msg}, got {shown!r}" if field else f"{where}: {msg}") from None


def read_config(path: Path) -> dict[str, Any]:
    """A training config file (.yaml/.yml or .json): a mapping of option names or ERNIEKit names
    to values (keys ERNIEKit has that ernie-ir does not use, such as output_dir, are refused)."""
    try:
        text = read_bytes(path, "training config", limit=MAX_JSON_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        raise ErnieIRError(f"{path}: not UTF-8 text: a training config is YAML or JSON") from None
    try:
        if Path(path).suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # json and yaml raise different errors: one line each
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ErnieIRError(f"{path}: not valid {'JSON' if Path(path).suffix == '.json' else 'YAML'}: "
                           f"{first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ErnieIRError(f"{path}: a training config is a mapping of option names to values")
    return {str(k): v for k, v in data.items()}


@dataclass(frozen=True)
class StepProgress:
    """What `train_artifact` reports after each optimizer step (the CLI draws it)."""

    step: int
    steps: int
    loss: float
    lr: float
    tokens: int
    """Real target tokens of this step (every accumulated batch)."""
    elapsed_s: float
    """Seconds since the first step began."""

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    total_tokens: int = 0
    """Real target tokens of steps 1 .. step."""

    @property
    def eta_s(self) -> float:
        return self.elapsed_s / self.step * (self.steps - self.step)


def step_batches(batches: list[tuple[np.ndarray, np.ndarray]], step: int,
                 grad_accum: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The batches optimizer step `step` (0-based) takes: the next `grad_accum`, cycled."""
    return [batches[(step * grad_accum + j) % len(batches)] for j in range(grad_accum)]


def target_tokens(labels: np.ndarray, ignore_index: int = IGNORE) -> int:
    """Real target tokens of a batch: labels[:, 1:] that are not `ignore_index`."""
    return int(np.count_nonzero(labels[:, 1:] != ignore_index))


def read_training_artifact(root: Path) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(manifest, recipe, world size) of a training artifact, every rank's files and the recipe
    checked against the manifest's sha256 (ErnieIRError naming the first problem)."""
    from ernie_ir.artifacts import artifact_mapping, check_files, read_manifest

    manifest = read_manifest(root)
    if manifest.get("mode") != "training" or not (root / RECIPE).is_file():
        raise ErnieIRError(f"{root} is not a training artifact: compile it with --mode training "
                           "(and --lora-rank R or --quant qat-int8)")
    world = artifact_mapping(manifest).world_size
    names = [f"rank{r}/{f}" for r in range(world) for f in ("graph.ir", "weights.safetensors")]
    check_files(root, manifest, [*names, RECIPE.as_posix()])
    try:
        recipe = json.loads((root / RECIPE).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ErnieIRError(f"{root / RECIPE} is not valid JSON: the artifact is corrupt") from None
    if not isinstance(recipe, dict):
        raise ErnieIRError(f"{root / RECIPE} is not a training recipe (a JSON object): the artifact is "
                           "corrupt")
    return manifest, recipe, world


def training_batches(recipe: dict[str, Any], graph: Any, data: Path | None, seed: int | None = None, *,
                     options: TrainOptions | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (input_ids, labels) batches of a run: `data` cut by the options' batch size (padded
    with pad_id, labels ignore_index there), or one seeded synthetic batch. Every rank of a
    parallel run takes these same batches. `options` None: the recipe's."""
    opts = options if options is not None else resolve_options(recipe, {"seed": seed})
    vocab = int(graph.outputs[0].type.shape[-1])
    if opts.pad_id >= vocab:
        raise ErnieIRError(f"--pad-id must be a token id in [0, {vocab}), got {opts.pad_id}")
    if 0 <= opts.ignore_index < vocab:
        raise ErnieIRError(f"--ignore-index must not be a token id in [0, {vocab}) (use a negative value "
                           f"such as -100), got {opts.ignore_index}")
    if data is not None:
        limits = [n.attrs.limit for n in graph.nodes
                  if n.op == "position_ids" and getattr(n.attrs, "limit", None) is not None]
        max_len = min(limits) if limits else None
        return _batches(_read_data(Path(data), vocab, max_len, opts.ignore_index), opts.batch_size,
                        opts.pad_id, opts.ignore_index)
    rng = np.random.default_rng(opts.seed)
    seq_len = int(recipe.get("batch", {}).get("seq_len", 16))
    ids = rng.integers(0, vocab, size=(opts.batch_size, seq_len))
    return [(ids.astype(np.int64), ids.astype(np.int64))]


def make_optimizer(paddle: Any, params: list[Any], options: TrainOptions, grad_clip: Any) -> Any:
    """AdamW over `params` with the run's settings (the learning rate is set per step)."""
    return paddle.optimizer.AdamW(
        learning_rate=float(options.lr), parameters=params, beta1=options.beta1, beta2=options.beta2,
        epsilon=options.eps, weight_decay=options.weight_decay, grad_clip=grad_clip)


def run_steps(paddle: Any, layer: Any, optimizer: Any, batches: list[tuple[np.ndarray, np.ndarray]],
              steps: int, on_step: Callable[[int, float], Any] | None = None, *,
              options: TrainOptions | None = None) -> list[float]:
    """`steps` optimizer steps over `batches` (cycled, `grad_accum` batches a step, learning
    rate by the schedule); the loss of each step, the mean over the step's real target tokens.
    The one training loop of every rank count: one process here, or each paddle.distributed rank."""
    opts = options if options is not None else TrainOptions()
    losses: list[float] = []
    for step in range(steps):
        micro = step_batches(batches, step, opts.grad_accum)
        count = sum(target_tokens(labels, opts.ignore_index) for _, labels in micro)
        optimizer.set_lr(opts.lr_at(step, steps))
        total = 0.0
        for ids, labels in micro:
            loss_sum, _ = token_loss_sum(paddle, layer, ids, labels, opts.ignore_index)
            (loss_sum / max(count, 1)).backward()
            total += float(loss_sum.numpy())
        if not math.isfinite(total):
            raise ErnieIRError(f"training step {step + 1}: the loss is {total} (NaN or Inf): stopped, "
                               "no checkpoint written; lower --lr, set --clip-norm or check the weights "
                               "and data")
        optimizer.step()
        optimizer.clear_grad()
        _require_finite_params(layer, step + 1)
        layer.commit_state()
        losses.append(total / max(count, 1))
        if on_step is not None:
            on_step(step + 1, losses[-1])
    return losses


def _require_finite_params(layer: Any, step: int) -> None:
    """A step that made a trainable param NaN or Inf stops the run (the params are LoRA
    adapters or QAT scales: small, so this check costs little next to the step)."""
    for name in getattr(layer, "trainable_names", ()):
        if not np.isfinite(layer.tensor(name).numpy()).all():
            raise ErnieIRError(f"training step {step}: param {name} became NaN or Inf: stopped, no "
                               "checkpoint written; lower --lr or set --clip-norm")


def token_loss_sum(paddle: Any, layer: Any, ids: np.ndarray, labels: np.ndarray,
                   ignore_index: int = IGNORE) -> tuple[Any, int]:
    """(summed cross-entropy of logits[:, :-1] against labels[:, 1:] over the positions whose
    label is not `ignore_index`, their count)."""
    logits = layer(paddle.to_tensor(ids))
    v = logits.shape[-1]
    target = labels[:, 1:].reshape(-1)
    keep = target != ignore_index
    per_token = paddle.nn.functional.cross_entropy(
        logits[:, :-1].reshape([-1, v]), paddle.to_tensor(np.where(keep, target, 0)), reduction="none")
    mask = paddle.to_tensor(keep.astype(np.float32))
    return paddle.sum(per_token.reshape([-1]) * mask), int(keep.sum())


def next_token_loss(paddle: Any, layer: Any, ids: np.ndarray, labels: np.ndarray,
                    ignore_index: int = IGNORE) -> Any:
    """Mean cross-entropy over the real target tokens: logits[:, :-1] against labels[:, 1:],
    `ignore_index` positions neither counted nor averaged over."""
    loss_sum, count = token_loss_sum(paddle, layer, ids, labels, ignore_index)
    return loss_sum / max(count, 1)


def _progress_reporter(batches: list[tuple[np.ndarray, np.ndarray]], steps: int, options: TrainOptions,
                       on_step: Callable[[int, float], Any] | None,
                       on_progress: Callable[[StepProgress], Any] | None) -> Callable[[int, float], None]:
    start = time.monotonic()
    seen = [0]

    def report(step: int, loss: float) -> None:
        if on_step is not None:
            on_step(step, loss)
        if on_progress is None:
            return
        tokens = sum(target_tokens(lab, options.ignore_index)
                     for _, lab in step_batches(batches, step - 1, options.grad_accum))
        seen[0] += tokens
        on_progress(StepProgress(step=step, steps=steps, loss=loss, lr=options.lr_at(step - 1, steps),
                                 tokens=tokens, elapsed_s=time.monotonic() - start, total_tokens=seen[0]))

    return report


def train_artifact(path: Path, steps: int, data: Path | None = None, lr: float | None = None,
                   seed: int | None = None, *, save: bool = True,
                   options: dict[str, Any] | TrainOptions | None = None,
                   on_step: Callable[[int, float], Any] | None = None,
                   on_progress: Callable[[StepProgress], Any] | None = None,
                   timeout_s: float | None = None) -> list[float]:
    """Train the artifact's trainable params for `steps` AdamW steps; returns the loss of each step.

    Settings: the recipe's, replaced by the keys of `options` given (a dict of TrainOptions
    names or ERNIEKit aliases; None values are absent), then by `lr` and `seed` when not None.
    `on_step(step, loss)` and `on_progress(StepProgress)` are called after each step.
    A multi-rank artifact runs on one paddle.distributed process per rank (gloo on this CPU,
    ernie_ir.runtime.launcher), bounded by `timeout_s` (default 3600 s).
    """
    paddle = require_paddle()
    root = Path(path)
    if not 1 <= steps <= MAX_STEPS:
        raise ErnieIRError(f"--steps must be in [1, {MAX_STEPS}], got {steps}")
    manifest, recipe, world = read_training_artifact(root)
    given = options.model_dump() if isinstance(options, TrainOptions) else dict(options or {})
    opts = resolve_options(recipe, {**given, **({"lr": lr} if lr is not None else {}),
                                    **({"seed": seed} if seed is not None else {})})

    from ernie_ir.ir.storage import load_graph

    from .paddle_layer import build_layer

    graph = load_graph(root / "rank0")
    batches = training_batches(recipe, graph, data, options=opts)  # bad data fails before any process
    report = _progress_reporter(batches, steps, opts, on_step, on_progress)
    if world > 1:
        from .launcher import TRAIN_TIMEOUT_S, train_distributed

        return train_distributed(root, world, steps, batches, options=opts, save=save, on_step=report,
                                 timeout_s=TRAIN_TIMEOUT_S if timeout_s is None else timeout_s)
    paddle.seed(opts.seed)
    layer = build_layer(graph, device="cpu")
    layer.train()
    layer.track_state = True
    params = layer.trainable_parameters()
    if not params:
        raise ErnieIRError(f"{root}: the graph has no trainable params")
    clip = opts.clip()
    optimizer = make_optimizer(paddle, params, opts,
                               paddle.nn.ClipGradByGlobalNorm(clip) if clip else None)
    losses = run_steps(paddle, layer, optimizer, batches, steps, report, options=opts)
    if save:
        _save_checkpoint(root, manifest, layer, recipe, steps)
    return losses


def _save_checkpoint(root: Path, manifest: dict[str, Any], layer: Any, recipe: dict[str, Any],
                     steps: int) -> Path:
    from safetensors.numpy import save_file

    from ernie_ir.artifacts import publish_into, temp_name

    names = list(recipe.get("trainable", [])) + list(recipe.get("qat_state", []))
    folder = root / "training" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    # One file per run (run-001-step-30, run-002-step-30, ...): a later run never overwrites
    # an earlier one, and the file appears only once it is complete (written under a temp
    # name, renamed and listed under the artifact's lock).
    partial = temp_name(folder, "checkpoint")
    try:
        save_file({n: np.ascontiguousarray(a) for n, a in layer.state_numpy(names).items()}, str(partial),
                  metadata={"format": "ernie-ir-training-checkpoint", "steps": str(steps)})
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return publish_into(root, partial, folder, f"run-{{run:03d}}-step-{steps}.safetensors", manifest)


def record_files(root: Path, manifest: dict[str, Any], files: list[Path]) -> None:
    """List `files` (inside `root`) with their sha256 in the manifest, rewritten atomically under
    the artifact's lock (`manifest`: the one the caller read; the artifact must not have changed)."""
    from ernie_ir.artifacts import artifact_lock
    from ernie_ir.artifacts import record_files as record
    from ernie_ir.artifacts.publish import CHECKPOINT_WAIT_S

    with artifact_lock(root, wait_s=CHECKPOINT_WAIT_S, what="artifact"):
        fresh = record(root, files, manifest)
    manifest.clear()
    manifest.update(fresh)
