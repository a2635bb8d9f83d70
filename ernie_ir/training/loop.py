"""`train_artifact`: the training executable of a `--mode training` artifact, on this machine.

Reads `training/train.json` (written at compile time) and `rank0/` (graph + weights), builds the
Paddle Layer (ernie_ir.backends.paddle.layer; trainable: the params the IR marks trainable, every
other param frozen), and runs a real AdamW loop (`paddle.optimizer.AdamW` over the trainable
params only, per-param learning-rate multipliers such as PACT's 1000x) on next-token
cross-entropy. QAT moving-average state is written back into its params after every step.

Options (`TrainOptions`, pydantic): batch size, gradient accumulation, clip norm, weight decay,
betas/eps, warmup + schedule (constant / linear / cosine), seed and the padding convention
(pad id, ignore index). `resolve_options(recipe, overrides)` takes the recipe's values and
replaces only the ones given (by name or by their ERNIEKit alias: `learning_rate`,
`per_device_train_batch_size`, `gradient_accumulation_steps`, `max_grad_norm`, `weight_decay`,
`adam_beta1`, `adam_beta2`, `adam_epsilon`, `warmup_steps`, `lr_scheduler_type`), and when to
save and evaluate (`save_steps`, `save_total_limit`, `eval_steps`: ERNIEKit's names too).

Data: a jsonl file of `{"input_ids": [...]}` lines (optionally `"labels"`, `ignore_index`
where no loss is wanted), or the same as a list of (input_ids, labels) pairs already tokenized
(validated alike: `validate_sequences`, errors naming `FILE:LINE` or `data[i]`), cut into
batches of `batch_size` (input ids padded with `pad_id`, labels there `ignore_index`), taken
in order and cycled; without data, one fixed synthetic batch (seeded) is used on every step.
One optimizer step takes `gradient_accumulation_steps` consecutive batches: step k (0-based)
takes batches k x grad_accum ..., so the data position is a function of the step. The loss is
the mean cross-entropy over the real target tokens of the whole step: each batch contributes
its summed token losses divided by the step's token count, so accumulating 2 batches of 2 is
one batch of 4.

Evaluation: with evaluation data (`eval_data` / `eval_sequences`), the mean next-token loss
over all of it (no gradients, eval mode: dropout off) every `eval_steps` steps and at the end.

Progress: the hooks (`TrainHooks`): `on_progress(StepProgress)` after each step (step, loss, lr,
tokens, elapsed), `on_eval` after each evaluation, `on_checkpoint` after each checkpoint, as they
happen (a multi-rank run: as rank 0 reports them); the library never prints, the CLI prints a
line per step. A checkpoint is published with SIGINT and SIGTERM held back
(ernie_ir.training.interrupts), so an interrupted run leaves whole checkpoints only; a run
without data records `"synthetic": true` in its checkpoints' trainer_state.json `data`.

Results (`TrainResult`: losses, eval losses, checkpoints): `rank0/` is never modified. With
`save=True` each checkpoint is a folder `training/checkpoints/run-K-step-N/` (the trained
params and QAT state at global names and shapes, each rank's optimizer state, the trainer
state: ernie_ir.training.checkpoints has the layout), written at the end and every
`save_steps` steps, listed in the manifest with its sha256 (rewritten atomically, under the
artifact's lock), so `verify` keeps passing; `save_total_limit` keeps the newest. `resume`
continues a checkpoint's run bit for bit (optimizer, RNG, data position and schedule).

A multi-rank artifact (`--tp`/`--ep`) trains on one paddle.distributed gloo process per rank
(ernie_ir.backends.paddle.launch, ernie_ir.backends.paddle.rank_worker) with the same batches, optimizer and
loss as here, and exact tensor-parallel gradients, so its losses are the one-rank losses; its
checkpoints hold each rank's params (`rank{r}.safetensors`) beside their merge. Data
parallelism (`dp`, `sharding`: TrainOptions, the artifact's layout by default) runs dp x ranks
processes, each replica on its rows of every batch (ernie_ir.training.data_parallel).
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
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ernie_ir.artifacts.manifest import Manifest
from ernie_ir.backends.paddle.layer import require_paddle
from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.inputs import MAX_JSON_BYTES, read_bytes
from ernie_ir.ir.mapping import MAX_PROCESSES, Sharding, check_data_parallel
from ernie_ir.training.checkpoints import ResumePoint
from ernie_ir.training.checkpoints import (
    TrainResult as TrainResult,  # re-exported: what train_artifact returns
)
from ernie_ir.training.hooks import StepProgress, TrainHooks  # used and re-exported: the run's hooks

RECIPE = Path("training") / "train.json"
IGNORE = -100


Sequence = tuple[list[int], list[int]]
"""(input_ids, labels) of one line of training data."""


Row = tuple[str, Any, Any]
"""(where, input_ids, labels) of one sequence before validation: `where` names it in errors
(`FILE:LINE` or `data[i]`)."""


def _parse_data(path: Path) -> list[Row]:
    """The rows of a jsonl file: `{"input_ids": [...]}` lines, optionally with `"labels"` (blank
    lines skipped; a line that is not such an object is refused, naming FILE:LINE)."""
    rows: list[Row] = []
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
        rows.append((f"{path}:{i}", ids, labels))
    return rows


def _given_rows(seqs: Any, what: str) -> list[Row]:
    """The rows of sequences given as a list of (input_ids, labels) pairs (labels None: every
    token is a target); numpy arrays and integers are taken as lists of ints."""
    if not isinstance(seqs, (list, tuple)):
        raise ErnieIRError(f"{what}: expected a list of (input_ids, labels) pairs, got {type(seqs).__name__}")

    def plain(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            x = x.tolist()
        if isinstance(x, (list, tuple)):
            return [int(t) if isinstance(t, np.integer) else t for t in x]
        return x

    rows: list[Row] = []
    for i, pair in enumerate(seqs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ErnieIRError(f"{what}[{i}]: expected an (input_ids, labels) pair")
        ids, labels = plain(pair[0]), plain(pair[1])
        rows.append((f"{what}[{i}]", ids, ids if labels is None else labels))
    return rows


def validate_sequences(rows: list[Row], vocab: int, max_len: int | None = None,
                       ignore_index: int = IGNORE) -> list[Sequence]:
    """The rows as (input_ids, labels), each checked as the loss needs it (ERNIEKit's SFT
    convention: labels `ignore_index` where no loss is wanted, e.g. the prompt): >= 2 token ids in
    [0, vocab), labels as long, each a token id or the ignore index, something to learn after the
    first position, and no longer than the model's positions. ErnieIRError names the row."""
    seqs: list[Sequence] = []
    for where, ids, labels in rows:
        # type(t) is int: a JSON true/false is a Python bool, an int subclass, not a token id
        if (not isinstance(ids, list) or len(ids) < 2
                or not all(type(t) is int and 0 <= t < vocab for t in ids)):
            raise ErnieIRError(f"{where}: input_ids must be a list of >= 2 token ids in [0, {vocab})")
        if (not isinstance(labels, list) or len(labels) != len(ids)
                or not all(type(t) is int and (0 <= t < vocab or t == ignore_index) for t in labels)):
            raise ErnieIRError(f"{where}: labels must be a list as long as input_ids of token ids in "
                               f"[0, {vocab}) or the ignore index {ignore_index}")
        if all(t == ignore_index for t in labels[1:]):
            raise ErnieIRError(f"{where}: every label after the first is the ignore index "
                               f"{ignore_index}: the line has nothing to learn")
        if max_len is not None and len(ids) > max_len:
            raise ErnieIRError(f"{where}: {len(ids)} tokens, but the model has {max_len} positions: "
                               "split the sequence")
        seqs.append((ids, labels))
    return seqs


