"""kunlun's legalization rules: int8 weights in the XPU kernels' layout, int8 [N, K] + float32 scales.

- dense int8: `<layer>.quant_weight` int8 [N, K] (the logical [K, N] transposed) and
  `<layer>.weight_scale` float32 [N]; the node becomes `weight_only_linear_xpu`
  (paddle/phi/kernels/xpu/weight_only_linear_kernel.cc).
- int8 experts: one such pair per expert (`unpack_weight_xpu` + `stack` in front of the portable
  dequantize + moe_experts), what FastDeploy's `moe_expert_ffn` takes once stacked; int4
  experts keep the logical layout (the XPU int4 packing is not confirmed).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_ir.ir import DType, GraphBuilder, Node, Param, TensorType
from ernie_ir.ir.weights import WeightSource
from ernie_ir.ops.xpu_layout import pack_xpu
from ernie_ir.targets.legalize import DEVICE_LAYOUT_KEY, ExpertSource, expert_name
from ernie_ir.targets.rules import LegalizationRules, Legalizing


class XpuSource(ExpertSource):
    """The XPU layout of `base`: int8 [K, N] -> [N, K], or float scales [N] -> float32.

    `expert` picks one expert of a stacked [E, ...] base (read once for all experts via `memo`).
    """

    def __init__(self, base: WeightSource, scale: bool, expert: int | None = None,
                 memo: dict[str, Any] | None = None) -> None:
        self.base, self.scale, self.expert = base, scale, expert
        self.memo = memo if memo is not None else {}
        shape = tuple(base.shape[1:] if expert is not None else base.shape)
        self.dtype = DType.F32 if scale else DType.I8
        self.shape = shape if scale else (shape[1], shape[0])

    def read(self) -> np.ndarray:
        arr = self._logical()
        return arr.astype(np.float32) if self.scale else pack_xpu(arr.astype(np.int8))

    def describe(self) -> str:
        which = f"[{self.expert}]" if self.expert is not None else ""
        what = "f32" if self.scale else "xpu_pack<int8 [N, K]>"
        return f"{what}({self.base.describe()}{which})"


def _xpu_layout(k: Any, n: Any) -> dict[str, Any]:
    return {"layout": "xpu", "shape": "[N, K]", "logical": [k, n], "scale_dtype": "f32"}


class KunlunRules(LegalizationRules):
    """Paddle's XPU weight-only kernel and FastDeploy's moe_expert_ffn: int8 [N, K], float32 scales."""

    def dense(self, lz: Legalizing, node: Node, bits: int, kernel: str) -> None:
        x, q, s = node.inputs[0], node.inputs[1], node.inputs[2]
        if bits != 8 or not isinstance(q, Param) or not isinstance(s, Param) or x is None:
            super().dense(lz, node, bits, kernel)
            return
        pq, ps = self.xpu_param(lz, q, scale=False), self.xpu_param(lz, s, scale=True)
        bias = node.inputs[3] if len(node.inputs) > 3 else None
        g = GraphBuilder(lz.graph)
        g.insert_point = node
        with g.at_scope(node.scope):
            y = g.weight_only_linear_xpu(x, pq, ps, bias)
        lz.replace(node, y)
        lz.swap_param(q, pq)
        lz.swap_param(s, ps)
        lz.use(y.producer, f"{kernel}(int8, [N, K], f32 scale)")

    @staticmethod
    def xpu_param(lz: Legalizing, p: Param, scale: bool) -> Param:
        new = lz.packed.get(p.name)
        if new is None:
            src = XpuSource(p.source, scale) if p.source is not None else None
            if scale:
                new = Param(p.name, TensorType(DType.F32, p.shape), src, annotations=dict(p.annotations))
            else:
                k, n = p.shape
                ann = {**p.annotations, DEVICE_LAYOUT_KEY: _xpu_layout(k, n)}
                new = Param(p.name, TensorType(DType.I8, (n, k)), src, annotations=ann)
            lz.packed[p.name] = new
        return new

    def experts(self, lz: Legalizing, node: Node, q: Any, s: Any, bits: int, kernel: str) -> None:
        if bits != 8 or not isinstance(q, Param) or not isinstance(s, Param):
            super().experts(lz, node, q, s, bits, kernel)  # int4: the logical layout
            return
        e, k, n = q.shape
        assert isinstance(e, int) and isinstance(k, int) and isinstance(n, int)
        qmemo: dict[str, Any] = {}
        smemo: dict[str, Any] = {}
        packed: list[Param] = []
        scales: list[Param] = []
        ann = {**q.annotations, DEVICE_LAYOUT_KEY: _xpu_layout(k, n)}
        for i in range(e):
            qsrc = XpuSource(q.source, False, expert=i, memo=qmemo) if q.source is not None else None
            ssrc = XpuSource(s.source, True, expert=i, memo=smemo) if s.source is not None else None
            packed.append(lz.placer.add(q.name, Param(expert_name(q.name, i), TensorType(DType.I8, (n, k)),
                                                      qsrc, annotations=dict(ann))))
            scales.append(lz.placer.add(s.name, Param(expert_name(s.name, i),
                                                      TensorType(DType.F32, s.shape[1:]), ssrc)))
        g = GraphBuilder(lz.graph)
        g.insert_point = node
        with g.at_scope(node.scope):
            uq = g.unpack_weight_xpu(*packed, stacked=True)
            us = g.stack(*scales)
        node.set_input(0, uq)
        node.set_input(1, us)
        lz.removed.update({q.name, s.name})
        lz.use(node, f"{kernel}(int8, [N, K] per expert, f32 scales)")


RULES = KunlunRules()
