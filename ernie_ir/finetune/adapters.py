"""A published LoRA training checkpoint, written again as a paddleformers adapter folder.

    training/checkpoints/run-K-step-N/adapter/
      lora_config.json  peft_model-00001-of-00001.safetensors  peft_model.safetensors.index.json
      config.json

`export_adapter(artifact, checkpoint)` reads the checkpoint's `params.safetensors` (trained
values at global names and shapes) and the artifact's rank-0 graph (the adapters, their rank and
scale; a rank graph of a tp split gives the global head counts with the artifact's tp), writes
the folder with `ernie_ir.formats.paddleformers_adapter.write_adapter` (the one writer of that
format: paddleformers' `LoRAModel.from_pretrained` loads it, `compile --lora-adapter` reads it),
then, under the artifact's lock, renames it into the checkpoint folder and lists its
files in the manifest, so `verify` keeps passing and a kill leaves either no `adapter/` or a
complete one (a temp folder of a dead process is removed by the next writer).

A checkpoint of a graph without LoRA (QAT only) has no adapter: `export_adapter` returns None.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ernie_ir.artifacts import artifact_lock, artifact_mapping, read_manifest, record_files, temp_name
from ernie_ir.artifacts.publish import CHECKPOINT_WAIT_S, clean_stale
from ernie_ir.formats.paddleformers_adapter import graph_adapters, write_adapter
from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.storage import load_graph
from ernie_ir.training.checkpoints import PARAMS

ADAPTER = "adapter"
"""The adapter folder's name inside a checkpoint folder."""


def export_adapter(artifact: Path, checkpoint: Path) -> Path | None:
    """Write `checkpoint/adapter/` (see the module docstring); returns it, or None when the
    artifact's graph has no LoRA. An existing `adapter/` is left as it is and returned."""
    root, folder = Path(artifact), Path(checkpoint)
    done = folder / ADAPTER
    if done.is_dir():
        return done
    graph = load_graph(root / "rank0")
    if not graph_adapters(graph):
        return None
    params_file = folder / PARAMS
    if not params_file.is_file():
        raise ErnieIRError(f"{folder} has no {PARAMS}: not a training checkpoint of this artifact")
    from safetensors.numpy import load_file

    manifest = read_manifest(root)
    params = load_file(str(params_file))
    config: Any = graph.metadata.get("config")
    stage = temp_name(folder, ADAPTER)
    try:
        write_adapter(stage, graph, params, tp=artifact_mapping(manifest).tp,
                      base_config=config if isinstance(config, dict) and config else None)
        with artifact_lock(root, wait_s=CHECKPOINT_WAIT_S, what="artifact"):
            clean_stale(folder)
            if not folder.is_dir():
                raise ErnieIRError(f"{folder} was removed while its adapter was written (--save-total-limit "
                                   "of another run?): nothing was recorded")
            os.rename(stage, done)
            try:
                record_files(root, sorted(p for p in done.iterdir() if p.is_file()))
            except BaseException:
                shutil.rmtree(done, ignore_errors=True)
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return done
