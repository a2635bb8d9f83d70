"""`--emit fastdeploy`: the writer that makes an artifact a FastDeploy checkpoint, and its launch line.

The compile driver (`targets.executables.select_emitters`) decides that the target offers the
executable (`"fastdeploy" in target.executables`: cuda) and hands this entry plain values: the
mode, the MODEL string, the rank graphs, the layout and the cuda arch. The files are FastDeploy's
format (`ernie_ir.formats.fastdeploy`: config.json with `quantization_config`, the tokenizer
files, `rank{r}/model.safetensors` linking the rank bytes; at tp 1 also the top-level
`model.safetensors`); FastDeploy serves the folder with

    python -m fastdeploy.entrypoints.openai.api_server --model ARTIFACT --tensor-parallel-size N

and at tp 1 with `--load-choices default` too (`formats.fastdeploy.SERVE_TP1` says why).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ernie_ir.formats.fastdeploy import (
    FastDeployError,
    is_ernie45,
    quantization_config,
    source_config,
    write_fastdeploy,
)
from ernie_ir.ir import Graph
from ernie_ir.ir.mapping import Mapping
from ernie_ir.ops.cuda_layout import DEFAULT_CUDA_ARCH

NOT_A_CHECKPOINT = "not a FastDeploy checkpoint: "
"""How the warning starts that says why an artifact got no FastDeploy files."""


def fastdeploy_emitters(mode: str, model: str, ranks: Sequence[Graph], mapping: Mapping, arch: int | None,
                        warnings: list[str]) -> dict[str, Callable[[Graph, Path], Any]]:
    """The FastDeploy writer for an inference artifact of ERNIE 4.5 (other models, modes and meta
    graphs: none), for a target the caller has found to offer it; a warning (`NOT_A_CHECKPOINT` +
    why) says why an ERNIE 4.5 artifact with weights gets none."""
    if mode != "inference" or not ranks or not is_ernie45(ranks[0]):
        return {}
    if any(p.source is None for g in ranks for p in g.params.values()):
        return {}
    try:
        quant = quantization_config(ranks, mapping)
    except FastDeployError as e:
        warnings.append(f"{NOT_A_CHECKPOINT}{e}")
        return {}
    config = source_config(model, ranks[0])
    folder = Path(model) if Path(model).is_dir() else None
    cuda_arch = arch if arch is not None else DEFAULT_CUDA_ARCH

    def emit(_graph: Graph, exe: Path) -> None:
        write_fastdeploy(exe.parent, ranks, config, quant, cuda_arch, folder)

    return {"fastdeploy": emit}