def _read_data(path: Path, vocab: int, max_len: int | None = None,
               ignore_index: int = IGNORE) -> list[Sequence]:
    """The lines of a jsonl file (`_parse_data`), validated (`validate_sequences`)."""
    seqs = validate_sequences(_parse_data(path), vocab, max_len, ignore_index)
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
RUN_KEYS = ("resume_from_checkpoint",)
"""Config keys that are not TrainOptions but choose how the run starts (ERNIEKit's names)."""


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
    min_lr: float = Field(0.0, ge=0, le=MAX_LR, allow_inf_nan=False, validation_alias=_alias("min_lr"))
    """The cosine schedule's floor (ERNIEKit's min_lr): it decays to min_lr, not 0; the other
    schedules ignore it, as PaddleFormers' do."""
    schedule: Schedule = Field("constant", validation_alias=_alias("schedule", "lr_scheduler_type"))
    seed: int = Field(0, ge=0, lt=2**32, validation_alias=_alias("seed"))
    pad_id: int = Field(0, ge=0, lt=2**31, validation_alias=_alias("pad_id", "pad_token_id"))
    ignore_index: int = Field(IGNORE, ge=-(2**31), lt=2**31, validation_alias=_alias("ignore_index"))
    save_steps: int | None = Field(None, ge=1, le=MAX_STEPS, validation_alias=_alias("save_steps"))
    """A checkpoint every N steps (and at the end); None: at the end only."""
    save_total_limit: int | None = Field(None, ge=1, le=1_000_000,
                                         validation_alias=_alias("save_total_limit"))
    """Keep the artifact's newest N checkpoints, deleting older ones; None: keep all."""
    eval_steps: int | None = Field(None, ge=1, le=MAX_STEPS, validation_alias=_alias("eval_steps"))
    """The evaluation loss every N steps (and at the end); None: at the end only."""
    dp: int = Field(1, ge=1, le=MAX_PROCESSES, validation_alias=_alias("dp"))
    """Data-parallel replicas (the artifact's layout unless given): each takes batch_size / dp rows
    of every batch; dp x the artifact's ranks processes."""
    sharding: Sharding | None = Field(None, validation_alias=_alias("sharding"))
    """ZeRO over the dp group: stage1 (optimizer states), stage2 (also gradients); None: none."""
    vocab_parallel_loss: bool = Field(True, validation_alias=_alias("vocab_parallel_loss",
                                                                    "use_sparse_head_and_loss_fn"))
    """Tensor parallel: the cross-entropy on each rank's vocabulary shard of the logits, never
    gathered (training/vocab_parallel.py); False: the logits all-gathered, the loss on them whole."""
    micro_batches: int | None = Field(None, ge=1, le=65536,
                                      validation_alias=_alias("micro_batches", "accumulate_steps"))
    """Pipeline parallel: micro-batches each batch is cut into (None: the artifact's, from
    compile --micro-batches); it must divide batch_size."""
    pipeline_schedule: Literal["1f1b", "gpipe"] = Field(
        "1f1b", validation_alias=_alias("pipeline_schedule", "schedule_mode"))
    """Pipeline parallel: 1f1b (fleet's 1F1B) or gpipe (fleet's FThenB: every forward, then
    every backward)."""

    @field_validator("pipeline_schedule", mode="before")
    @classmethod
    def _schedule_name(cls, value: Any) -> Any:
        if isinstance(value, str):
            name = value.strip().lower()
            return "gpipe" if name == "fthenb" else name
        return value

    @field_validator("sharding", mode="before")
    @classmethod
    def _no_sharding(cls, value: Any) -> Any:
        return None if isinstance(value, str) and value.strip().lower() in ("none", "") else value

    @model_validator(mode="after")
    def _no_collision(self) -> TrainOptions:
        if self.ignore_index == self.pad_id:
            raise ValueError(f"ignore_index {self.ignore_index} equals pad_id: the ignored label must not "
                             "be a token id")
        return self

    def lr_at(self, step: int, steps: int) -> float:
        """The learning rate of optimizer step `step` (0-based) of `steps`: linear warmup from 0
        over `warmup_steps`, then constant, linear decay to 0 or cosine decay to `min_lr` at
        `steps` (the formulas of PaddleNLP / ERNIEKit `get_*_schedule_with_warmup`)."""
        if step < self.warmup_steps:
            return self.lr * step / max(1, self.warmup_steps)
        if self.schedule == "constant":
            return self.lr
        progress = (step - self.warmup_steps) / max(1, steps - self.warmup_steps)
        if self.schedule == "linear":
            return self.lr * max(0.0, 1.0 - progress)
        ratio = max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        return self.min_lr + (self.lr - self.min_lr) * ratio

    def clip(self) -> float | None:
        """The global-norm clip; None (no clipping) for 0, as ERNIEKit's max_grad_norm."""
        return self.clip_norm if self.clip_norm else None


