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
it is published, then calls the caller's own. Packing is refused (`PACKING_REFUSED` says why).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ernie_ir.frontends.tokenizer import Tokenizer
from ernie_ir.ir import ErnieIRError
from ernie_ir.training.checkpoints import TrainResult
from ernie_ir.training.hooks import TrainHooks

from .adapters import export_adapter
from .sft_data import PACKING_REFUSED, read_sft_data


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


def fine_tune(artifact: Path, steps: int, data: Path | None = None, *, eval_data: Path | None = None,
              max_seq_len: int | None = None, packing: bool = False,
              options: dict[str, Any] | None = None, resume: str | Path | bool | None = None,
              hooks: TrainHooks | None = None, timeout_s: float | None = None) -> TrainResult:
    """Train `artifact` (a `--mode training` artifact) for `steps` steps on `data` (a JSON Lines
    file: ERNIEKit SFT, alpaca, text or token ids; None: a synthetic batch), evaluating on
    `eval_data` every `options["eval_steps"]` steps. Every LoRA checkpoint gets its `adapter/`
    (before `hooks.on_checkpoint` sees the folder). `options`: TrainOptions names or ERNIEKit
    aliases (ernie_ir.training.loop); `hooks`: train_artifact's (TrainHooks). FineTuneError,
    SftDataError and the training loop's errors are one line each."""
    root = Path(artifact)
    if packing:
        raise FineTuneError(f"--packing: {PACKING_REFUSED}")
    if max_seq_len is not None and max_seq_len < 2:
        raise FineTuneError(f"--max-seq-len must be at least 2 tokens, got {max_seq_len}")
    from ernie_ir.training.loop import IGNORE, read_training_artifact, resolve_options

    _, recipe, _ = read_training_artifact(root)
    resolved = resolve_options(recipe, options or {})
    ignore_index = resolved.ignore_index
    if resolved.eval_steps is not None and eval_data is None:
        raise FineTuneError(f"--eval-steps {resolved.eval_steps} needs evaluation data: give --eval-data "
                            "FILE (JSON Lines, as --data) or drop --eval-steps")
    positions = model_positions(root)
    if max_seq_len is not None and positions is not None and max_seq_len > positions:
        raise FineTuneError(f"--max-seq-len {max_seq_len} exceeds the model's {positions} positions "
                            f"(max_position_embeddings): give at most {positions}")
    tokenizer = artifact_tokenizer(root) if data is not None or eval_data is not None else None

    def rows(path: Path | None) -> list[tuple[list[int], list[int]]] | None:
        if path is None:
            return None
        return read_sft_data(Path(path), tokenizer, max_seq_len=max_seq_len, positions=positions,
                             ignore_index=ignore_index if ignore_index is not None else IGNORE)

    from ernie_ir.training.loop import train_artifact

    hooks = TrainHooks() if hooks is None else hooks

    def on_checkpoint(folder: Path) -> None:
        export_adapter(root, folder)
        if hooks.on_checkpoint is not None:
            hooks.on_checkpoint(folder)

    return train_artifact(root, steps, rows(data), options=options, timeout_s=timeout_s,
                          eval_sequences=rows(eval_data), resume=resume,
                          hooks=replace(hooks, on_checkpoint=on_checkpoint))
