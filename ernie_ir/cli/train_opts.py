"""`ernie-ir train`'s flags: each a typer annotation (what `--help` shows), and the table that maps
the flags that set a training option onto their `TrainOptions` field.

The training options have one home, `ernie_ir.training.loop.TrainOptions` (every default, every
bound, the ERNIEKit aliases); the command copies no flag into them by hand: `flag_options` takes
the command's parameters through `TRAIN_OPTION_FLAGS`. Every TrainOptions field is either in the
table or in `CONFIG_ONLY_OPTIONS` (tests/test_cli_train_flags.py checks both ways), so a new
field cannot be forgotten.

Like every module of the CLI, this one imports nothing of the library at module level (see
app.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

# -- the run: what to train on, from where, and what to show -----------------------------------------

ArtifactArg = Annotated[Path, typer.Argument(
    help="An artifact compiled with --mode training, or an ERNIEKit config (CONFIG.yaml): its model is "
    "compiled into its output_dir, then trained there, as erniekit train does.")]
OverridesArg = Annotated[list[str] | None, typer.Argument(
    help="After CONFIG.yaml: key=value overrides of its keys, read as erniekit's command line reads them "
    "(model_name_or_path=/path/to/folder max_steps=100).", show_default=False)]
ForceTrainOpt = Annotated[bool, typer.Option(
    "--force", help="With CONFIG.yaml: replace an existing output_dir (as overwrite_output_dir=True).")]
StepsOpt = Annotated[int | None, typer.Option(
    "--steps", "--max-steps", min=1, help="Optimizer steps (or give --num-train-epochs; not both; a config's "
    "max_steps or num_train_epochs stands in for both).")]
EpochsOpt = Annotated[float | None, typer.Option(
    "--num-train-epochs", help="Train for this many passes over --data instead of --steps (ERNIEKit's "
    "num_train_epochs; not both): steps = max(1, int(E x max(1, ceil(N / batch-size) // grad-accum))), "
    "N = the JSON Lines examples, or the training part's windows of pretraining data.")]
SplitOpt = Annotated[str | None, typer.Option(
    "--split", help="Pretraining data (--data PREFIX): train,validation,test weights of its documents, "
    "PaddleNLP's rule (default 949,50,1); the validation part is the evaluation data.")]
DataOpt = Annotated[
    Path | None, typer.Option(
        "--data", help='JSON lines: ERNIEKit SFT {"src", "tgt"[, "system", "label"]}, alpaca, '
        '{"text"} (tokenized with the artifact\'s tokenizer and chat template; only answers carry '
        'loss) or {"input_ids"[, "labels"]}; or pretraining data PREFIX (PaddleNLP\'s PREFIX_ids.npy + '
        'PREFIX_idx.npz, cut into --max-seq-len + 1 token windows); default: a fixed synthetic batch.')
]
EvalDataOpt = Annotated[
    Path | None, typer.Option("--eval-data", help="JSON lines as --data: the eval loss on them every "
                              "--eval-steps steps and at the end.")
]
MaxSeqLenOpt = Annotated[int | None, typer.Option(
    "--max-seq-len", help="Tokens per example: older turns are dropped first (ERNIEKit's rule), text "
    "and token ids are cut at the tail (default: no truncation; a row longer than the model's positions "
    "is refused). Pretraining data: the window length (required).")]
PackingOpt = Annotated[bool, typer.Option(
    "--packing/--no-packing", help="Pack several examples into one row (refused: see the message).")
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", help="YAML or JSON of training options (these names or ERNIEKit's: "
                 "learning_rate, per_device_train_batch_size, gradient_accumulation_steps, "
                 "max_grad_norm, weight_decay, adam_beta1/2, adam_epsilon, warmup_steps, "
                 "lr_scheduler_type, seed, save_steps, save_total_limit, eval_steps, "
                 "resume_from_checkpoint; without a flag: min_lr, vocab_parallel_loss, also "
                 "use_sparse_head_and_loss_fn; an ERNIEKit config whole: max_steps, "
                 "train_dataset_path, ..., its compile keys the artifact's own); flags given override it."),
]
ResumeOpt = Annotated[bool, typer.Option(
    "--resume", help="Continue from the artifact's newest checkpoint (optimizer, RNG, data position); "
    "--steps is the run's total.")]
ResumeFromOpt = Annotated[str | None, typer.Option(
    "--resume-from-checkpoint", "--resume-from",
    help="Continue from this checkpoint folder (or its name, e.g. run-001-step-10).")]
ProgressOpt = Annotated[bool | None, typer.Option(
    "--progress/--no-progress", help="Draw a progress bar on stderr (default: when it is a terminal).")
]
TrainJsonOpt = Annotated[bool, typer.Option("--json", help="Print the losses as JSON.")]

# -- the training options (TrainOptions fields; `dp` and `sharding` are cli.common's) ------------------

LrOpt = Annotated[float | None, typer.Option("--lr", "--learning-rate",
                                             help="AdamW peak learning rate (recipe: 1e-3).")]
BatchSizeOpt = Annotated[int | None, typer.Option(
    "--batch-size", "--per-device-train-batch-size", help="Sequences per batch (recipe: 4).")]
GradAccumOpt = Annotated[int | None, typer.Option(
    "--grad-accum", "--gradient-accumulation-steps",
    help="Batches per optimizer step, weighted by their token counts (recipe: 1).")]
ClipNormOpt = Annotated[float | None, typer.Option(
    "--clip-norm", "--max-grad-norm", help="Global gradient-norm clip, 0 = none (recipe: 1.0).")]
WeightDecayOpt = Annotated[float | None, typer.Option(
    "--weight-decay", help="AdamW decoupled weight decay (recipe: 0).")]
Beta1Opt = Annotated[float | None, typer.Option("--beta1", "--adam-beta1", help="AdamW beta1 (0.9).")]
Beta2Opt = Annotated[float | None, typer.Option("--beta2", "--adam-beta2", help="AdamW beta2 (0.999).")]
EpsOpt = Annotated[float | None, typer.Option("--eps", "--adam-epsilon", help="AdamW epsilon (1e-8).")]
WarmupStepsOpt = Annotated[int | None, typer.Option(
    "--warmup-steps", help="Steps of linear warmup from 0 (recipe: 0).")]
ScheduleOpt = Annotated[str | None, typer.Option(
    "--schedule", "--lr-scheduler-type",
    help="After warmup: constant, linear or cosine (decay to 0 at --steps; recipe: constant).")]
SeedOpt = Annotated[int | None, typer.Option(
    "--seed", help="Seed of dropout, the synthetic batch and pretraining data's window order (recipe: 0).")]
PadIdOpt = Annotated[int | None, typer.Option(
    "--pad-id", help="Token that fills input_ids past a sequence's end (recipe: 0).")]
IgnoreIndexOpt = Annotated[int | None, typer.Option(
    "--ignore-index", help="Label of padded positions, skipped by the loss (recipe: -100).")]
SaveStepsOpt = Annotated[int | None, typer.Option(
    "--save-steps", help="Write a checkpoint every N steps too (default: at the end only).")]
SaveTotalLimitOpt = Annotated[int | None, typer.Option(
    "--save-total-limit", help="Keep the artifact's newest N checkpoints, deleting older ones.")]
EvalStepsOpt = Annotated[int | None, typer.Option(
    "--eval-steps", help="Evaluate the loss on the evaluation data every N steps too.")]
MicroBatchesOpt = Annotated[int | None, typer.Option(
    "--micro-batches", help="A pipelined artifact (--pp): micro-batches each batch is cut into (must "
    "divide --batch-size; default: the artifact's).")]
PipelineScheduleOpt = Annotated[str | None, typer.Option(
    "--pipeline-schedule", help="A pipelined artifact: 1f1b (default) or gpipe (every forward, then "
    "every backward).")]

TRAIN_OPTION_FLAGS: dict[str, str] = {
    "lr": "lr", "batch_size": "batch_size", "grad_accum": "grad_accum", "clip_norm": "clip_norm",
    "weight_decay": "weight_decay", "beta1": "beta1", "beta2": "beta2", "eps": "eps",
    "warmup_steps": "warmup_steps", "schedule": "schedule", "seed": "seed", "pad_id": "pad_id",
    "ignore_index": "ignore_index", "save_steps": "save_steps", "save_total_limit": "save_total_limit",
    "eval_steps": "eval_steps", "dp": "dp", "sharding": "sharding", "micro_batches": "micro_batches",
    "pipeline_schedule": "pipeline_schedule",
}
"""`train`'s parameter -> the TrainOptions field its flag sets (the flag: `--` + the field name with
dashes, then the ERNIEKit alias)."""

CONFIG_ONLY_OPTIONS = frozenset({"vocab_parallel_loss", "min_lr"})
"""TrainOptions fields no flag sets: a --config key (or the API's `options`) only."""


def flag_options(params: Mapping[str, Any]) -> dict[str, Any]:
    """The training options the flags given set, by TrainOptions field: `params` (the command's
    parameters by name) through TRAIN_OPTION_FLAGS; a flag not given (None) is left out."""
    return {field: params[param] for param, field in TRAIN_OPTION_FLAGS.items() if params[param] is not None}