OPTION_ALIASES: dict[str, str] = {a: name for name, f in TrainOptions.model_fields.items()
                                  for a in (f.validation_alias.choices  # type: ignore[union-attr]
                                            if f.validation_alias is not None else ())}
"""Every accepted key (field names and aliases) -> the field it sets."""


SYNTHETIC_SEQ_LEN = 16
"""Positions of the synthetic batch (a run without data), unless the recipe's batch.seq_len says."""

RECIPE_KEYS: dict[str, tuple[str, str]] = {
    "lr": ("optimizer", "learning_rate"), "beta1": ("optimizer", "beta1"), "beta2": ("optimizer", "beta2"),
    "eps": ("optimizer", "epsilon"), "weight_decay": ("optimizer", "weight_decay"),
    "clip_norm": ("optimizer", "grad_clip_norm"), "schedule": ("schedule", "name"),
    "warmup_steps": ("schedule", "warmup_steps"), "batch_size": ("batch", "batch_size"),
    "grad_accum": ("batch", "gradient_accumulation_steps"), "seed": ("batch", "synthetic_seed"),
    "pad_id": ("padding", "pad_id"), "ignore_index": ("padding", "ignore_index"),
    "dp": ("data_parallel", "dp"), "sharding": ("data_parallel", "sharding"),
}
"""TrainOptions field -> (section, key) of the recipe (training/train.json) that holds the
artifact's value: read back as the run's defaults (`resolve_options`), written by compile
(`recipe_sections`)."""


def recipe_sections() -> dict[str, dict[str, Any]]:
    """The run's defaults as compile writes them into train.json: TrainOptions' defaults (their one
    home) under their RECIPE_KEYS, with the optimizer's name and the synthetic batch's length
    (`data_parallel` is the layout's, written with dp > 1 only)."""
    defaults = TrainOptions().model_dump()
    sections: dict[str, dict[str, Any]] = {"optimizer": {"name": "AdamW"}, "schedule": {}, "batch": {},
                                           "padding": {}}
    for field, (section, key) in RECIPE_KEYS.items():
        if section in sections:
            sections[section][key] = defaults[field]
    sections["batch"]["seq_len"] = SYNTHETIC_SEQ_LEN
    return sections


def _recipe_values(recipe: dict[str, Any]) -> dict[str, Any]:
    """The TrainOptions values the recipe holds (RECIPE_KEYS), by field."""
    values = {field: recipe.get(section, {}).get(key) for field, (section, key) in RECIPE_KEYS.items()}
    return {k: v for k, v in values.items() if v is not None}


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
            known = ", ".join(sorted([*OPTION_ALIASES, *RUN_KEYS]))  # every key a --config may hold
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


