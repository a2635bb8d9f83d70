"""Legalization: rewrite a graph into what one target can run, and record the kernel plan.

The driver is generic: it asks the target (`HardwareTarget`) and never tests its name. Per node:

- `weight_only_linear` (dense): when the target's weight-only kernel takes the node's bits and
  group size, the target's rules (`HardwareTarget.rules.dense`, `targets/rules.py`) lower it:
  cuda packs the weight in Paddle's arch layout (`weight_only_linear_packed`; a shape the
  layout cannot hold is decomposed), kunlun writes the XPU layout (`weight_only_linear_xpu`,
  int8 [N, K] + float32 scales), ascend annotates the NPU layout (int8 [K, N], the logical
  one). Bits the kernel lacks (int4 where only int8 exists) are decomposed into `dequantize` +
  `linear` (the weight stays int4/int8 in storage); group-wise where the kernel takes
  per-channel only is refused.
- integer `dequantize` feeding `moe_experts` (stacked expert weights): when the target's fused
  MoE kernel is confirmed for those bits, the rules lower it (`rules.experts`: cuda one packed
  param per expert, `<...>.experts.<e>.<proj>.quant_weight`; kunlun int8 one [N, K] int8 +
  float32 scale pair per expert; the default keeps the logical layout), else the portable
  dequantize + moe_experts, recorded as a fallback.
- `moe_experts_w4a8` (W4A8 routed experts) and `wint2_dequantize` feeding `moe_experts` (2-bit
  expert stacks): the rules lower them (`rules.w4a8_experts` / `rules.wint2_experts`: cuda one
  param per expert and key in FastDeploy's layout; the default keeps the stacked params).
- FP8 (`fp8_linear`, `fake_quant_fp8`, fp8 `dequantize`): only on a target with FP8 kernels,
  and, where it has an arch option, on one of the option's FP8 choices (cuda: --cuda-arch 89/90).

The plan (only the quantized nodes; every other node runs the portable Paddle op of the same
name) goes into `graph.metadata["kernel_plan"]`: `{target, <arch option>?, kernels: [{scope,
op, kernel}], fallbacks: [{scope, op, kernel, reason}]}` (cuda's arch option is `cuda_arch`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_ir.formats.fastdeploy import FASTDEPLOY_KEY as FASTDEPLOY_KEY  # cuda's W4A8 / WINT2 experts
from ernie_ir.ir import DType, Graph, GraphBuilder, Node, Param, TensorType, Value
from ernie_ir.ir.weights import WeightSource
from ernie_ir.passes.infra.param_placer import ParamPlacer
from ernie_ir.targets.capabilities import HardwareTarget
from ernie_ir.targets.errors import TargetError

PLAN_KEY = "kernel_plan"
LAYOUT_KEY = "cuda_layout"
DEVICE_LAYOUT_KEY = "device_layout"
_FP8 = (DType.F8E4M3, DType.F8E5M2)


class ExpertSource(WeightSource):
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


def bits_of(t: TensorType) -> int:
    """The bit width of a weight-only weight's storage type: 8 for i8, else 4."""
    return 8 if t.dtype == DType.I8 else 4


def expert_name(stacked: str, e: int) -> str:
    """`...mlp.experts.up_gate_proj.quant_weight` -> `...mlp.experts.<e>.up_gate_proj.quant_weight`."""
    if ".experts." in stacked:
        head, tail = stacked.split(".experts.", 1)
        return f"{head}.experts.{e}.{tail}"
    head, _, leaf = stacked.rpartition(".")
    return f"{head}.{e}.{leaf}" if head else f"{e}.{leaf}"


class Legalizer:
    """Legalizes one graph for `target` (`arch`: the value of its arch option, or None); the
    target's rules see it as `rules.Legalizing`."""

    def __init__(self, graph: Graph, target: HardwareTarget, arch: int | None = None) -> None:
        self.graph = graph
        self.target = target
        self.arch = arch
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
            elif node.op == "moe_experts_w4a8" and all(isinstance(v, Param) for v in node.inputs[3:9]):
                self.target.rules.w4a8_experts(self, node)
            elif node.op == "wint2_dequantize" and all(isinstance(v, Param) for v in node.inputs) \
                    and node.output.users and all(u.op == "moe_experts" for u in node.output.users):
                self.target.rules.wint2_experts(self, node)
        self.placer.finish(removed=self.removed)
        plan: dict[str, Any] = {"target": self.target.name}
        if self.arch is not None and self.target.arch_option is not None:
            plan[self.target.arch_option.name] = self.arch
        plan["kernels"] = self.kernels
        plan["fallbacks"] = self.fallbacks
        self.graph.metadata[PLAN_KEY] = plan
        return True

    def check_fp8(self) -> None:
        opt = self.target.arch_option
        for node in self.graph:
            fp8 = node.op in ("fp8_linear", "fake_quant_fp8") or any(
                v is not None and v.dtype in _FP8 for v in node.inputs)
            if not fp8:
                continue
            if not self.target.fp8:
                raise self.refuse(node, "FP8", "FP8 kernels exist on --target cuda with --cuda-arch 89 or "
                                  f"90 only; use --quant wint8 or wint8mix for {self.target.name}")
            if opt is None:
                self.use(node, f"{node.op}(fp8)")
                continue
            if self.arch not in opt.fp8:
                raise self.refuse(node, f"FP8 on sm{self.arch}",
                                  f"FP8 needs {opt.fp8_hint or 'another arch'}: use {opt.flag} "
                                  + " or ".join(map(str, opt.fp8)))
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
        bits, gs = bits_of(q.type), node.attrs.group_size
        self.check_group(node, bits, gs)
        wo = self.target.weight_only
        if wo is None or not self.target.supports_weight_only(bits, gs):
            has = f"{wo.kernel} takes int{'/'.join(map(str, wo.bits))}" if wo else "no weight-only kernel"
            self.decompose(node, f"{self.target.name} has no int{bits} dense weight-only kernel ({has})")
            return
        self.target.rules.dense(self, node, bits, wo.kernel)

    def replace(self, node: Node, value: Value) -> None:
        """`value` (built before `node`) takes `node`'s output name and uses; `node` is erased."""
        value.name = node.output.name
        self.graph.replace_all_uses_with(node.output, value)
        self.graph.erase(node)

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
        self.replace(node, y)
        self.fallback(y.producer, f"dequantize(int{bits_of(q.type)}) + linear (portable)", reason)

    # -- expert stacks --------------------------------------------------------------------------------

    def dequantize(self, node: Node) -> None:
        q, s = node.inputs[0], node.inputs[1]
        assert q is not None and s is not None
        bits, gs = bits_of(q.type), node.attrs.group_size
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
        self.target.rules.experts(self, node, q, s, bits, moe.kernel)


def legalize(graph: Graph, target: HardwareTarget, arch: int | None = None) -> bool:
    """Legalize `graph` for `target` in place (`arch`: the value of its arch option)."""
    return Legalizer(graph, target, arch).run()
