"""Fine-tuning data and files: ERNIEKit SFT, alpaca, text and token-id JSON Lines read as the
(input_ids, labels) rows of runtime's training loop, with ERNIEKit's loss mask and truncation
(`sft_data`); trained LoRA checkpoints written again as paddleformers adapter folders
(`adapters`); `fine_tune`, the run that joins them (`run`, what `ernie-ir train` calls).

    from ernie_ir.finetune import fine_tune, read_sft_data
    rows = read_sft_data(Path("train.jsonl"), tokenizer, max_seq_len=4096)
    result = fine_tune(Path("art/lora"), 100, Path("train.jsonl"), eval_data=Path("dev.jsonl"))

Layer (docs/architecture.md): above `runtime`, `passes` and `frontends` (it tokenizes text with
the frontends' tokenizers for the training loop, and writes adapters with the lora passes'
format module); only `cli` imports it.
"""

from __future__ import annotations

from .adapters import ADAPTER, export_adapter
from .run import Epochs, FineTuneError, artifact_tokenizer, fine_tune, model_positions, train_length
from .sft_data import END_OF_SENTENCE, PACKING_REFUSED, SftDataError, read_sft_data

__all__ = ["ADAPTER", "END_OF_SENTENCE", "PACKING_REFUSED", "Epochs", "FineTuneError", "SftDataError",
           "artifact_tokenizer", "export_adapter", "fine_tune", "model_positions", "read_sft_data",
           "train_length"]