def check_layout(options: TrainOptions, world: int, pp: int = 1, micro_batches: int = 1) -> int:
    """The processes a run of `options` on an artifact of `world` rank graphs (`pp` pipeline
    stages of world / pp model-parallel ranks; `micro_batches`: the artifact's default) starts
    (dp x world); ErnieIRError, one line, for sharding without dp > 1, a batch size dp does not
    divide, more processes than a launch starts, and micro-batches without a pipeline, with
    dp, or not dividing the batch."""
    if pp == 1 and options.micro_batches not in (None, 1):
        raise ErnieIRError(f"--micro-batches {options.micro_batches} cuts batches for a pipeline, and this "
                           "artifact has none: compile it with --pp N (or drop --micro-batches)")
    if pp > 1:
        if options.dp > 1:
            raise ErnieIRError(f"--dp {options.dp} with {pp} pipeline stages: data parallelism of a "
                               "pipelined artifact is not built; use --dp 1, or compile without --pp for "
                               "--dp")
        from ernie_ir.backends.paddle.pipeline_schedule import check_micro_batches

        check_micro_batches(options.batch_size, options.micro_batches or micro_batches)
    check_data_parallel(options.dp, options.sharding, world)
    if options.batch_size % options.dp:
        raise ErnieIRError(f"--batch-size {options.batch_size} does not split into --dp {options.dp} "
                           f"replicas: use a multiple of {options.dp} (each replica takes batch_size / dp "
                           "rows of every batch)")
    return options.dp * world


def split_run_keys(values: dict[str, Any]) -> tuple[dict[str, Any], str | bool | None]:
    """(the options, the checkpoint to resume from) of a config mapping: ERNIEKit's
    `resume_from_checkpoint` (a folder, a checkpoint's name, true or "latest" for the newest;
    false or null: start afresh) is taken out, the rest are TrainOptions keys."""
    rest = dict(values)
    resume = rest.pop("resume_from_checkpoint", None)
    if resume is False:
        resume = None
    if resume is not None and not (resume is True or (isinstance(resume, str) and resume.strip())):
        raise ErnieIRError(f"resume_from_checkpoint: a checkpoint folder, true or \"latest\", got {resume!r}")
    return rest, resume


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


