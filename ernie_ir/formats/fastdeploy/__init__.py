"""FastDeploy's checkpoint formats, written and read back (REFERENCE.md section 8).

- `checkpoint`: the pre-quantized, pre-sharded folder (config.json in FastDeploy's Paddle form
  with `quantization_config`, `rank{r}/model.safetensors` linking the rank bytes), the reader,
  and the published float checkpoint of a graph;
- `on_grid`: the bf16 folder FastDeploy quantizes at load back to our codes (weight-only MoE
  experts, which FastDeploy cannot load pre-quantized);
- `loadable`: which presets, layouts and models FastDeploy loads, and the refusal for the rest,
  from FastDeploy's loader source;
- `serve`: the api_server command that serves a folder, serve.sh, the `fastdeploy.LLM` call.
"""

from ernie_ir.formats.fastdeploy.checkpoint import (
    ARCHITECTURES,
    CONFIG,
    FASTDEPLOY_HADAMARD_BLOCK,
    FASTDEPLOY_KEY,
    FD_WEIGHTS,
    SERVE_TP1,
    TOKENIZER_FILES,
    TORCH_FORMAT_AFTER,
    WINT2_SUFFIXES,
    FastDeployCheckpoint,
    FastDeployError,
    copy_tokenizer_files,
    is_ernie45,
    load_fastdeploy_checkpoint,
    merge_ranks,
    paddle_form,
    published_tensors,
    quantization_config,
    rank_folders,
    source_config,
    write_checkpoint_files,
    write_fastdeploy,
    write_float_checkpoint,
)
from ernie_ir.formats.fastdeploy.loadable import PER_RANK, LoadableCell, fastdeploy_refusal
from ernie_ir.formats.fastdeploy.on_grid import needs_on_grid, on_grid_quantization, write_on_grid
from ernie_ir.formats.fastdeploy.serve import SCRIPT, ServeLimits, llm_call, serve_command, serve_script

__all__ = [
    "ARCHITECTURES",
    "CONFIG",
    "FASTDEPLOY_HADAMARD_BLOCK",
    "FASTDEPLOY_KEY",
    "FD_WEIGHTS",
    "PER_RANK",
    "SCRIPT",
    "SERVE_TP1",
    "TOKENIZER_FILES",
    "TORCH_FORMAT_AFTER",
    "WINT2_SUFFIXES",
    "FastDeployCheckpoint",
    "FastDeployError",
    "LoadableCell",
    "ServeLimits",
    "copy_tokenizer_files",
    "fastdeploy_refusal",
    "is_ernie45",
    "llm_call",
    "load_fastdeploy_checkpoint",
    "merge_ranks",
    "needs_on_grid",
    "on_grid_quantization",
    "paddle_form",
    "published_tensors",
    "quantization_config",
    "rank_folders",
    "serve_command",
    "serve_script",
    "source_config",
    "write_checkpoint_files",
    "write_fastdeploy",
    "write_float_checkpoint",
    "write_on_grid",
]
