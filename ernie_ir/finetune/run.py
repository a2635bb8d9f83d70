"""`fine_tune`: a training run from data files in any of sft_data's formats to checkpoints that
carry paddleformers adapter folders; what `ernie-ir train` calls.

    from ernie_ir.finetune import fine_tune
    result = fine_tune(Path("art/lora"), 100, Path("sft.jsonl"), eval_data=Path("dev.jsonl"),
                       max_seq_len=2048, options={"eval_steps": 20, "save_steps": 50})

The artifact's tokenizer (the folder the manifest's `"tokenizer"` names, copied from the
checkpoint at compile time) turns text and ERNIEKit SFT lines into (input_ids, labels) rows
(`read_sft_data`); token-id lines need none. Examples are truncated only when `max_seq_len` is
given (ERNIEKit's rule: the oldest turns first; text and token ids at the tail); without it an
example longer than the model's positions is refused with its line number, as the runtime
refuses any over-long row. The rows go to `ernie_ir.training.loop.train_artifact`, whose
`on_checkpoint` hook writes each published checkpoint's `adapter/` (`export_adapter`) as soon as
it is published, then calls the caller's own. Packing is refused by `ernie-ir train`
(`sft_data.PACKING_REFUSED` says why).

Pretraining data (`data` a PREFIX with PREFIX_ids.npy + PREFIX_idx.npz: ernie_ir.training.pretrain_data)
gives `max_seq_len + 1`-token windows in PaddleNLP's GPT dataset order (seed: the options' `seed`);
its validation part is the evaluation data. How long: `steps`, or `epochs` passes (`epoch_steps`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ernie_ir.frontends.tokenizer import Tokenizer
from ernie_ir.ir import ErnieIRError
from ernie_ir.training.checkpoints import TrainResult
from ernie_ir.training.hooks import TrainHooks
from ernie_ir.training.pretrain_data import (
    DEFAULT_SPLIT,
    PretrainCorpus,
    PretrainDataError,
    is_prefix,
    parse_split,
)

from .adapters import export_adapter
from .sft_data import read_sft_data


class FineTuneError(ErnieIRError):
    """A fine-tuning request that cannot run as given."""


def artifact_tokenizer(artifact: Path) -> Tokenizer | None:
    """The tokenizer a compiled artifact carries (None: it has none)."""
    from ernie_ir.artifacts import read_manifest
    from ernie_ir.frontends.tokenizer import load_tokenizer

    folder = read_manifest(artifact).tokenizer
    return load_tokenizer(Path(artifact) / folder) if isinstance(folder, str) else None


def model_positions(artifact: Path) -> int | None:
    """The positions the artifact's model has: its position_ids limit (learned positions), else
    its config's `max_position_embeddings` (RoPE models such as ERNIE 4.5 have no position_ids
    node); None when neither is known."""
    from ernie_ir.ir.storage import load_graph

    graph = load_graph(Path(artifact) / "rank0")
    limits = [n.attrs.limit for n in graph.nodes
              if n.op == "position_ids" and getattr(n.attrs, "limit", None) is not None]
    if limits:
        return min(limits)
    config = graph.metadata.get("config")
    n = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return n if type(n) is int and n > 0 else None


def epoch_steps(examples: int, epochs: float, batch_size: int, grad_accum: int) -> int:
    """Optimizer steps of `epochs` passes over `examples` (PaddleNLP's and ERNIEKit's Trainer rule
    for num_train_epochs without max_steps): `max(1, int(epochs * per_epoch))` with per_epoch =
    `max(1, ceil(examples / batch_size) // grad_accum)` (the last batch of a pass may be short)."""
    per_epoch = max(1, math.ceil(examples / batch_size) // grad_accum)
    return max(1, int(per_epoch * epochs))


@dataclass(frozen=True)
class Epochs:
    """How long to train as passes over the data (ERNIEKit's `num_train_epochs`): the steps follow
    from the data size, batch size and gradient accumulation (`epoch_steps`)."""

    count: float


def train_length(steps: int | None, epochs: float | None) -> int | Epochs:
    """How long to train, from --steps and --num-train-epochs: exactly one of them (PaddleNLP lets
    max_steps win silently; here both is an error)."""
    if epochs is not None and not (isinstance(epochs, (int, float)) and math.isfinite(epochs) and epochs > 0):
        raise FineTuneError(f"--num-train-epochs must be a number > 0, got {epochs}")
    if steps is not None and epochs is not None:
        raise FineTuneError(f"--steps {steps} and --num-train-epochs {epochs} both say how long to train: "
                            "give one of them")
    if steps is None and epochs is None:
        raise FineTuneError("give --steps N, or --num-train-epochs E with --data (the steps follow from "
                            "the data size, batch size and gradient accumulation)")
    return Epochs(float(epochs)) if epochs is not None else int(steps or 0)


def _check_length(steps: int | Epochs, data: Path | None) -> None:
    if isinstance(steps, Epochs):
        train_length(None, steps.count)
        if data is None:
            raise FineTuneError(f"--num-train-epochs {steps.count:g} needs --data: the synthetic batch has "
                                "no size (give --steps N instead)")


def fine_tune(artifact: Path, steps: int | Epochs, data: Path | None = None, *, eval_data: Path | None = None,
              max_seq_len: int | None = None, options: dict[str, Any] | None = None,
              resume: str | Path | bool | None = None, hooks: TrainHooks | None = None,
              timeout_s: float | None = None, split: str | None = None) -> TrainResult:
    """Train `artifact` (a `--mode training` artifact) for `steps` steps, or `Epochs(E)` passes
    over `data` (`epoch_steps`; `train_length` reads the flags), on `data` (a JSON Lines file: ERNIEKit SFT,
    alpaca, text or token ids; a pretraining PREFIX with PREFIX_ids.npy + PREFIX_idx.npz, cut
    into `max_seq_len + 1`-token windows split by `split` (ernie_ir.training.pretrain_data), its
    validation part the evaluation data; None: a synthetic batch), evaluating on `eval_data`
    every `options["eval_steps"]` steps. Every LoRA checkpoint gets its `adapter/` (before
    `hooks.on_checkpoint` sees the folder). `options`: TrainOptions names or ERNIEKit aliases
    (ernie_ir.training.loop); `hooks`: train_artifact's (TrainHooks). FineTuneError,
    SftDataError, PretrainDataError and the training loop's errors are one line each."""
    root = Path(artifact)
    if max_seq_len is not None and max_seq_len < 2:
        raise FineTuneError(f"--max-seq-len must be at least 2 tokens, got {max_seq_len}")
    _check_length(steps, data)
    epochs = steps.count if isinstance(steps, Epochs) else None
    steps = None if isinstance(steps, Epochs) else steps
    prefix = data is not None and is_prefix(Path(data))
    if split is not None:
        parse_split(split)
        if not prefix:
            raise FineTuneError(f"--split {split} cuts pretraining data (--data PREFIX, with PREFIX_ids.npy "
                                "and PREFIX_idx.npz): JSON Lines data has no split")
    from ernie_ir.training.loop import IGNORE, read_training_artifact, resolve_options

    _, recipe, _ = read_training_artifact(root)
    resolved = resolve_options(recipe, options or {})
    ignore_index = resolved.ignore_index
    positions = model_positions(root)
    if prefix:
        train_rows, eval_rows, steps = _pretrain_rows(Path(data), eval_data, steps, epochs, split,
                                                      max_seq_len, positions, resolved)
    if resolved.eval_steps is not None and eval_data is None and not (prefix and eval_rows):
        raise FineTuneError(f"--eval-steps {resolved.eval_steps} needs evaluation data: give --eval-data "
                            "FILE (JSON Lines, as --data; pretraining data: a --split with a validation "
                            "part holding a window) or drop --eval-steps")
    if not prefix and max_seq_len is not None and positions is not None and max_seq_len > positions:
        raise FineTuneError(f"--max-seq-len {max_seq_len} exceeds the model's {positions} positions "
                            f"(max_position_embeddings): give at most {positions}")
    text_data = [p for p in ((None if prefix else data), eval_data) if p is not None]
    tokenizer = artifact_tokenizer(root) if text_data else None

    def rows(path: Path | None) -> list[tuple[list[int], list[int]]] | None:
        if path is None:
            return None
        return read_sft_data(Path(path), tokenizer, max_seq_len=max_seq_len, positions=positions,
                             ignore_index=ignore_index if ignore_index is not None else IGNORE)

    if not prefix:
        train_rows, eval_rows = rows(data), rows(eval_data)
        if steps is None:  # _check_length: epochs and data given
            steps = epoch_steps(len(train_rows or ()), float(epochs or 0), resolved.batch_size,
                                resolved.grad_accum)
    elif eval_rows is None:
        eval_rows = rows(eval_data)
    from ernie_ir.training.loop import train_artifact

    hooks = TrainHooks() if hooks is None else hooks

    def on_checkpoint(folder: Path) -> None:
        export_adapter(root, folder)
        if hooks.on_checkpoint is not None:
            hooks.on_checkpoint(folder)

    return train_artifact(root, steps, train_rows, options=options, timeout_s=timeout_s,
                          eval_sequences=eval_rows or None, resume=resume,
                          hooks=replace(hooks, on_checkpoint=on_checkpoint))


def _pretrain_rows(prefix: Path, eval_data: Path | None, steps: int | None, epochs: float | None,
                   split: str | None, seq_len: int | None, positions: int | None,
                   options: Any) -> tuple[list[Any], list[Any] | None, int]:
    """(training rows, evaluation rows or None, steps) of pretraining data: the training part's
    first steps x batch_size x grad_accum windows (PaddleNLP's dataset built for that many
    samples), the validation part's windows of one pass (each once, in its dataset's order)."""
    split = DEFAULT_SPLIT if split is None else split
    if seq_len is None:
        raise FineTuneError(f"--data {prefix} is pretraining data: give --max-seq-len L (PaddleNLP's "
                            "max_seq_length: each example is a window of L + 1 tokens)")
    if positions is not None and seq_len + 1 > positions:
        raise FineTuneError(f"--max-seq-len {seq_len}: a pretraining window is {seq_len + 1} tokens, "
                            f"more than the model's {positions} positions: give at most {positions - 1}")
    corpus = PretrainCorpus.open(prefix)
    per_pass = corpus.windows_per_pass("train", split, seq_len)
    if per_pass == 0:
        docs = corpus.documents("train", split)
        raise PretrainDataError(f"--data {prefix} --split {split}: the training part (documents "
                                f"{docs[0] if docs.size else 0}..{docs[-1] + 1 if docs.size else 0}) holds "
                                f"{corpus.tokens(docs)} tokens, not one window of --max-seq-len + 1 = "
                                f"{seq_len + 1}")
    if steps is None:
        steps = epoch_steps(per_pass, float(epochs or 0), options.batch_size, options.grad_accum)
    seed = options.seed
    train = corpus.windows("train", split, seq_len, seed, steps * options.batch_size * options.grad_accum)
    valid_n = corpus.windows_per_pass("valid", split, seq_len)
    if valid_n and eval_data is not None:
        raise FineTuneError(f"--eval-data {eval_data} and the validation part of --split {split} are both "
                            "evaluation data: give --eval-data with a split whose validation weight is 0 "
                            "(e.g. 99,0,1), or drop --eval-data")
    valid = corpus.windows("valid", split, seq_len, seed, valid_n) if valid_n else None
    return ([(w, None) for w in train], None if valid is None else [(w, None) for w in valid], steps)
