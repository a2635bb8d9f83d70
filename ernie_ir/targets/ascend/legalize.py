"""ascend's legalization rules: the NPU binding reads int8 [K, N] with scales in the activation
dtype, which is the logical layout; params are annotated `device_layout`, values unchanged."""

from __future__ import annotations

from ernie_ir.ir import Node, Param
from ernie_ir.targets.legalize import DEVICE_LAYOUT_KEY
from ernie_ir.targets.rules import LegalizationRules, Legalizing


class AscendRules(LegalizationRules):
    """PaddleCustomDevice's weight_only_linear_npu (aclnnWeightQuantBatchMatmulV2, ND format)."""

    def dense(self, lz: Legalizing, node: Node, bits: int, kernel: str) -> None:
        q, s = node.inputs[1], node.inputs[2]
        if isinstance(q, Param) and DEVICE_LAYOUT_KEY not in q.annotations:
            assert s is not None
            k, n = q.shape
            q.annotations = {**q.annotations, DEVICE_LAYOUT_KEY: {
                "layout": "npu", "shape": "[K, N]", "logical": [k, n], "scale_dtype": str(s.dtype)}}
        super().dense(lz, node, bits, kernel)


RULES = AscendRules()
