"""The legalization passes `legalize-cuda`, `legalize-ascend`, `legalize-kunlun`.

Registered through the entry-point group `ernie_ir.passes` (pyproject.toml:
`targets = "ernie_ir.targets.passes"`) and, when this module is imported,
directly: the pass layer never imports targets.
"""

from __future__ import annotations

from pydantic import field_validator

from ernie_ir.ir import Graph
from ernie_ir.passes.base import Pass, PassContext, PassOptions
from ernie_ir.passes.registry import register_pass

from .ascend import ASCEND
from .cuda import CUDA
from .cuda.packing import CUDA_ARCHS, DEFAULT_CUDA_ARCH
from .kunlun import KUNLUN
from .legalize import legalize


class CudaOptions(PassOptions):
    cuda_arch: int = DEFAULT_CUDA_ARCH
    """SM version the weights are laid out for (70, 75, 80, 86, 89, 90)."""

    @field_validator("cuda_arch")
    @classmethod
    def _arch(cls, v: int) -> int:
        if v not in CUDA_ARCHS:
            raise ValueError(f"must be one of {', '.join(map(str, CUDA_ARCHS))}")
        return v


@register_pass
class LegalizeCuda(Pass):
    """Lower to Paddle's CUDA kernels; weight-only weights packed in the --cuda-arch layout."""

    name = "legalize-cuda"
    description = "Choose CUDA kernels per node, pack weight-only weights for cuda_arch, record the plan."
    Options = CudaOptions
    produces = frozenset({"lowered:cuda"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        assert isinstance(self.options, CudaOptions)
        return legalize(graph, CUDA, self.options.cuda_arch)


@register_pass
class LegalizeAscend(Pass):
    """Lower to Ascend (npu) kernels: int8 per-channel weight-only; int4 dense decomposed."""

    name = "legalize-ascend"
    description = "Choose Ascend kernels per node, decompose what it lacks, refuse FP8, record the plan."
    produces = frozenset({"lowered:ascend"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        return legalize(graph, ASCEND)


@register_pass
class LegalizeKunlun(Pass):
    """Lower to Kunlun (xpu) kernels: int8 per-channel weight-only; int4 dense decomposed."""

    name = "legalize-kunlun"
    description = "Choose Kunlun XPU kernels per node, decompose what it lacks, refuse FP8, record the plan."
    produces = frozenset({"lowered:kunlun"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        return legalize(graph, KUNLUN)
