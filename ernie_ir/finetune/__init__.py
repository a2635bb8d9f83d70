"""Fine-tuning data and files: ERNIEKit SFT, alpaca, text and token-id JSON Lines read as the
(input_ids, labels) rows of runtime's training loop, with ERNIEKit's loss mask and truncation.

    from ernie_ir.finetune import read_sft_data
    rows = read_sft_data(Path("train.jsonl"), tokenizer, max_seq_len=4096)

Layer (docs/architecture.md): above `runtime`, `passes` and `frontends` (it tokenizes text with
the frontends' tokenizers for the training loop); only `cli` imports it.
"""

from __future__ import annotations

from .sft_data import END_OF_SENTENCE, PACKING_REFUSED, SftDataError, read_sft_data

__all__ = ["END_OF_SENTENCE", "PACKING_REFUSED", "SftDataError", "read_sft_data"]
