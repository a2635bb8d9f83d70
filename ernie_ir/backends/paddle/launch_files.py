"""The files the launchers (launch.py, training/launch.py) and the rank workers both name.

The launcher starts the rank worker as a module (`python -m`) and reads what the ranks leave behind: the
one-line error of a failing rank, rank 0's training events (losses, evaluations, published
checkpoints), and the staging folder of a checkpoint that a failed run must remove. Both
sides take the names from here, so neither imports the other.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

ERROR_FILE = "error.rank{rank}.txt"
"""Where a failing rank writes its one-line error (in $ERNIE_IR_WORKDIR), for the launcher."""
CHECKPOINTS = Path("training") / "checkpoints"
EVENT_EVAL = "eval"
EVENT_CHECKPOINT = "checkpoint"
"""Rank 0's lines in a training run's `--losses` file: one `{"step", "loss", "grad_norm"}` per
step, and `{"event": "eval", "step", "loss"}` after an evaluation, `{"event": "checkpoint",
"step", "path"}` once a checkpoint folder is published (the launcher calls on_checkpoint)."""


def staging_dir(root: Path, master: str) -> Path:
    """Where the ranks of the launch whose rendezvous is `master` (host:port) stage a checkpoint:
    one launch, one port, so the name is the same on every rank and unique per run."""
    return root / CHECKPOINTS / f".partial-{master.replace(':', '-')}"


# -- generation (`rank_worker generate`): what the launcher asks, what rank 0 answers ------------

DECODE_REQUEST = "request.json"
"""The prompts and DecodeOptions every rank decodes with (written by the launcher)."""
DECODE_TOKENS = "tokens.jsonl"
"""Rank 0 appends one line per step: {"step", "tokens", "live"} (the launcher streams them)."""
DECODE_RESULT = "result.json"
"""Rank 0's DecodeResult without the logits (written once the loop is done)."""
DECODE_LOGITS = "step_logits.npy"
"""With keep_logits: rank 0's step logits, float32 [steps, B, V]."""
DECODER_GRAPH = "decoder.rank{rank}.ir"
"""Rank r's decoder graph (the kv-cache pass applied), text only: its params are read from the
artifact's rank{r}/weights.safetensors, so no weight byte is copied."""


def write_decode_request(path: Path, prompts: list[list[int]], options: Any) -> None:
    """`options`: a DecodeOptions (its sampling seed must be set when it samples: every rank
    draws from the same generator)."""
    data = {"prompts": prompts, "max_new_tokens": options.max_new_tokens,
            "sampling": asdict(options.sampling), "eos_ids": sorted(options.eos_ids),
            "pad_id": options.pad_id, "keep_logits": options.keep_logits}
    path.write_text(json.dumps(data), encoding="utf-8")


def read_decode_request(path: Path) -> tuple[list[list[int]], Any]:
    """(prompts, DecodeOptions) of a request file."""
    from ernie_ir.runtime.decoding import DecodeOptions, SamplingOptions

    data = json.loads(path.read_text(encoding="utf-8"))
    options = DecodeOptions(max_new_tokens=int(data["max_new_tokens"]),
                            sampling=SamplingOptions(**data["sampling"]),
                            eos_ids=frozenset(int(t) for t in data["eos_ids"]), pad_id=int(data["pad_id"]),
                            keep_logits=bool(data["keep_logits"]))
    return [[int(t) for t in p] for p in data["prompts"]], options
