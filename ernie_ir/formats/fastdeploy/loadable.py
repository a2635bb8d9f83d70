"""Which folders FastDeploy loads: a preset, a layout and a model family, decided from
FastDeploy's loader source before any pass runs, with the refusal (one line: FastDeploy's file
and function, and what works instead) for the rest. The command that serves a folder is `serve`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

PER_RANK = ("FastDeploy loads no pre-quantized weight-only expert (models/ernie4_5_moe.py, "
            "Ernie4_5_MoeForCausalLM's weight_key_map has no expert scale), and the bf16 folder it "
            "quantizes at load is quantized per rank (layers/moe/fused_moe_cutlass_backend.py, "
            "process_loaded_weights), which does not give back a row-parallel layer's scales; compile "
            "with --tp 1 (a bf16 folder FastDeploy quantizes back to exactly these codes) or --quant wint2")
"""Why weight-only MoE experts have no FastDeploy folder on more than one rank."""


@dataclass(frozen=True)
class LoadableCell:
    """A compile's FastDeploy-relevant choices (pipeline stages never reach here: the compile
    options refuse `--pp` with `--emit fastdeploy`, and a pipelined default leaves it out)."""

    preset: str | None
    """The canonical --quant preset (None: not quantized)."""
    moe: bool
    tp: int = 1
    ep: int = 1
    lora_unmerged: bool = False


WEIGHT_ONLY = ("wint8", "wint4", "wint8mix")
SERVED_PRESETS = (*WEIGHT_ONLY, "wint8mix-erniekit", "w4a8c8", "wint2")
"""The presets whose quantization FastDeploy serves (its wint8 / wint4 / mix_quant, w4a8, w4w2):
a default compile that cannot write a folder for one of them says why; others (not quantized,
FP8, QAT) leave FastDeploy out without a word."""


def fastdeploy_refusal(cell: LoadableCell) -> str | None:
    """Why FastDeploy cannot load the folder this compile would write (None: it can)."""
    if cell.preset is None:
        return ("the model is not quantized: FastDeploy serves the source checkpoint itself (quantizing "
                "and splitting at load, --quantization wint8|wint4); for a merged LoRA adapter, write it "
                "with `ernie-ir export`")
    if cell.ep > 1:
        return (f"expert parallelism (--ep {cell.ep}): FastDeploy's pre-sharded loader reads tensor-parallel "
                "rank folders only (model_executor/load_weight_utils.py, load_pre_sharded_checkpoint); "
                "compile with --tp N alone")
    if cell.lora_unmerged:
        return ("LoRA adapters: FastDeploy loads no adapter tensors (models/ernie4_5_moe.py); merge them "
                "(--lora-adapter DIR --merge-lora)")
    if cell.preset == "fp8":
        return ("FP8 W8A8 weights: ernie-ir writes no FastDeploy FP8 checkpoint (FastDeploy reads "
                "block-wise FP8 from torch-format folders, layers/quantization/block_wise_fp8.py); "
                "use --quant wint8 or wint8mix, or serve the source with --quantization block_wise_fp8")
    if cell.preset == "qat-int8":
        return ("QAT fake-quant params: FastDeploy loads no QAT state; compile the trained model for "
                "inference (its weights become int8, --quant-config) or use --quant wint8")
    if cell.moe and cell.preset == "w4a8c8":
        return ("W4A8C8 experts: FastDeploy's tensor-parallel W4A8 load stacks an empty list of expert "
                "input scales at --ep 1 (layers/moe/fused_moe_cutlass_backend.py, "
                "CutlassW4A8MoEMethod.process_prequanted_weights), and it serves W4A8C8 with "
                "--enable-expert-parallel over a top-level index ernie-ir does not write; use --quant "
                "wint2 or wint8mix")
    if cell.moe and cell.preset == "wint8mix-erniekit":
        return ("wint8mix-erniekit keeps the shared experts bf16, and FastDeploy quantizes every dense "
                "linear of a quantized model, shared experts included (layers/quantization/mix_quant.py, "
                "dense_quant_type); use --quant wint8mix")
    if cell.moe and cell.preset in WEIGHT_ONLY and cell.tp > 1:
        return f"weight-only MoE experts at --tp {cell.tp}: {PER_RANK}"
    return None

