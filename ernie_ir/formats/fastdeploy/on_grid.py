"""FastDeploy's bf16 form of a weight-only quantized MoE model: a checkpoint FastDeploy
quantizes at load, whose values sit on our quantization grid so that its quantization gives
back our codes and scales.

FastDeploy has no load path for pre-quantized weight-only experts (`models/ernie4_5_moe.py`:
for wint8 / wint4 the experts' key map has no scale key), so the only route it offers a MoE
model quantized weight-only is a whole bf16 folder, `is_quantized: false`, that it quantizes
at load (`layers/quantization/weight_only.py`, `layers/moe/fused_moe_cutlass_backend.py`:
Paddle's `weight_quantize`, per output channel, absmax / bound). The folder:

    config.json        the source config in FastDeploy's Paddle form, `quantization_config`
                       {quantization (wint8 | wint4 | mix_quant + both types), is_quantized: false}
                       and `ernie_ir` {format: "fastdeploy-bf16-on-grid", cuda_arch,
                       tensor_parallel_size: 1, load_time_quantization: what it gives back}
    rank0/model.safetensors  every quantized weight as `<layer>.weight` bf16 [in, out] on the grid
                       of its code and scale (`ops.quant_numerics.grid_weight`), the rest as the
                       rank stores it
    model.safetensors  a relative symlink to rank0/model.safetensors: one rank folder is not
                       pre-sharded to FastDeploy, which reads the top level
    tokenizer files    copied from the source folder

What FastDeploy's load-time quantization gives back is computed while the folder is written, on
the bytes written, and recorded in config.json: the scales and the codes as Paddle's GPU kernel
makes them (the one FastDeploy runs; every scale and code of an absmax quantization, int8 and
int4, by construction: `grid_weight`) and as its CPU kernel does (bit for bit: all int4 codes,
all but a few int8 codes above 64 in magnitude, which move by one).

One rank only: FastDeploy splits and quantizes a bf16 folder per tensor-parallel rank, so a
row-parallel layer's scales (ours: over its whole input axis) would not come back
(`loadable.fastdeploy_refusal` refuses --tp N here).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.formats.fastdeploy.checkpoint import (
    _EXPERT,
    CONFIG,
    FD_WEIGHTS,
    FastDeployError,
    copy_tokenizer_files,
    paddle_form,
)
from ernie_ir.ir import DType, Graph, Param
from ernie_ir.ir.weights import WeightSource, write_safetensors
from ernie_ir.ops.cuda_layout import unpack
from ernie_ir.ops.quant_numerics import gpu_weight_codes, grid_weight, weight_quantize

FORMAT = "fastdeploy-bf16-on-grid"
"""`config.json`'s `ernie_ir.format` for this form (the pre-quantized one is
"fastdeploy-prequantized")."""
WEIGHT_ONLY = ("wint8", "wint4")


def needs_on_grid(graph: Graph, quant: dict[str, Any]) -> bool:
    """Whether FastDeploy reads these weights only in the bf16 form: a weight-only
    `quantization_config` (wint8, wint4, or mix_quant of those) over routed experts that are
    quantized weight-only."""
    kind = quant.get("quantization")
    moe = quant.get("moe_quant_type", kind)
    if kind not in (*WEIGHT_ONLY, "mix_quant") or moe not in WEIGHT_ONLY:
        return False
    return any(_EXPERT.match(n) and n.endswith(".quant_weight") for n in graph.params)


def on_grid_quantization(quant: dict[str, Any]) -> dict[str, Any]:
    """The `quantization_config` of the bf16 form: the same types, `is_quantized: false`
    (FastDeploy quantizes at load; `is_permuted` does not apply to bf16 weights)."""
    out = {k: v for k, v in quant.items() if k not in ("is_quantized", "is_permuted")}
    out["is_quantized"] = False
    return out


class Recovery:
    """What FastDeploy's load-time quantization gives back of our codes and scales, counted per
    bit width as the weights are written (the writer reads ahead on another thread): the scales
    (Paddle's GPU and CPU kernels store the same bf16 scale), the codes as Paddle's GPU kernel
    makes them (`gpu_weight_codes`, the kernel FastDeploy runs) and as its CPU kernel does
    (`weight_quantize`, bit for bit)."""

    def __init__(self) -> None:
        # bits -> [codes, gpu equal, cpu equal, channels, scales equal]
        self.counts: dict[int, np.ndarray] = {}
        self.lock = threading.Lock()

    def add(self, bits: int, q: np.ndarray, scale: np.ndarray, grid: np.ndarray) -> None:
        cpu_q, back_s = weight_quantize(grid, bits)
        gpu_q = gpu_weight_codes(grid, bits)
        same_scale = back_s.astype(np.float32) == np.asarray(scale).astype(np.float32)
        row = np.array([q.size, np.count_nonzero(gpu_q == q), np.count_nonzero(cpu_q == q),
                        same_scale.size, np.count_nonzero(same_scale)], np.int64)
        with self.lock:
            self.counts[bits] = self.counts.get(bits, np.zeros(5, np.int64)) + row

    def report(self) -> dict[str, Any]:
        """{"int8": {"scales", "codes_gpu", "codes_cpu": shares, "codes", "channels": counts}, ...}."""
        out: dict[str, Any] = {}
        for bits, (codes, gpu, cpu, channels, scales) in sorted(self.counts.items(), reverse=True):
            out[f"int{bits}"] = {"scales": _share(scales, channels), "codes_gpu": _share(gpu, codes),
                                 "codes_cpu": _share(cpu, codes), "codes": int(codes),
                                 "channels": int(channels)}
        return out


def _share(part: int, whole: int) -> float:
    return round(float(part) / whole, 9) if whole else 1.0


class GridSource(WeightSource):
    """A packed weight-only param and its scale, read as the bf16 weight on their grid
    [in, out] (`grid_weight`); what FastDeploy's quantization gives back of it is added to
    `recovery`."""

    def __init__(self, packed: Param, scale: Param, recovery: Recovery) -> None:
        layout = packed.annotations["cuda_layout"]
        self.packed, self.scale, self.recovery = packed, scale, recovery
        self.bits, self.arch = int(layout["bits"]), int(layout["arch"])
        k, n = (int(d) for d in layout["logical"])
        self.dtype, self.shape = DType.BF16, (k, n)

    def read(self) -> np.ndarray:
        assert self.packed.source is not None and self.scale.source is not None
        k, n = self.shape
        q = unpack(np.asarray(self.packed.source.read()), k, n, self.bits, self.arch)
        scale = np.asarray(self.scale.source.read())
        grid = grid_weight(q, scale, self.bits)
        self.recovery.add(self.bits, q, scale, grid)
        return grid

    def describe(self) -> str:
        return f"{self.packed.name} x {self.scale.name} on their bf16 grid"


def on_grid_tensors(graph: Graph, recovery: Recovery) -> list[tuple[str, WeightSource]]:
    """(key, source) of the bf16 form: each `<layer>.quant_weight` (with its `weight_scale`) as
    `<layer>.weight` on its grid, every other param as stored. FastDeployError for a weight that
    is not in Paddle's packed cuda layout (checked before, by `quantization_config`)."""
    out: list[tuple[str, WeightSource]] = []
    for name, p in graph.params.items():
        if name.endswith(".weight_scale"):
            continue
        assert p.source is not None
        if not name.endswith(".quant_weight"):
            out.append((name, p.source))
            continue
        prefix = name[: -len(".quant_weight")]
        scale = graph.params.get(prefix + ".weight_scale")
        if scale is None or "cuda_layout" not in p.annotations:
            raise FastDeployError(f"{name} has no weight_scale or no packed cuda layout: not a weight-only "
                                  "quantized weight FastDeploy can quantize back")
        out.append((prefix + ".weight", GridSource(p, scale, recovery)))
    return out


def write_on_grid(root: Path, ranks: Sequence[Graph], config: dict[str, Any], quant: dict[str, Any],
                  arch: int, source_folder: Path | None = None) -> tuple[list[str], dict[str, Any]]:
    """Write the bf16 form into the artifact folder `root`: config.json, model.safetensors and
    the tokenizer files. Returns (the files written, what FastDeploy's load-time quantization
    gives back: `Recovery.report`)."""
    if len(ranks) != 1:
        raise FastDeployError(f"{len(ranks)} ranks: FastDeploy quantizes a bf16 folder per rank at load, "
                              "which does not give back a row-parallel layer's scales (compile with --tp 1)")
    recovery = Recovery()
    # rank0/model.safetensors is what FastDeploy reads for rank 0 in every form; with one rank folder
    # it reads the top level, which links to it (as the pre-quantized tp 1 form does)
    write_safetensors(root / "rank0" / FD_WEIGHTS, on_grid_tensors(ranks[0], recovery), require_finite=True)
    os.symlink(f"rank0/{FD_WEIGHTS}", root / FD_WEIGHTS)
    cfg = {k: v for k, v in paddle_form(config).items() if k != "quantization_config"}
    cfg["quantization_config"] = on_grid_quantization(quant)
    cfg["ernie_ir"] = {"format": FORMAT, "cuda_arch": arch, "tensor_parallel_size": 1,
                       "load_time_quantization": recovery.report()}
    (root / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    return [CONFIG, f"rank0/{FD_WEIGHTS}", FD_WEIGHTS, *copy_tokenizer_files(source_folder, root)], \
        recovery.report()
