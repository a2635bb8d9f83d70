"""Rules that find their matches by walking the dataflow, behind the pattern rules' interface.

Some rewrites are not one pattern: "the q, k and v projections of this
attention, however its heads are laid out", "a whole parallel block". A
multi-root pattern rule covers a fixed set of roots; a `DataflowRule` instead
finds its match from a root node in code, step by step, refusing with a
reason at the first step that fails, and places the nodes it creates itself,
after every value they read. It has the
interface `RuleSet` and the tracer use (`root_op`, `size`, `try_match`,
`apply_match`), so it runs in rule sets and passes, and `ernie-ir explain
RULE MODEL` reports its best partial match and the reason it failed.

    class MyRule(DataflowRule):
        name = "my-rule"
        root = "attention"
        steps = 4                      # steps of a full match (the tracer's total)

        def plan(self, node, steps):   # raise Refusal("why"); steps.passed() after each step
            ...
            return Plan(nodes=[...], ...)

        def apply_plan(self, graph, plan):
            ...                        # rewrite; return the nodes created
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ernie_ir.ir import Graph, GraphBuilder, Node, Value

from .base import PassContext, graph_properties
from .rewrite import Match, PatternBuilder, PatternOutput, RewritePass, RewriteRule, RuleSet, Var


class Refusal(Exception):
    """Why a candidate does not match (the tracer shows `reason`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Steps:
    """How far a match got: `passed()` after each step that held."""

    def __init__(self) -> None:
        self.count = 0

    def passed(self, n: int = 1) -> None:
        self.count += n

    def need(self, condition: bool, reason: str) -> None:
        """A step: refuse with `reason` unless `condition` holds."""
        if not condition:
            raise Refusal(reason)
        self.count += 1


@dataclass
class Plan:
    """A found match: the nodes it covers (root first) and whatever the rewrite needs."""

    nodes: list[Node]
    data: dict[str, Any] = field(default_factory=dict)


class DataflowRule(RewriteRule):
    """A rule whose `plan(node, steps)` finds a match from a root node of op `root`."""

    root: ClassVar[str]
    steps: ClassVar[int]

    @abstractmethod
    def plan(self, node: Node, steps: Steps) -> Plan:
        """The match rooted at `node`, or raise Refusal; call `steps.passed()` as steps hold."""

    @abstractmethod
    def apply_plan(self, graph: Graph, plan: Plan) -> list[Node]:
        """Rewrite the graph for `plan`; return the nodes created."""

    # -- the RewriteRule interface, in terms of plan / apply_plan ------------------------------

    def pattern(self, op: PatternBuilder, *args: Var) -> Any:
        raise TypeError(f"rule {self.name} matches by walking the dataflow; it has no pattern")

    def rewrite(self, op: GraphBuilder, **bindings: Any) -> Value | Sequence[Value]:
        raise TypeError(f"rule {self.name} rewrites through apply_plan")

    def compiled(self) -> tuple[list[PatternOutput], int]:
        return [], self.steps  # no pattern outputs: plan() finds the nodes

    @property
    def root_op(self) -> str:
        return self.root

    @property
    def size(self) -> int:
        return self.steps

    def try_match(self, node: Node) -> tuple[Match | None, int, str]:
        steps = Steps()
        try:
            plan = self.plan(node, steps)
        except Refusal as r:
            return None, min(steps.count, self.steps - 1), r.reason
        nodes = list(dict.fromkeys([node, *plan.nodes]))
        return Match(self, nodes, {"plan": plan}, []), self.steps, ""

    def apply_match(self, graph: Graph, m: Match) -> list[Node]:
        return self.apply_plan(graph, m.bindings["plan"])


class UnfusePass(RewritePass):
    """A rewrite pass that cuts fused layers apart: on a rank graph (after `split`) it changes
    nothing and says so, since cut weights no longer hold whole parts."""

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        changed = RuleSet(self.active_rules()).apply(graph, ctx) > 0
        if not changed and "split" in graph_properties(graph):
            ctx.warn("the graph is split into rank graphs, whose fused weights are cut "
                     "shards: unfuse before split")
        return changed
