"""Legalization: rewrite a graph into what one target can run, and record the kernel plan.

Per node, with the target's capability table (`HardwareTarget`):

- `weight_only_linear` (dense): the target's weight-only kernel when it has
  one for the node's bits and group size (cuda: the weight is re-laid out in
  Paddle's arch layout and the node becomes `weight_only_linear_packed`);
  int4 where only int8 exists, or a cuda shape the arch layout cannot hold,
  is decomposed into `dequantize` + `linear` (the weight stays int4/int8 in
  storage); group-wise where only per-channel kernels exist is refused.
  kunlun: int8 weights become the XPU kernel's layout (`<layer>.quant_weight`
  int8 [N, K], `<layer>.weight_scale` float32 [N]) and the node becomes
  `weight_only_linear_xpu`; ascend: the NPU binding reads int8 [K, N] with
  scales in the activation dtype, which is the logical layout (params are
  annotated `device_layout`, values unchanged).
- integer `dequantize` feeding `moe_experts` (stacked expert weights): the
  target's fused MoE kernel when confirmed for those bits (cuda: one packed
  param per expert, `<...>.experts.<e>.<proj>.quant_weight`; kunlun int8: one
  [N, K] int8 + float32 scale pair per expert), else the
  portable dequantize + moe_experts, recorded as a fallback.
- FP8 (`fp8_linear`, `fake_quant_fp8`, fp8 `dequantize`): cuda with
  --cuda-arch 89/90 only; anything else is refused.

The plan (only the quantized nodes; every other node runs the portable
Paddle op of the same name) goes into `graph.metadata["kernel_plan"]`:
`{target, cuda_arch?, kernels: [{scope, op, kernel}], fallbacks: [{scope,
op, kernel, reason}]}`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_ir.ir import DType, Graph, GraphBuilder, Node, Param, TensorType
from ernie_ir.ir.weights import ArraySource, WeightSource
from ernie_ir.ops.xpu_layout import pack_xpu
from ernie_ir.passes.param_edit import ParamPlacer

from .capabilities import HardwareTarget
from .cuda import FP8_ARCHS
from .cuda.packing import pack, packable, packed_shape
from .registry import TargetError

PLAN_KEY = "kernel_plan"
LAYOUT_KEY = "cuda_layout"
DEVICE_LAYOUT_KEY = "device_layout"
_FP8 = (DType.F8E4M3, DType.F8E5M2)


class _ExpertSource(WeightSource):
    """A derived source over `base`, or over expert `expert` of a stacked [E, ...] base.

    The E sources of one stacked base share `memo`, so the base is read (and quantized)
    once for all its experts and released after the last one.
    """

    base: WeightSource
    expert: int | None
    memo: dict[str, Any]

    def _logical(self) -> np.ndarray:
        if self.expert is None:
            return np.asarray(self.base.read())
        arr = self.memo.get("array")
        if arr is None:
            arr = self.memo["array"] = np.asarray(self.base.read())
        self.memo["left"] = self.memo.get("left", arr.shape[0]) - 1
        out = np.ascontiguousarray(arr[self.expert])
        if self.memo["left"] <= 0:
            self.memo.clear()
        return out


class PackedSource(_ExpertSource):
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


class XpuSource(_ExpertSource):
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


def _bits(t: TensorType) -> int:
    return 8 if t.dtype == DType.I8 else 4


def expert_name(stacked: str, e: int) -> str:
    """`...mlp.experts.up_gate_proj.quant_weight` -> `...mlp.experts.<e>.up_gate_proj.quant_weight`."""
    if ".experts." in stacked:
        head, tail = stacked.split(".experts.", 1)
        return f"{head}.experts.{e}.{tail}"
    head, _, leaf = stacked.rpartition(".")
    return f"{head}.{e}.{leaf}" if head else f"{e}.{leaf}"


class Legalizer:
    def __init__(self, graph: Graph, target: HardwareTarget, cuda_arch: int | None = None) -> None:
        self.graph = graph
        self.target = target
        self.arch = cuda_arch
        self.kernels: list[dict[str, Any]] = []
        self.fallbacks: list[dict[str, Any]] = []
        self.placer = ParamPlacer(graph)
        self.removed: set[str] = set()
        self.packed: dict[str, Param] = {}

    # -- plan -----------------------------------------------------------------------------------

    def use(self, node: Node, kernel: str) -> None:
        self.kernels.append({"scope": node.scope, "op": node.op, "kernel": kernel})

    def fallback(self, node: Node, kernel: str, reason: str) -> None:
        self.kernels.append({"scope": node.scope, "op": node.op, "kernel": kernel})
        self.fallbacks.append({"scope": node.scope, "op": node.op, "kernel": kernel, "reason": reason})

    def refuse(self, node: Node, what: str, fix: str) -> TargetError:
        where = node.scope or node.op
        return TargetError(f"target {self.target.name} cannot run {what} (at {where}): {fix}")

    # -- main -----------------------------------------------------------------------------------

    def run(self) -> bool:
        self.check_fp8()
        for node in list(self.graph):
            if node.op == "weight_only_linear":
                self.dense(node)
            elif node.op == "dequantize" and node.inputs[0] is not None \
                    and node.inputs[0].dtype in (DType.I8, DType.I4):
                self.dequantize(node)
            elif node.op == "weight_only_linear_packed":
                self.use(node, f"weight_only_linear(sm{node.attrs.arch}, int{node.attrs.bits})")
        self.placer.finish(removed=self.removed)
        plan: dict[str, Any] = {"target": self.target.name}
        if self.arch is not None:
            plan["cuda_arch"] = self.arch
        plan["kernels"] = self.kernels
        plan["fallbacks"] = self.fallbacks
        self.graph.metadata[PLAN_KEY] = plan
        return True

    def check_fp8(self) -> None:
        for node in self.graph:
            fp8 = node.op in ("fp8_linear", "fake_quant_fp8") or any(
                v is not None and v.dtype in _FP8 for v in node.inputs)
            if not fp8:
                continue
            if not self.target.fp8:
                raise self.refuse(node, "FP8", "FP8 kernels exist on --target cuda with --cuda-arch 89 or "
                                  f"90 only; use --quant wint8 or wint8mix for {self.target.name}")
            if self.arch not in FP8_ARCHS:
                raise self.refuse(node, f"FP8 on sm{self.arch}",
                                  "FP8 needs Hopper/Ada: use --cuda-arch 89 or 90")
            self.use(node, f"{node.op}(fp8, sm{self.arch})")

    def check_group(self, node: Node, bits: int, group_size: int) -> None:
        wo = self.target.weight_only
        if group_size != -1 and (wo is None or group_size not in wo.group_sizes):
            raise self.refuse(node, f"group-wise int{bits} weight-only (group_size {group_size})",
                              f"{self.target.name} kernels are per-channel only; quantize with "
                              "group_size -1 (e.g. --quant wint8 or wint8mix) or use --target cuda")

    # -- dense weight-only linear ---------------------------------------------------------------------

    def dense(self, node: Node) -> None:
        q = node.inputs[1]
        assert q is not None
        bits, gs = _bits(q.type), node.attrs.group_size
        self.check_group(node, bits, gs)
        k, n = q.shape
        assert isinstance(k, int) and isinstance(n, int)
        if not self.target.supports_weight_only(bits, gs):
            wo = self.target.weight_only
            has = f"{wo.kernel} takes int{'/'.join(map(str, wo.bits))}" if wo else "no weight-only kernel"
            self.decompose(node, f"{self.target.name} has no int{bits} dense weight-only kernel ({has})")
            return
        assert self.target.weight_only is not None
        if self.arch is None:  # ascend / kunlun
            if self.target.name == "kunlun" and bits == 8 and self.xpu_dense(node):
                return
            if self.target.name == "ascend":
                self.annotate_npu(node)
            self.use(node, f"{self.target.weight_only.kernel}(int{bits})")
            return
        why = packable(k, n, bits, self.arch)
        if why is not None or not isinstance(q, Param):
            self.decompose(node, f"no sm{self.arch} layout for [{k}, {n}]: {why}")
            return
        packed = self.packed_param(q, bits)
        g = GraphBuilder(self.graph)
        g.insert_point = node
        x, s = node.inputs[0], node.inputs[2]
        bias = node.inputs[3] if len(node.inputs) > 3 else None
        with g.at_scope(node.scope):
            y = g.weight_only_linear_packed(x, packed, s, bias, arch=self.arch, bits=bits,
                                            in_features=k, group_size=gs)
        y.name = node.output.name
        self.graph.replace_all_uses_with(node.output, y)
        self.graph.erase(node)
        self.swap_param(q, packed)
        self.use(y.producer, f"weight_only_linear(sm{self.arch}, int{bits})")

    def packed_param(self, q: Param, bits: int) -> Param:
        p = self.packed.get(q.name)
        if p is None:
            assert self.arch is not None
            k, n = q.shape
            src = PackedSource(q.source, bits, self.arch) if q.source is not None else None
            ann = {**q.annotations, LAYOUT_KEY: {"arch": self.arch, "bits": bits, "logical": [k, n]}}
            p = self.packed[q.name] = Param(q.name, TensorType(DType.I8, packed_shape(k, n, bits)), src,
                                            annotations=ann)
        return p

    def annotate_npu(self, node: Node) -> None:
        """ascend: the NPU binding reads int8 [K, N] (+ scales in x's dtype): the logical layout."""
        q, s = node.inputs[1], node.inputs[2]
        if isinstance(q, Param) and DEVICE_LAYOUT_KEY not in q.annotations:
            assert s is not None
            k, n = q.shape
            q.annotations = {**q.annotations, DEVICE_LAYOUT_KEY: {
                "layout": "npu", "shape": "[K, N]", "logical": [k, n], "scale_dtype": str(s.dtype)}}

    def xpu_param(self, p: Param, scale: bool) -> Param:
        new = self.packed.get(p.name)
        if new is None:
            src = XpuSource(p.source, scale) if p.source is not None else None
            if scale:
                new = Param(p.name, TensorType(DType.F32, p.shape), src, annotations=dict(p.annotations))
            else:
                k, n = p.shape
                ann = {**p.annotations, DEVICE_LAYOUT_KEY: {"layout": "xpu", "shape": "[N, K]",
                                                            "logical": [k, n], "scale_dtype": "f32"}}
                new = Param(p.name, TensorType(DType.I8, (n, k)), src, annotations=ann)
            self.packed[p.name] = new
        return new

    def xpu_dense(self, node: Node) -> bool:
        """kunlun int8: the XPU kernel's [N, K] int8 + float32 scales; False if not params."""
        x, q, s = node.inputs[0], node.inputs[1], node.inputs[2]
        if not isinstance(q, Param) or not isinstance(s, Param) or x is None:
            return False
        pq, ps = self.xpu_param(q, scale=False), self.xpu_param(s, scale=True)
        bias = node.inputs[3] if len(node.inputs) > 3 else None
        g = GraphBuilder(self.graph)
        g.insert_point = node
        with g.at_scope(node.scope):
            y = g.weight_only_linear_xpu(x, pq, ps, bias)
        y.name = node.output.name
        self.graph.replace_all_uses_with(node.output, y)
        self.graph.erase(node)
        self.swap_param(q, pq)
        self.swap_param(s, ps)
        self.use(y.producer, f"{self.target.weight_only.kernel}(int8, [N, K], f32 scale)")
        return True

    def swap_param(self, old: Param, new: Param) -> None:
        if not old.num_uses() and self.graph.params.get(old.name) is old:
            self.graph.params[old.name] = new

    def decompose(self, node: Node, reason: str) -> None:
        x, q, s = node.inputs[0], node.inputs[1], node.inputs[2]
        assert x is not None and q is not None and s is not None
        bias = node.inputs[3] if len(node.inputs) > 3 else None
        g = GraphBuilder(self.graph)
        g.insert_point = node
        with g.at_scope(node.scope):
            w = g.dequantize(q, s, dtype=x.dtype, group_size=node.attrs.group_size)
            y = g.linear(x, w, bias)
        y.name = node.output.name
        self.graph.replace_all_uses_with(node.output, y)
        self.graph.erase(node)
        self.fallback(y.producer, f"dequantize(int{_bits(q.type)}) + linear (portable)", reason)

    # -- expert stacks --------------------------------------------------------------------------------

    def dequantize(self, node: Node) -> None:
        q, s = node.inputs[0], node.inputs[1]
        assert q is not None and s is not None
        bits, gs = _bits(q.type), node.attrs.group_size
        feeds_experts = q.type.rank == 3 and all(u.op in ("moe_experts", "moe_experts_lora")
                                                 for u in node.output.users)
        if not feeds_experts:
            self.check_group(node, bits, gs)
            self.use(node, f"dequantize(int{bits}) (portable)")
            return
        self.check_group(node, bits, gs)
        moe = self.target.fused_moe
        if moe is None or bits not in moe.bits or not moe.confirmed:
            why = "no fused MoE kernel" if moe is None else (
                f"{moe.kernel} takes int{'/'.join(map(str, moe.bits))}" if bits not in moe.bits
                else f"{moe.kernel} is not confirmed for this target")
            self.fallback(node, f"dequantize(int{bits}) + moe_experts (portable)", why)
            return
        if self.arch is None:
            if self.target.name == "kunlun" and bits == 8 and isinstance(q, Param) and isinstance(s, Param):
                self.xpu_experts(node, q, s)
                return
            # int4 experts (kunlun) and everything on ascend keep the logical layout
            self.use(node, f"{moe.kernel}(int{bits}, logical [K, N]: device packing not confirmed)")
            return
        e, k, n = q.shape
        assert isinstance(e, int) and isinstance(k, int) and isinstance(n, int)
        why = packable(k, n, bits, self.arch)
        if why is not None or not isinstance(q, Param) or not isinstance(s, Param):
            self.fallback(node, f"dequantize(int{bits}) + moe_experts (portable)",
                          f"no sm{self.arch} layout for expert [{k}, {n}]: {why}")
            return
        memo: dict[str, Any] = {}
        packed: list[Param] = []
        scales: list[Param] = []
        s_all = np.asarray(s.read()) if s.source is not None else None
        for i in range(e):
            src = (PackedSource(q.source, bits, self.arch, expert=i, memo=memo)
                   if q.source is not None else None)
            ann = {**q.annotations, LAYOUT_KEY: {"arch": self.arch, "bits": bits, "logical": [k, n]}}
            packed.append(self.placer.add(q.name, Param(expert_name(q.name, i),
                                                        TensorType(DType.I8, packed_shape(k, n, bits)),
                                                        src, annotations=ann)))
            ssrc = ArraySource(np.ascontiguousarray(s_all[i])) if s_all is not None else None
            scales.append(self.placer.add(s.name, Param(expert_name(s.name, i),
                                                        TensorType(s.dtype, s.shape[1:]), ssrc)))
        g = GraphBuilder(self.graph)
        g.insert_point = node
        with g.at_scope(node.scope):
            uq = g.unpack_weight(*packed, arch=self.arch, bits=bits, in_features=k, stacked=True)
            us = g.stack(*scales)
        node.set_input(0, uq)
        node.set_input(1, us)
        self.removed.update({q.name, s.name})
        self.use(node, f"{moe.kernel}(sm{self.arch}, int{bits})")


    def xpu_experts(self, node: Node, q: Param, s: Param) -> None:
        """kunlun int8 experts: one [N, K] int8 + float32 [N] scale pair per expert (moe_expert_ffn)."""
        moe = self.target.fused_moe
        assert moe is not None
        e, k, n = q.shape
        assert isinstance(e, int) and isinstance(k, int) and isinstance(n, int)
        qmemo: dict[str, Any] = {}
        smemo: dict[str, Any] = {}
        packed: list[Param] = []
        scales: list[Param] = []
        ann = {**q.annotations, DEVICE_LAYOUT_KEY: {"layout": "xpu", "shape": "[N, K]",
                                                    "logical": [k, n], "scale_dtype": "f32"}}
        for i in range(e):
            qsrc = XpuSource(q.source, False, expert=i, memo=qmemo) if q.source is not None else None
            ssrc = XpuSource(s.source, True, expert=i, memo=smemo) if s.source is not None else None
            packed.append(self.placer.add(q.name, Param(expert_name(q.name, i), TensorType(DType.I8, (n, k)),
                                                        qsrc, annotations=dict(ann))))
            scales.append(self.placer.add(s.name, Param(expert_name(s.name, i),
                                                        TensorType(DType.F32, s.shape[1:]), ssrc)))
        g = GraphBuilder(self.graph)
        g.insert_point = node
        with g.at_scope(node.scope):
            uq = g.unpack_weight_xpu(*packed, stacked=True)
            us = g.stack(*scales)
        node.set_input(0, uq)
        node.set_input(1, us)
        self.removed.update({q.name, s.name})
        self.use(node, f"{moe.kernel}(int8, [N, K] per expert, f32 scales)")


def legalize(graph: Graph, target: HardwareTarget, cuda_arch: int | None = None) -> bool:
    return Legalizer(graph, target, cuda_arch).run()
