"""cuda's legalization rules: weight-only weights packed in Paddle's arch layout (--cuda-arch).

- dense: the weight is re-laid out (`PackedSource`: the bytes of `paddle.nn.quant.weight_quantize`
  for the arch) and the node becomes `weight_only_linear_packed`; a shape the arch layout cannot
  hold, or a weight that is not a param, is decomposed into dequantize + linear.
- experts: one packed param per expert (`<...>.experts.<e>.<proj>.quant_weight`) read back by
  `unpack_weight` + `stack` in front of the portable dequantize + moe_experts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_ir.ir import DType, GraphBuilder, Node, Param, TensorType
from ernie_ir.ir.weights import ArraySource, WeightSource

from ..legalize import LAYOUT_KEY, ExpertSource, expert_name
from ..rules import LegalizationRules, Legalizing
from .packing import pack, packable, packed_shape


class PackedSource(ExpertSource):
    """Paddle's CUDA bytes of the logical ints in `base` ([K, N], or expert `expert` of [E, K, N])."""

    def __init__(self, base: WeightSource, bits: int, arch: int, expert: int | None = None,
                 memo: dict[str, Any] | None = None) -> None:
        self.base, self.bits, self.arch, self.expert = base, bits, arch, expert
        self.memo = memo if memo is not None else {}
        k, n = base.shape[-2], base.shape[-1]
        self.k, self.n = k, n
        self.dtype = DType.I8
        self.shape = packed_shape(k, n, bits)

    def read(self) -> np.ndarray:
        return pack(self._logical().astype(np.int8), self.bits, self.arch)

    def describe(self) -> str:
        which = f"[{self.expert}]" if self.expert is not None else ""
        return f"cuda_pack<sm{self.arch}, int{self.bits}>({self.base.describe()}{which})"


class CudaRules(LegalizationRules):
    """Paddle's CUTLASS weight-only kernels, which read the arch-permuted layout."""

    def dense(self, lz: Legalizing, node: Node, bits: int, kernel: str) -> None:
        q = node.inputs[1]
        assert q is not None and lz.arch is not None
        k, n = q.shape
        assert isinstance(k, int) and isinstance(n, int)
        why = packable(k, n, bits, lz.arch)
        if why is not None or not isinstance(q, Param):
            lz.decompose(node, f"no sm{lz.arch} layout for [{k}, {n}]: {why}")
            return
        packed = self.packed_param(lz, q, bits)
        g = GraphBuilder(lz.graph)
        g.insert_point = node
        x, s = node.inputs[0], node.inputs[2]
        bias = node.inputs[3] if len(node.inputs) > 3 else None
        with g.at_scope(node.scope):
            y = g.weight_only_linear_packed(x, packed, s, bias, arch=lz.arch, bits=bits,
                                            in_features=k, group_size=node.attrs.group_size)
        lz.replace(node, y)
        lz.swap_param(q, packed)
        lz.use(y.producer, f"weight_only_linear(sm{lz.arch}, int{bits})")

    @staticmethod
    def packed_param(lz: Legalizing, q: Param, bits: int) -> Param:
        p = lz.packed.get(q.name)
        if p is None:
            assert lz.arch is not None
            k, n = q.shape
            src = PackedSource(q.source, bits, lz.arch) if q.source is not None else None
            ann = {**q.annotations, LAYOUT_KEY: {"arch": lz.arch, "bits": bits, "logical": [k, n]}}
            p = lz.packed[q.name] = Param(q.name, TensorType(DType.I8, packed_shape(k, n, bits)), src,
                                          annotations=ann)
        return p

    def experts(self, lz: Legalizing, node: Node, q: Any, s: Any, bits: int, kernel: str) -> None:
        assert lz.arch is not None
        e, k, n = q.shape
        assert isinstance(e, int) and isinstance(k, int) and isinstance(n, int)
        why = packable(k, n, bits, lz.arch)
        if why is not None or not isinstance(q, Param) or not isinstance(s, Param):
            lz.fallback(node, f"dequantize(int{bits}) + moe_experts (portable)",
                        f"no sm{lz.arch} layout for expert [{k}, {n}]: {why}")
            return
        memo: dict[str, Any] = {}
        packed: list[Param] = []
        scales: list[Param] = []
        s_all = np.asarray(s.read()) if s.source is not None else None
        for i in range(e):
            src = (PackedSource(q.source, bits, lz.arch, expert=i, memo=memo)
                   if q.source is not None else None)
            ann = {**q.annotations, LAYOUT_KEY: {"arch": lz.arch, "bits": bits, "logical": [k, n]}}
            packed.append(lz.placer.add(q.name, Param(expert_name(q.name, i),
                                                      TensorType(DType.I8, packed_shape(k, n, bits)),
                                                      src, annotations=ann)))
            ssrc = ArraySource(np.ascontiguousarray(s_all[i])) if s_all is not None else None
            scales.append(lz.placer.add(s.name, Param(expert_name(s.name, i),
                                                      TensorType(s.dtype, s.shape[1:]), ssrc)))
        g = GraphBuilder(lz.graph)
        g.insert_point = node
        with g.at_scope(node.scope):
            uq = g.unpack_weight(*packed, arch=lz.arch, bits=bits, in_features=k, stacked=True)
            us = g.stack(*scales)
        node.set_input(0, uq)
        node.set_input(1, us)
        lz.removed.update({q.name, s.name})
        lz.use(node, f"{kernel}(sm{lz.arch}, int{bits})")


RULES = CudaRules()
