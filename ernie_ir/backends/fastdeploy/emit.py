"""`--emit fastdeploy`: the writer that makes an artifact a FastDeploy checkpoint, and its launch line.

The compile driver asks `fastdeploy_refusal_for` before any pass runs whether FastDeploy can
load what this compile would write (`formats.fastdeploy.loadable`: preset x layout x model),
and `fastdeploy_emitters` once the rank graphs are made (`targets.executables.select_emitters`;
the target offers the executable: `"fastdeploy" in target.executables`, cuda). The files are
FastDeploy's formats (`ernie_ir.formats.fastdeploy`):

- pre-quantized (dense models; WINT2 MoE): config.json with `quantization_config`, the
  tokenizer files, `rank{r}/model.safetensors` linking the rank bytes, at tp 1 also the
  top-level `model.safetensors`;
- bf16 on our grid (weight-only MoE experts, which FastDeploy loads only by quantizing a bf16
  folder itself): config.json with `is_quantized: false` and a top-level `model.safetensors`.

Every form also gets `serve.sh` at the top (`formats.fastdeploy.serve_script`): FastDeploy's
api_server command for the folder, with the tp, the limits `plan` models and the ports
(`--load-choices default` at tp 1, with the reason); the manifest hashes it like every file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ernie_ir.formats.fastdeploy import (
    PER_RANK,
    SCRIPT,
    FastDeployError,
    LoadableCell,
    fastdeploy_refusal,
    is_ernie45,
    needs_on_grid,
    quantization_config,
    serve_script,
    source_config,
    write_fastdeploy,
    write_on_grid,
)
from ernie_ir.ir import Graph
from ernie_ir.ir.mapping import Mapping
from ernie_ir.ops.cuda_layout import DEFAULT_CUDA_ARCH

NOT_A_CHECKPOINT = "not a FastDeploy checkpoint: "
"""How the warning starts that says why an artifact got no FastDeploy files."""


def fastdeploy_refusal_for(graph: Graph, cell: LoadableCell) -> str | None:
    """Why FastDeploy could not load the folder a compile of `graph` would write (`cell`: the
    preset and layout asked for; its `moe` is read from the graph here); None where it can, or
    where the graph is not ERNIE 4.5 (decided with the rank graphs)."""
    if not is_ernie45(graph):
        return None
    moe = int((graph.metadata.get("config") or {}).get("moe_num_experts") or 0) > 0
    return fastdeploy_refusal(LoadableCell(cell.preset, moe, cell.tp, cell.ep, cell.lora_unmerged))


Emitter = Callable[[Graph, Path], Any]


def fastdeploy_emitters(mode: str, model: str, ranks: Sequence[Graph], mapping: Mapping, arch: int | None,
                        warnings: list[str], *, explicit: bool = True) -> dict[str, Emitter]:
    """The FastDeploy writer for an inference artifact of ERNIE 4.5 (other models, modes and meta
    graphs: none), for a target the caller has found to offer it; a warning (`NOT_A_CHECKPOINT` +
    why) says why an ERNIE 4.5 artifact with weights gets none. The bf16 form (a second copy of
    the model, 2 bytes a weight) is written only when asked for (`explicit`: --emit fastdeploy)."""
    if mode != "inference" or not ranks or not is_ernie45(ranks[0]):
        return {}
    if any(p.source is None for g in ranks for p in g.params.values()):
        return {}
    try:
        quant = quantization_config(ranks, mapping)
        on_grid = needs_on_grid(ranks[0], quant)
        if on_grid and len(ranks) > 1:
            raise FastDeployError(f"weight-only MoE experts at --tp {len(ranks)}: {PER_RANK}")
    except FastDeployError as e:
        warnings.append(f"{NOT_A_CHECKPOINT}{e}")
        return {}
    if on_grid and not explicit:
        size = _size(_bf16_bytes(ranks[0]))
        warnings.append(f"{NOT_A_CHECKPOINT}FastDeploy loads weight-only MoE experts only from a bf16 "
                        f"folder it quantizes at load ({size} for this model, beside the rank weights): add "
                        "fastdeploy to --emit to write one")
        return {}
    config = source_config(model, ranks[0])
    folder = Path(model) if Path(model).is_dir() else None
    cuda_arch = arch if arch is not None else DEFAULT_CUDA_ARCH

    def emit(_graph: Graph, exe: Path) -> None:
        _write_serve_script(exe.parent, len(ranks))
        if not on_grid:
            write_fastdeploy(exe.parent, ranks, config, quant, cuda_arch, folder)
            return
        _, back = write_on_grid(exe.parent, ranks, config, quant, cuda_arch, folder)
        for kind, got in back.items():
            if got["scales"] < 1 or got["codes_gpu"] < 1:
                warnings.append(f"FastDeploy's load-time quantization gives back {got['scales']:.4%} of the "
                                f"{kind} scales and {got['codes_gpu']:.4%} of the codes of this bf16 folder "
                                "(scales that no bf16 absmax maps to: not an absmax quantization)")

    return {"fastdeploy": emit}


def _write_serve_script(root: Path, tp: int) -> None:
    """serve.sh at the top of the folder, executable wherever it is readable (the user's umask
    already applied to the read bits)."""
    path = root / SCRIPT
    path.write_text(serve_script(tp), encoding="utf-8")
    mode = path.stat().st_mode
    path.chmod(mode | (mode & 0o444) >> 2)


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _bf16_bytes(graph: Graph) -> int:
    """The size of the bf16 form of `graph`: 2 bytes a quantized weight, the rest as stored."""
    total = 0
    for name, p in graph.params.items():
        layout = p.annotations.get("cuda_layout")
        if name.endswith(".quant_weight") and layout is not None:
            total += 2 * int(layout["logical"][0]) * int(layout["logical"][1])
        elif not name.endswith(".weight_scale"):
            total += p.type.nbytes()
    return total
