"""A target's legalization rules: how its kernels take the weight-only nodes they accept.

The generic legalizer (`ernie_ir.targets.legalize`) decides from the capability table
(`HardwareTarget.weight_only`, `.fused_moe`) *whether* a node has a kernel on the target; the
target's `LegalizationRules` decide *how*: the weight layout that kernel reads and the node
that calls it. The defaults keep the logical layout and only record the kernel, which is what
a target whose binding reads int8 `[K, N]` needs; cuda (`targets/cuda/legalize.py`) packs in
Paddle's arch layout, kunlun (`targets/kunlun/legalize.py`) writes the XPU `[N, K]` layout,
ascend (`targets/ascend/legalize.py`) annotates the NPU layout.

    class MyRules(LegalizationRules):
        def dense(self, lz, node, bits, kernel):
            ...                           # re-lay the weight out, replace the node
            lz.use(new_node, f"{kernel}(int{bits}, my layout)")

A hook sees the legalizer through `Legalizing` (the graph, the arch, the plan, param
bookkeeping) and must either record the node in the plan (`use`) or hand it back to the
portable form (`decompose` for a dense linear, `fallback` for an expert stack), with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ernie_ir.ir import Graph, Node, Param, Value
    from ernie_ir.passes.infra.param_placer import ParamPlacer


class Legalizing(Protocol):
    """What the generic legalizer offers a target's rules while it runs."""

    graph: Graph
    arch: int | None
    """The value of the target's arch option (`HardwareTarget.arch_option`; cuda: --cuda-arch), or None."""
    placer: ParamPlacer
    """Adds params next to the one they replace (`placer.add(anchor, param)`)."""
    removed: set[str]
    """Names of params to drop at the end if nothing uses them any more."""
    packed: dict[str, Param]
    """Re-laid-out params by the name of the param they replace (one per weight, shared by uses)."""

    def use(self, node: Node, kernel: str) -> None:
        """Record that `node` runs on `kernel` (a kernel-plan entry)."""

    def fallback(self, node: Node, kernel: str, reason: str) -> None:
        """Record that `node` stays portable (`kernel`), and why (a kernel-plan fallback)."""

    def decompose(self, node: Node, reason: str) -> None:
        """Rewrite a dense `weight_only_linear` into `dequantize` + `linear`, recorded as a fallback."""

    def replace(self, node: Node, value: Value) -> None:
        """Make `value` (built before `node`) take `node`'s output name and uses; erase `node`."""

    def swap_param(self, old: Param, new: Param) -> None:
        """Put `new` in `old`'s place in the graph's params once nothing uses `old`."""


class LegalizationRules:
    """The default rules: every kernel reads the logical layout (int8 `[K, N]`, scales `[N]`)."""

    def dense(self, lz: Legalizing, node: Node, bits: int, kernel: str) -> None:
        """A dense `weight_only_linear` of `bits` that the target's weight-only `kernel` takes
        (its bits and group size checked)."""
        lz.use(node, f"{kernel}(int{bits})")

    def experts(self, lz: Legalizing, node: Node, q: Any, s: Any, bits: int, kernel: str) -> None:
        """An integer `dequantize` of stacked expert weights `q` [E, K, N] with scales `s` that
        feeds `moe_experts` and that the target's confirmed fused MoE `kernel` takes."""
        lz.use(node, f"{kernel}(int{bits}, logical [K, N]: device packing not confirmed)")

    def w4a8_experts(self, lz: Legalizing, node: Node) -> None:
        """A `moe_experts_w4a8` (FastDeploy's W4A8 routed experts): the default keeps its stacked
        logical params (i4 [E, K, N], scales [E, N], input scales [E])."""
        lz.use(node, "moe_experts_w4a8(logical [E, K, N]: no device layout)")

    def wint2_experts(self, lz: Legalizing, node: Node) -> None:
        """A `wint2_dequantize` of stacked 2-bit expert weights feeding `moe_experts`: the default
        keeps the stacked params and the portable decode."""
        lz.use(node, "wint2_dequantize + moe_experts (portable)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


DEFAULT_RULES = LegalizationRules()
