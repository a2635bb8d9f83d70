"""cuda's legalization rules: weight-only weights packed in Paddle's arch layout (--cuda-arch).

- dense: the weight is re-laid out (`PackedSource`: the bytes of `paddle.nn.quant.weight_quantize`
  for the arch) and the node becomes `weight_only_linear_packed`; a shape the arch layout cannot
  hold, or a weight that is not a param, is decomposed into dequantize + linear.
- experts: one packed param per expert (`<...>.experts.<e>.<proj>.quant_weight`) read back by
  `unpack_weight` + `stack` in front of the portable dequantize + moe_experts.
- W4A8 experts (`moe_experts_w4a8`) and 2-bit experts (`wint2_dequantize` into `moe_experts`):
  one param per expert and key, as FastDeploy's W4A8 / WINT2 checkpoints hold them (docs/
  quantization.md 4.5), stacked back in front of the op.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_ir.ir import DType, GraphBuilder, Node, Param, TensorType, Value
from ernie_ir.ir.weights import ArraySource, WeightSource
from ernie_ir.ops.fastdeploy_experts import pack_int4_rows
from ernie_ir.targets.cuda.packing import pack, packable, packed_shape
from ernie_ir.targets.legalize import FASTDEPLOY_KEY, LAYOUT_KEY, ExpertSource, expert_name
from ernie_ir.targets.rules import LegalizationRules, Legalizing


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


class FastDeployExpertSource(ExpertSource):
    """Expert `expert` of a stacked [E, ...] base, in FastDeploy's per-expert form (`form`):
    "int4_rows" int4 values [K, N] -> int8 [K/2, N] (two per byte along K); "div16" a float
    [N] / 16 (FastDeploy's W4A8 weight_scale; refused where not exact); "scalar" one float32
    (an input scale); "slice" the expert's slice as it is."""

    def __init__(self, base: WeightSource, expert: int, form: str, memo: dict[str, Any], name: str) -> None:
        self.base, self.expert, self.form, self.memo, self.name = base, expert, form, memo, name
        rest = tuple(base.shape[1:])
        if form == "int4_rows":
            self.dtype, self.shape = DType.I8, (rest[0] // 2, rest[1])
        elif form == "scalar":
            self.dtype, self.shape = DType.F32, ()
        else:
            self.dtype, self.shape = base.dtype, rest

    def read(self) -> np.ndarray:
        a = self._logical()
        if self.form == "int4_rows":
            return pack_int4_rows(np.asarray(a).astype(np.int8))
        if self.form == "scalar":
            return np.asarray(a, dtype=np.float32).reshape(())
        if self.form == "div16":
            wide = np.asarray(a).astype(np.float32)
            out = (wide / np.float32(16)).astype(a.dtype)
            if not np.array_equal(out.astype(np.float32) * np.float32(16), wide):
                raise ValueError(f"{self.name}: a W4A8 weight scale / 16 is not exact in {a.dtype} "
                                 "(a subnormal scale): FastDeploy's in-memory scale would lose it")
            return out
        return a

    def describe(self) -> str:
        return f"fastdeploy<{self.form}>({self.base.describe()}[{self.expert}])"


W4A8_FORMS = {"quant_weight": "int4_rows", "weight_scale": "div16", "in_scale": "scalar"}
W4A8_KEYS = {"quant_weight": "quant_weight", "weight_scale": "weight_scale", "in_scale": "activation_scale"}
"""The stacked W4A8 params (ernie_ir/passes/quant/w4a8.py) -> FastDeploy's per-expert forms and keys."""


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


    def w4a8_experts(self, lz: Legalizing, node: Node) -> None:
        """W4A8 experts as FastDeploy's pre-quantized checkpoint keys, one per expert:
        `<...>.experts.<e>.<proj>.quant_weight` int8 [K/2, N] (two int4 per byte along K),
        `.weight_scale` [N] (FastDeploy's in-memory scale: ours / 16) and `.activation_scale` f32
        scalar (FastDeploy's in-memory input scale, 1 / abs-max); read back into the op's stacked
        inputs by unpack_int4_rows, stack_scaled{factor=16} and stack."""
        params = node.inputs[3:9]
        ins: list[Any] = []
        for p in params:
            assert isinstance(p, Param)
            leaf = p.name.rsplit(".", 1)[1]
            form = W4A8_FORMS.get(leaf)
            if form is None:
                lz.use(node, "moe_experts_w4a8(logical [E, K, N]: unknown params)")
                return
            e = p.type.shape[0]
            assert isinstance(e, int)
            if form == "int4_rows" and p.type.shape[1] % 2:  # type: ignore[operator]
                lz.use(node, f"moe_experts_w4a8(logical: K = {p.type.shape[1]} is odd)")
                return
            ins.append((p, form, leaf, e))
        new_inputs: list[Any] = []
        for p, form, leaf, e in ins:
            memo: dict[str, Any] = {}
            head = p.name[: -len(leaf)] + W4A8_KEYS[leaf]
            parts = []
            for i in range(e):
                src = (FastDeployExpertSource(p.source, i, form, memo, p.name)
                       if p.source is not None else None)
                name = expert_name(head, i)
                if form == "int4_rows":
                    k, n = p.type.shape[1:]
                    t = TensorType(DType.I8, (k // 2, n))
                    ann = {FASTDEPLOY_KEY: {"format": "w4a8", "logical": [k, n]}}
                elif form == "scalar":
                    t, ann = TensorType(DType.F32, ()), {}
                else:
                    t, ann = TensorType(p.type.dtype, p.type.shape[1:]), {}
                parts.append(lz.placer.add(p.name, Param(name, t, src, annotations=ann)))
            new_inputs.append((form, parts))
            lz.removed.add(p.name)
        g = GraphBuilder(lz.graph)
        g.insert_point = node
        with g.at_scope(node.scope):
            for slot, (form, parts) in enumerate(new_inputs, start=3):
                if form == "int4_rows":
                    v = g.unpack_int4_rows(*parts)
                elif form == "div16":
                    v = g.stack_scaled(*parts, factor=16.0)
                else:
                    v = g.stack(*parts)
                node.set_input(slot, v)
        lz.use(node, "moe_expert_ffn(w4a8, FastDeploy per-expert keys)")

    def wint2_experts(self, lz: Legalizing, node: Node) -> None:
        """2-bit experts as FastDeploy's WINT2 checkpoint keys, one per expert (`<...>.experts.<e>.
        <proj>.quant_weight` u8 [K/4, N], `.weight_scale` u8 [K/128, N], `.super_scales` [N],
        `.code_scale` / `.code_zp` f32 [N]), stacked back in front of the decode."""
        stacks: list[Value] = []
        for p in node.inputs:
            assert isinstance(p, Param)
            e = p.type.shape[0]
            assert isinstance(e, int)
            memo: dict[str, Any] = {}
            parts = []
            for i in range(e):
                src = (FastDeployExpertSource(p.source, i, "slice", memo, p.name)
                       if p.source is not None else None)
                ann: dict[str, Any] = {}
                if p.name.endswith(".quant_weight"):
                    rows, n = p.type.shape[1:]
                    ann = {FASTDEPLOY_KEY: {"format": "wint2", "logical": [4 * rows, n]}}  # type: ignore[operator]
                parts.append(lz.placer.add(p.name, Param(expert_name(p.name, i),
                                                         TensorType(p.type.dtype, p.type.shape[1:]), src,
                                                         annotations=ann)))
            lz.removed.add(p.name)
            g = GraphBuilder(lz.graph)
            g.insert_point = node
            with g.at_scope(node.scope):
                stacks.append(g.stack(*parts))
        for i, v in enumerate(stacks):
            node.set_input(i, v)
        lz.use(node, "moe_expert_ffn(wint2, FastDeploy per-expert keys)")


RULES = CudaRules()