def step_batches(batches: list[tuple[np.ndarray, np.ndarray]], step: int,
                 grad_accum: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The batches optimizer step `step` (0-based) takes: the next `grad_accum`, cycled."""
    return [batches[(step * grad_accum + j) % len(batches)] for j in range(grad_accum)]


def target_tokens(labels: np.ndarray, ignore_index: int = IGNORE) -> int:
    """Real target tokens of a batch: labels[:, 1:] that are not `ignore_index`."""
    return int(np.count_nonzero(labels[:, 1:] != ignore_index))


def read_training_artifact(root: Path) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(manifest, recipe, rank graphs: pp x world size) of a training artifact, every rank's
    files and the recipe checked against the manifest's sha256 (ErnieIRError naming the first
    problem)."""
    from ernie_ir.artifacts import artifact_mapping, check_files, read_manifest

    manifest = read_manifest(root)
    if manifest.mode != "training" or not (root / RECIPE).is_file():
        raise ErnieIRError(f"{root} is not a training artifact: compile it with --mode training "
                           "(every float param trains, or with --lora-rank R or --quant qat-int8)")
    world = artifact_mapping(manifest).rank_graphs  # pp x the model-parallel ranks
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


def whole_graph(root: Path) -> Any:
    """The artifact's unsplit graph (graph.ir, no weights read): what a pipelined artifact's
    batches are checked against (vocabulary, positions), its stages holding parts of it."""
    from ernie_ir.ir.parser import parse_graph

    return parse_graph((root / "graph.ir").read_text(encoding="utf-8"), source=f"{root}/graph.ir")


Data = Path | list[tuple[list[int], list[int]]] | None
"""Training or evaluation data: a jsonl file, a list of (input_ids, labels) pairs already
tokenized (validated as the file's lines are), or None."""


def training_batches(recipe: dict[str, Any], graph: Any, data: Data, seed: int | None = None, *,
                     options: TrainOptions | None = None,
                     what: str = "data") -> list[tuple[np.ndarray, np.ndarray]]:
    """The (input_ids, labels) batches of a run: `data` (a jsonl file or a list of (input_ids,
    labels) pairs, named `what` in errors) cut by the options' batch size (padded with pad_id,
    labels ignore_index there), or one seeded synthetic batch. Every rank of a parallel run
    takes these same batches. `options` None: the recipe's."""
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
        if isinstance(data, (list, tuple)):
            seqs = validate_sequences(_given_rows(data, what), vocab, max_len, opts.ignore_index)
            if not seqs:
                raise ErnieIRError(f"{what} holds no sequences")
        else:
            seqs = _read_data(Path(data), vocab, max_len, opts.ignore_index)
        return _batches(seqs, opts.batch_size, opts.pad_id, opts.ignore_index)
    rng = np.random.default_rng(opts.seed)
    seq_len = int(recipe.get("batch", {}).get("seq_len", SYNTHETIC_SEQ_LEN))
    ids = rng.integers(0, vocab, size=(opts.batch_size, seq_len))
    return [(ids.astype(np.int64), ids.astype(np.int64))]


NO_DECAY = ("bias", "norm")
"""Params whose IR name holds one of these take no weight decay: the Trainers of PaddleNLP (and so
ERNIEKit) and transformers decay every weight but biases and normalization weights."""


def make_optimizer(paddle: Any, params: list[Any], options: TrainOptions, grad_clip: Any,
                   precision: Any = None, *, names: Sequence[str] | None = None) -> Any:
    """AdamW over `params` with the run's settings (the learning rate is set per step);
    `precision` (a training.precision.Precision, the recipe's): on a device, multi_precision (f32
    master weights of bf16 params) and the recorded moment dtype; on a CPU, plain f32 AdamW.
    `names`: the params' IR names, in order: biases and norm weights (`NO_DECAY`) are not decayed."""
    extra = {} if precision is None else precision.adamw_kwargs(paddle)
    if names is not None and options.weight_decay:
        decayed = {t.name for t, n in zip(params, names, strict=True) if not any(s in n for s in NO_DECAY)}
        extra["apply_decay_param_fun"] = decayed.__contains__
    return paddle.optimizer.AdamW(
        learning_rate=float(options.lr), parameters=params, beta1=options.beta1, beta2=options.beta2,
        epsilon=options.eps, weight_decay=options.weight_decay, grad_clip=grad_clip, **extra)


Batches = list[tuple[np.ndarray, np.ndarray]]
"""(input_ids, labels) batches, each [rows, positions] int64."""


@dataclass(frozen=True)
class Trainee:
    """What one process trains: Paddle, the Layer, the optimizer over its trainable params, and
    how a step reaches the other processes of a parallel run: `replica` (a data_parallel.Replica:
    this process takes its replica's rows of each batch, none: it skips the forward, and the loss
    is summed over the replicas) or `pipeline` (a pipeline.PipelineStage: each batch runs
    through the pipeline's schedule, its loss broadcast to every stage); both None: the whole
    batch here."""

    paddle: Any
    layer: Any
    optimizer: Any
    replica: Any = None
    pipeline: Any = None


def run_steps(model: Trainee, batches: Batches, steps: int,
              on_step: Callable[[int, float], Any] | None = None, *, options: TrainOptions | None = None,
              start: int = 0, after_step: Callable[[int, float], Any] | None = None) -> list[float]:
    """Optimizer steps start+1 .. `steps` over `batches` (cycled, `grad_accum` batches a step,
    step k taking batches k x grad_accum ..., learning rate by the schedule of `steps` steps);
    the loss of each step, the mean over the step's real target tokens. `on_step(step, loss)`,
    then `after_step(step, loss)` (evaluation, checkpoints) after each step.
    The one training loop of every rank count: one process here, or each paddle.distributed rank
    (`model.replica`, `model.pipeline`); the count of real target tokens is always the whole
    batch's."""
    paddle, layer, optimizer, replica = model.paddle, model.layer, model.optimizer, model.replica
    opts = options if options is not None else TrainOptions()
    losses: list[float] = []
    for step in range(start, steps):
        micro = step_batches(batches, step, opts.grad_accum)
        count = sum(target_tokens(labels, opts.ignore_index) for _, labels in micro)
        optimizer.set_lr(opts.lr_at(step, steps))
        total = 0.0
        for ids, labels in micro:
            if model.pipeline is not None:
                total += model.pipeline.run(ids, labels, train=True, count=count)[0]
                continue
            if replica is not None:
                part = replica.rows(ids, labels)
                if part is None:
                    continue  # a short final batch: no rows for this replica; zeros in the sums
                ids, labels = part
            loss_sum, _ = token_loss_sum(paddle, layer, ids, labels, opts.ignore_index)
            (loss_sum / max(count, 1)).backward()
            total += float(loss_sum.numpy())
        if replica is not None:
            total = replica.sum(total)  # every replica raises alike below
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
        if after_step is not None:
            after_step(step + 1, losses[-1])
    return losses


def evaluate(paddle: Any, layer: Any, batches: list[tuple[np.ndarray, np.ndarray]],
             ignore_index: int = IGNORE, pipeline: Any = None) -> float:
    """The mean next-token loss over every real target token of `batches`: no gradients, the
    Layer in eval mode (dropout off), QAT state not committed; the Layer's mode is restored.
    On several ranks every rank calls it (the forward's collectives pair up)."""
    was_training, tracking = layer.training, layer.track_state
    layer.eval()
    layer.track_state = False
    total, count = 0.0, 0
    try:
        with paddle.no_grad():
            for ids, labels in batches:
                if pipeline is not None:
                    total += pipeline.run(ids, labels)[0]
                    count += target_tokens(labels, ignore_index)
                    continue
                loss_sum, n = token_loss_sum(paddle, layer, ids, labels, ignore_index)
                total += float(loss_sum.numpy())
                count += n
    finally:
        if was_training:
            layer.train()
        layer.track_state = tracking
    return total / max(count, 1)


def train_session(model: Trainee, batches: Batches, steps: int, *, options: TrainOptions, start: int = 0,
                  report: Callable[[int, float], Any] | None = None, eval_batches: Batches | None = None,
                  on_eval: Callable[[int, float], Any] | None = None,
                  checkpoint: Callable[[int, float, float | None], Path | None] | None = None) -> TrainResult:
    """`run_steps` from step `start` with the evaluation loss (`evaluate`, over `eval_batches`)
    every options.eval_steps steps and at the end, reported to `on_eval(step, loss)`, then
    `checkpoint(step, loss, eval_loss)` every options.save_steps steps and at the end (it returns
    the published folder, or None on ranks that publish nothing). Shared by one-rank training and
    each rank of a multi-rank run (evaluation is not split: every replica of `model` evaluates
    all of `eval_batches`, the same loss)."""
    evals: list[tuple[int, float]] = []
    saved: list[Path] = []

    def due(every: int | None, step: int) -> bool:
        return step == steps or (every is not None and step % every == 0)

    def after(step: int, loss: float) -> None:
        eval_loss = None
        if eval_batches is not None and due(options.eval_steps, step):
            eval_loss = evaluate(model.paddle, model.layer, eval_batches, options.ignore_index,
                                 model.pipeline)
            evals.append((step, eval_loss))
            if on_eval is not None:
                on_eval(step, eval_loss)
        if checkpoint is not None and due(options.save_steps, step):
            path = checkpoint(step, loss, eval_loss)
            if path is not None:
                saved.append(path)

    losses = run_steps(model, batches, steps, report, options=options, start=start, after_step=after)
    return TrainResult(losses, evals, [p for p in saved if p.exists()], start + 1)


def _require_finite_params(layer: Any, step: int) -> None:
    """A step that made a trainable param NaN or Inf stops the run (LoRA adapters and QAT scales
    are small; a full-parameter run reads every param once a step, which its step's own
    forward and backward outweigh)."""
    for name in getattr(layer, "trainable_names", ()):
        if not np.isfinite(layer.tensor(name).numpy()).all():
            raise ErnieIRError(f"training step {step}: param {name} became NaN or Inf: stopped, no "
                               "checkpoint written; lower --lr or set --clip-norm")


def token_loss_sum(paddle: Any, layer: Any, ids: np.ndarray, labels: np.ndarray,
                   ignore_index: int = IGNORE) -> tuple[Any, int]:
    """(summed cross-entropy of logits[:, :-1] against labels[:, 1:] over the positions whose
    label is not `ignore_index`, their count). A Layer with a `vocab_shard` (a tensor-parallel
    rank graph that keeps its vocabulary shard of the logits, training/vocab_parallel.py): the
    vocabulary-parallel cross-entropy over the shards, the same loss on every rank."""
    logits = layer(paddle.to_tensor(ids))
    return logits_loss_sum(paddle, logits, labels, ignore_index, getattr(layer, "vocab_shard", None),
                           getattr(layer, "world_size", 1))


def logits_loss_sum(paddle: Any, logits: Any, labels: np.ndarray, ignore_index: int = IGNORE,
                    shard: Any = None, world: int = 1) -> tuple[Any, int]:
    """`token_loss_sum` of given logits [B, S, V] (a pipeline's last stage computes them);
    `shard`: the vocabulary shard they hold (vocab_parallel.keep_vocab_shards), over `world` ranks."""
    v = logits.shape[-1]
    target = labels[:, 1:].reshape(-1)
    keep = target != ignore_index
    if shard is not None:
        from ernie_ir.training.vocab_parallel import vocab_parallel_cross_entropy

        per_token = vocab_parallel_cross_entropy(
            logits[:, :-1].reshape([-1, v]), paddle.to_tensor(target.astype(np.int64)), shard.start,
            ignore_index=ignore_index, world=world)
        return paddle.sum(per_token), int(keep.sum())
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


@dataclass(frozen=True)
class RunPlan:
    """A run of `train_artifact`, resolved and checked before anything trains (`plan_run`)."""

    root: Path
    steps: int
    manifest: Manifest
    recipe: dict[str, Any]
    world: int
    """The artifact's rank graphs (pp x the model-parallel ranks)."""
    processes: int
    """The processes the run starts: dp x world (1: this one)."""
    options: TrainOptions
    graph: Any
    """rank0's graph (a pipelined artifact: the whole graph, no weights), what the batches fit."""
    batches: Batches
    eval_batches: Batches | None
    fingerprint: str
    point: ResumePoint | None
    """The checkpoint the run continues (None: a fresh run)."""
    synthetic: bool = False
    """No data was given: the run trains on the recipe's synthetic batch."""

    @property
    def start(self) -> int:
        """The step the run starts after: the resumed checkpoint's, else 0."""
        return 0 if self.point is None else self.point.step

    @property
    def names(self) -> list[str]:
        """The params a checkpoint holds: the trainable ones and the QAT state."""
        return list(self.recipe.get("trainable", [])) + list(self.recipe.get("qat_state", []))


def _progress_reporter(plan: RunPlan, hooks: TrainHooks) -> tuple[Callable[[int, float], None],
                                                                   Callable[..., None]]:
    """(`report(step, loss)`: hooks.on_step, then hooks.on_progress with a StepProgress;
    `restart()`: the clock of StepProgress.elapsed_s starts again, as a multi-rank run's first
    step begins after its processes have started)."""
    began = [time.monotonic()]
    seen = [0]

    def restart(*_: Any) -> None:
        began[0] = time.monotonic()

    options, batches, steps = plan.options, plan.batches, plan.steps

    def report(step: int, loss: float) -> None:
        if hooks.on_step is not None:
            hooks.on_step(step, loss)
        if hooks.on_progress is None:
            return
        tokens = sum(target_tokens(lab, options.ignore_index)
                     for _, lab in step_batches(batches, step - 1, options.grad_accum))
        seen[0] += tokens
        hooks.on_progress(StepProgress(step=step, steps=steps, loss=loss, lr=options.lr_at(step - 1, steps),
                                       tokens=tokens, elapsed_s=time.monotonic() - began[0],
                                       total_tokens=seen[0], start_step=plan.start))

    return report, restart


def plan_run(root: Path, steps: int, data: Data = None, *,
             options: dict[str, Any] | TrainOptions | None = None, save: bool = True,
             eval_data: Path | None = None, eval_sequences: list[Sequence] | None = None,
             resume: str | Path | bool | None = None) -> RunPlan:
    """`train_artifact`'s run, every refusal (ErnieIRError, one line) before anything trains or
    starts: the steps, the options (the recipe's, replaced by `options`' keys given; ERNIEKit's
    `resume_from_checkpoint` among them stands in for `resume`), the evaluation data, the layout,
    the batches and the checkpoint to resume."""
    from ernie_ir.artifacts import artifact_mapping
    from ernie_ir.ir.storage import load_graph
    from ernie_ir.training.checkpoints import artifact_fingerprint, resume_point
    from ernie_ir.training.data_parallel import refuse_qat_state

    if not 1 <= steps <= MAX_STEPS:
        raise ErnieIRError(f"--steps must be in [1, {MAX_STEPS}], got {steps}")
    manifest, recipe, world = read_training_artifact(root)
    given = options.model_dump() if isinstance(options, TrainOptions) else dict(options or {})
    given, config_resume = split_run_keys(given)
    opts = resolve_options(recipe, given)
    resume = config_resume if resume is None else resume
    if eval_data is not None and eval_sequences is not None:
        raise ErnieIRError("give the evaluation data once: eval_data (a jsonl file) or eval_sequences")
    evaluation: Data = eval_data if eval_data is not None else eval_sequences
    if opts.eval_steps is not None and evaluation is None:
        raise ErnieIRError("--eval-steps needs evaluation data (eval_data or eval_sequences)")
    if not save and (opts.save_steps is not None or opts.save_total_limit is not None):
        raise ErnieIRError("--save-steps and --save-total-limit need checkpoints: train with save=True")
    mapping = artifact_mapping(manifest)
    processes = check_layout(opts, world, mapping.pp, mapping.micro_batches)
    refuse_qat_state(recipe, opts.dp)
    graph = load_graph(root / "rank0") if mapping.pp == 1 else whole_graph(root)
    batches = training_batches(recipe, graph, data, options=opts)  # bad data fails before any process
    evals = None
    if evaluation is not None:
        evals = training_batches(recipe, graph, evaluation, options=opts,
                                 what="eval_data" if eval_data is not None else "eval_sequences")
    fingerprint = artifact_fingerprint(manifest, world)
    point = resume_point(root, resume, world=world, fingerprint=fingerprint, steps=steps,
                         options=opts.model_dump(), batches=batches)
    return RunPlan(root, steps, manifest, recipe, world, processes, opts, graph, batches, evals, fingerprint,
                   point, synthetic=data is None)


def train_artifact(path: Path, steps: int, data: Data = None, *, save: bool = True,
                   options: dict[str, Any] | TrainOptions | None = None, hooks: TrainHooks | None = None,
                   timeout_s: float | None = None, eval_data: Path | None = None,
                   eval_sequences: list[Sequence] | None = None,
                   resume: str | Path | bool | None = None) -> TrainResult:
    """Train the artifact's trainable params up to step `steps` (AdamW); returns a TrainResult.

    Settings (`options`): a TrainOptions, or a dict of TrainOptions names or ERNIEKit aliases
    (None values are absent) replacing the recipe's values (`{"lr": 1e-2, "save_steps": 5}`).
    `data`: a jsonl file, a list of (input_ids, labels) pairs, or None (a synthetic batch).
    `eval_data` (jsonl) or `eval_sequences` (pairs): the mean next-token loss over them every
    `eval_steps` steps and at the end (TrainResult.eval_losses).
    With `save`, a checkpoint folder at the end and every `save_steps` steps
    (ernie_ir.training.checkpoints has the layout), the newest `save_total_limit` of the artifact
    kept. `resume`: True or "latest" (the artifact's newest checkpoint), a checkpoint folder or
    its name: continue that run from its step with its optimizer, RNG state and data position, as
    a new run (new run-K); `steps` is the total. `options` may carry ERNIEKit's
    `resume_from_checkpoint` instead.
    `hooks` (TrainHooks): `on_start(start, steps)` once the run is checked, `on_step(step, loss)`
    and `on_progress(StepProgress)` after each step, `on_eval(step, loss)` after each evaluation,
    `on_checkpoint(folder)` in this process after each checkpoint is published (before older
    ones are removed).
    A multi-rank artifact runs on one paddle.distributed process per rank (gloo on this CPU,
    ernie_ir.backends.paddle.launch), bounded by `timeout_s` (default 3600 s). Data parallelism (the
    options' `dp` and `sharding`: the artifact's layout unless given) runs dp x ranks processes
    (ernie_ir.training.data_parallel).
    """
    from dataclasses import replace

    from ernie_ir.training.precision import Precision

    paddle = require_paddle()
    hooks = TrainHooks() if hooks is None else hooks
    plan = plan_run(Path(path), steps, data, options=options, save=save, eval_data=eval_data,
                    eval_sequences=eval_sequences, resume=resume)
    report, restart = _progress_reporter(plan, hooks)
    if hooks.on_start is not None:
        hooks.on_start(plan.start, plan.steps)
    recorded = Precision.from_recipe(plan.recipe)  # this machine's run is CPU: f32, says what a device keeps
    if plan.processes > 1:
        from ernie_ir.training.launch import TRAIN_TIMEOUT_S, train_distributed
        from ernie_ir.training.rank_data import RankData

        ranks_hooks = TrainHooks(on_start=restart, on_step=report, on_eval=hooks.on_eval,
                                 on_checkpoint=hooks.on_checkpoint)
        data = RankData(batches=plan.batches, eval_batches=plan.eval_batches, synthetic=plan.synthetic)
        result = train_distributed(plan.root, plan.processes, steps, data, options=plan.options,
                                   save=save, hooks=ranks_hooks, resume=plan.point,
                                   timeout_s=TRAIN_TIMEOUT_S if timeout_s is None else timeout_s)
    else:
        result = _train_one_rank(paddle, plan, save, report, hooks, restart)
    return replace(result, precision="" if recorded is None else recorded.cpu_line())


def _train_one_rank(paddle: Any, plan: RunPlan, save: bool, report: Callable[[int, float], Any],
                    hooks: TrainHooks, begin: Callable[[], Any]) -> TrainResult:
    """The run of `plan` in this process: its Layer, AdamW (a global-norm clip), checkpoints and
    `train_session`; the result with this process's `rank_stats`."""
    from dataclasses import replace

    from ernie_ir.backends.paddle.layer import build_layer
    from ernie_ir.training.checkpoints import RankPlace, restore_rank
    from ernie_ir.training.data_parallel import rank_stats

    opts = plan.options
    paddle.seed(opts.seed)
    layer = build_layer(plan.graph, device="cpu")
    layer.train()
    layer.track_state = True
    params = layer.trainable_parameters()
    if not params:
        raise ErnieIRError(f"{plan.root}: the graph has no trainable params")
    clip = opts.clip()
    optimizer = make_optimizer(paddle, params, opts, paddle.nn.ClipGradByGlobalNorm(clip) if clip else None,
                               names=layer.trainable_names)
    checkpoint = _one_rank_checkpoints(plan, paddle, layer, optimizer, hooks.on_checkpoint) if save else None
    if plan.point is not None:
        restore_rank(paddle, layer, optimizer, plan.point, plan.names, RankPlace())
    begin()  # tokens/s counts the steps, not building the Layer
    result = train_session(Trainee(paddle, layer, optimizer), plan.batches, plan.steps, options=opts,
                           start=plan.start, report=report, eval_batches=plan.eval_batches,
                           on_eval=hooks.on_eval, checkpoint=checkpoint)
    return replace(result, rank_stats=[rank_stats(layer, optimizer, 0, 0)])


def _one_rank_checkpoints(plan: RunPlan, paddle: Any, layer: Any, optimizer: Any,
                          on_checkpoint: Callable[[Path], Any] | None
                          ) -> Callable[[int, float, float | None], Path]:
    """The `checkpoint` of a one-rank train_session: each call writes the folder (params at
    global names, optimizer.rank0, trainer_state.json), publishes it as run-K-step-N (K chosen
    by the first one), calls `on_checkpoint`, then keeps the newest save_total_limit (SIGINT and
    SIGTERM held back from the publish to the pruning: training.interrupts)."""
    from ernie_ir.training.checkpoints import (
        CheckpointContext,
        RankPlace,
        checkpoint_expected,
        prune_checkpoints,
        save_checkpoint,
        stage_rank_state,
        trainer_state_base,
        write_trainer_state,
    )

    opts = plan.options
    base = trainer_state_base(steps=plan.steps, world=1, fingerprint=plan.fingerprint,
                              options=opts.model_dump(), batches=plan.batches,
                              resumed_from=None if plan.point is None else plan.point.name,
                              synthetic=plan.synthetic)
    ctx = CheckpointContext(plan.root, plan.names, base, expected=checkpoint_expected(plan.manifest))

    def published(out: Path) -> None:
        if on_checkpoint is not None:
            on_checkpoint(out)
        if opts.save_total_limit is not None:
            prune_checkpoints(ctx.root, opts.save_total_limit)

    def checkpoint(step: int, loss: float, eval_loss: float | None) -> Path:
        def write(stage: Path) -> None:
            stage_rank_state(stage, paddle, layer, optimizer, ctx.names, RankPlace(), step)
            write_trainer_state(stage, ctx.base, step, loss, eval_loss)

        # a signal waits until the checkpoint, its adapter and the pruning are done
        return save_checkpoint(ctx.root, write, step, ctx.run, ctx.expected, then=published)

    return checkpoint


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
