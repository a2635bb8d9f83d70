"""Declarative rewrite rules: pattern, check, rewrite.

A rule reads like the math it replaces:

    class FuseLinearBias(RewriteRule):
        '''linear(x, W) + b  ->  linear(x, W, b)'''
        name = "fuse-linear-bias"

        def pattern(self, op, x, w, b):
            return op.add(op.linear(x, w, _single_use=True), b.where(param=True, rank=1))

        def check(self, ctx, x, w, b):
            if b.shape[0] != w.shape[1]:
                return ctx.fail("bias length differs from out_features", b)
            return ctx.ok()

        def rewrite(self, op, x, w, b):
            return op.linear(x, w, b)

- `pattern(op, *vars)` is written with `op`, a PatternBuilder that has one
  method per registered op, exactly like GraphBuilder. The parameters after
  `op` are pattern variables; each matches any value, or what its `.where(...)`
  allows (dtype, rank, param or not, single use, optional, a predicate).
  Keyword arguments constrain attributes (a value, a predicate, or
  `op.attr("name")` to bind it); `_scope="*.mlp.*"` (glob) or
  `_scope="re:..."` (regex, full match) constrains the node's scope;
  `_single_use=True` requires the result to have one reader. A pattern may
  return several values (e.g. three linears sharing one input).
- `check(ctx, **bindings)` returns `ctx.ok()` or `ctx.fail("why", *values)`.
- `rewrite(op, **bindings)` builds the replacement with a GraphBuilder
  positioned before the matched nodes (scope: the root node's) and returns
  the new value(s), one per pattern output.

`RuleSet.apply` rewrites to a fixed point; `RuleSet.find` only reports
matches; `explain` reports, for each rule, matches and the best partial
match with the reason it failed.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ernie_ir.ir import DType, Graph, GraphBuilder, Node, Param, Value, get_op, has_op

from .base import NoOptions, Pass, PassContext

# -- pattern language ----------------------------------------------------------------


class PatternValue:
    """Something a pattern input can be: a variable or a pattern node's output."""

    def __init__(self) -> None:
        self.dtype: DType | None = None
        self.rank: int | None = None
        self.is_param: bool | None = None
        self.single_use = False
        self.optional = False
        self.predicate: Callable[[Value], bool] | None = None

    def where(self, *, dtype: DType | None = None, rank: int | None = None,
              param: bool | None = None, single_use: bool | None = None,
              optional: bool | None = None,
              predicate: Callable[[Value], bool] | None = None) -> PatternValue:
        """Add constraints (returns self, for use inside expressions)."""
        if dtype is not None:
            self.dtype = dtype
        if rank is not None:
            self.rank = rank
        if param is not None:
            self.is_param = param
        if single_use is not None:
            self.single_use = single_use
        if optional is not None:
            self.optional = optional
        if predicate is not None:
            self.predicate = predicate
        return self

    def describe(self) -> str:
        return "value"

    def constraint_failure(self, v: Value) -> str | None:
        if self.is_param is True and not isinstance(v, Param):
            return f"{self.describe()} must be a param"
        if self.is_param is False and isinstance(v, Param):
            return f"{self.describe()} must not be a param (found @{v.name})"
        if self.dtype is not None and v.type.dtype != self.dtype:
            return f"{self.describe()} must be {self.dtype}, found {v.type}"
        if self.rank is not None and v.type.rank != self.rank:
            return f"{self.describe()} must have rank {self.rank}, found {v.type}"
        if self.single_use and v.num_uses() != 1:
            return f"{self.describe()} must have a single use, has {v.num_uses()}"
        if self.predicate is not None and not self.predicate(v):
            return f"{self.describe()} fails its predicate"
        return None


class Var(PatternValue):
    """A pattern variable: binds to one value wherever it appears."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def describe(self) -> str:
        return f"variable {self.name}"

    def __repr__(self) -> str:
        return f"Var({self.name})"


@dataclass(frozen=True)
class AttrVar:
    """Binds an attribute's value to a name passed to check/rewrite."""

    name: str


class PatternNode:
    def __init__(self, op: str, inputs: Sequence[PatternValue | None], attrs: dict[str, Any],
                 scope: str | None, n_outputs: int) -> None:
        self.op = op
        self.inputs = list(inputs)
        self.attrs = attrs
        self.scope = scope
        self.outputs = [PatternOutput(self, i) for i in range(n_outputs)]

    def scope_matches(self, scope: str) -> bool:
        if self.scope is None:
            return True
        if self.scope.startswith("re:"):
            return re.fullmatch(self.scope[3:], scope) is not None
        return fnmatch.fnmatchcase(scope, self.scope)


class PatternOutput(PatternValue):
    def __init__(self, node: PatternNode, index: int) -> None:
        super().__init__()
        self.node = node
        self.index = index

    def describe(self) -> str:
        return f"result of {self.node.op}"


class PatternBuilder:
    """`op.<name>(inputs..., **attr_constraints)` builds pattern nodes, like GraphBuilder."""

    def attr(self, name: str) -> AttrVar:
        return AttrVar(name)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or not has_op(name):
            raise AttributeError(f"no op named {name!r} to use in a pattern")
        opdef = get_op(name)

        def build(*inputs: PatternValue | None, _scope: str | None = None,
                  _single_use: bool = False, _outputs: int | None = None, **kwargs: Any) -> Any:
            ins = list(inputs)
            for idx, spec in enumerate(opdef.inputs):
                if spec.name in kwargs:
                    ins.extend([None] * (idx + 1 - len(ins)))
                    ins[idx] = kwargs.pop(spec.name)
            unknown = set(kwargs) - set(opdef.Attrs.model_fields)
            if unknown:
                raise TypeError(f"pattern {name}: unknown attribute(s) {sorted(unknown)}")
            n_out = _outputs if _outputs is not None else opdef.num_outputs
            node = PatternNode(name, ins, kwargs, _scope, n_out)
            for out in node.outputs:
                out.single_use = _single_use
            return node.outputs[0] if n_out == 1 else tuple(node.outputs)

        return build


# -- match results ---------------------------------------------------------------------


@dataclass
class MatchResult:
    """Success, or failure with a reason (and the values it is about)."""

    success: bool
    reason: str = ""
    values: tuple[Value, ...] = ()

    def __bool__(self) -> bool:
        return self.success

    @staticmethod
    def ok() -> MatchResult:
        return MatchResult(True)

    @staticmethod
    def fail(reason: str, *values: Value) -> MatchResult:
        return MatchResult(False, reason, values)


class MatchContext:
    """Passed to `check`: the match so far, and `ok()` / `fail()` constructors."""

    def __init__(self, match: Match) -> None:
        self.match = match

    @property
    def root(self) -> Node:
        return self.match.nodes[0]

    def ok(self) -> MatchResult:
        return MatchResult.ok()

    def fail(self, reason: str, *values: Value) -> MatchResult:
        return MatchResult.fail(reason, *values)


@dataclass
class Match:
    rule: RewriteRule
    nodes: list[Node]  # nodes[0] is the root (producer of the first pattern output)
    bindings: dict[str, Any]
    outputs: list[Value]

    def __repr__(self) -> str:
        root = self.nodes[0]
        return f"<Match {self.rule.name} at {root.op}{' @ ' + root.scope if root.scope else ''}>"


class _Fail(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class _State:
    __slots__ = ("bindings", "deepest", "depth", "node_map")

    def __init__(self) -> None:
        self.bindings: dict[str, Any] = {}
        self.node_map: dict[PatternNode, Node] = {}
        self.depth = 0
        self.deepest = 0  # most pattern nodes matched by any attempt (kept across restores)

    def snapshot(self) -> tuple[dict[str, Any], dict[PatternNode, Node], int]:
        return dict(self.bindings), dict(self.node_map), self.depth

    def restore(self, snap: tuple[dict[str, Any], dict[PatternNode, Node], int]) -> None:
        self.bindings, self.node_map, self.depth = dict(snap[0]), dict(snap[1]), snap[2]


def _norm(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_norm(x) for x in v)
    return v


# -- rules ---------------------------------------------------------------------------------


class RewriteRule(ABC):
    """Subclass and define `pattern`, optionally `check`, and `rewrite`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    commute: ClassVar[bool] = False
    """Also try swapped inputs of add/mul nodes in the pattern."""

    @abstractmethod
    def pattern(self, op: PatternBuilder, *args: Var) -> Any:
        """The subgraph to find, built with `op` from the variables."""

    def check(self, ctx: MatchContext, **bindings: Any) -> MatchResult | bool:
        return MatchResult.ok()

    @abstractmethod
    def rewrite(self, op: GraphBuilder, **bindings: Any) -> Value | Sequence[Value]:
        """Build the replacement; return one value per pattern output."""

    # -- compiled pattern --------------------------------------------------------------

    _compiled: tuple[list[PatternOutput], int] | None = None

    def compiled(self) -> tuple[list[PatternOutput], int]:
        if self._compiled is None:
            params = list(inspect.signature(self.pattern).parameters)[1:]
            outs = self.pattern(PatternBuilder(), *(Var(p) for p in params))
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            if not outs or not all(isinstance(o, PatternOutput) for o in outs):
                raise TypeError(f"rule {self.name}: pattern must return op results")
            seen: set[PatternNode] = set()

            def count(n: PatternNode) -> None:
                if n in seen:
                    return
                seen.add(n)
                for i in n.inputs:
                    if isinstance(i, PatternOutput):
                        count(i.node)

            for o in outs:
                count(o.node)
            self._compiled = (outs, len(seen))
        return self._compiled

    @property
    def root_op(self) -> str:
        return self.compiled()[0][0].node.op

    @property
    def size(self) -> int:
        """Number of nodes in the pattern."""
        return self.compiled()[1]

    def __repr__(self) -> str:
        return f"<RewriteRule {self.name}>"

    # -- matching ------------------------------------------------------------------------

    def try_match(self, node: Node) -> tuple[Match | None, int, str]:
        """Match with `node` as the root. Returns (match, nodes matched, failure reason)."""
        outs, total = self.compiled()
        state = _State()
        try:
            self._match_output(outs[0], node.outputs[0] if len(node.outputs) == 1 else None,
                               node, state)
            for extra in outs[1:]:
                self._match_extra_root(extra, state)
        except _Fail as f:
            return None, state.deepest, f.reason
        matched = list(dict.fromkeys([state.node_map[o.node] for o in outs]
                                     + list(state.node_map.values())))
        out_values = [state.node_map[o.node].outputs[o.index] for o in outs]
        reason = self._interior_escapes(matched, out_values)
        if reason:
            return None, total, reason
        m = Match(self, matched, dict(state.bindings), out_values)
        result = self.check(MatchContext(m), **m.bindings)
        if isinstance(result, bool):
            result = MatchResult(result, "" if result else "check() refused (no reason given)")
        if not result:
            return None, total, f"check: {result.reason}"
        return m, total, ""

    def _match_output(self, po: PatternOutput, value: Value | None, node: Node, state: _State) -> None:
        if value is None:
            value = node.outputs[po.index] if po.index < len(node.outputs) else None
            if value is None:
                raise _Fail(f"{node.op} has no result {po.index}")
        self._match_node(po.node, node, state)
        if value is not node.outputs[po.index]:
            raise _Fail(f"expected result {po.index} of {node.op}")
        why = po.constraint_failure(value)
        if why:
            raise _Fail(why)

    def _match_value(self, pv: PatternValue | None, value: Value | None, state: _State,
                     where: str) -> None:
        if pv is None:
            if value is not None:
                raise _Fail(f"{where} is present but the pattern has none")
            return
        if value is None:
            if pv.optional:
                if isinstance(pv, Var):
                    state.bindings.setdefault(pv.name, None)
                return
            raise _Fail(f"{where} is absent but the pattern needs {pv.describe()}")
        if isinstance(pv, Var):
            bound = state.bindings.get(pv.name, _UNBOUND)
            if bound is not _UNBOUND:
                if bound is not value:
                    raise _Fail(f"{pv.describe()} would bind two different values")
                return
            why = pv.constraint_failure(value)
            if why:
                raise _Fail(why)
            state.bindings[pv.name] = value
            return
        assert isinstance(pv, PatternOutput)
        producer = value.producer
        if producer is None:
            kind = f"param @{value.name}" if isinstance(value, Param) else f"graph input {value.name}"
            raise _Fail(f"{where}: expected {pv.describe()}, found {kind}")
        if value.index != pv.index:
            raise _Fail(f"{where}: expected result {pv.index} of {pv.node.op}, found result "
                        f"{value.index}")
        self._match_node(pv.node, producer, state)
        why = pv.constraint_failure(value)
        if why:
            raise _Fail(why)

    def _match_node(self, pn: PatternNode, node: Node, state: _State) -> None:
        mapped = state.node_map.get(pn)
        if mapped is not None:
            if mapped is not node:
                raise _Fail(f"one {pn.op} in the pattern would match two nodes")
            return
        if node in state.node_map.values():
            raise _Fail(f"{node.op} at {node.scope} would match two pattern nodes")
        where = f"{node.op}{' at ' + node.scope if node.scope else ''}"
        if node.op != pn.op:
            raise _Fail(f"expected {pn.op}, found {where}")
        if not pn.scope_matches(node.scope):
            raise _Fail(f"{where}: scope does not match {pn.scope!r}")
        for key, want in pn.attrs.items():
            have = getattr(node.attrs, key)
            if isinstance(want, AttrVar):
                bound = state.bindings.get(want.name, _UNBOUND)
                if bound is not _UNBOUND and bound != have:
                    raise _Fail(f"{where}: attribute {key}={have!r} differs from {want.name}={bound!r}")
                state.bindings[want.name] = have
            elif callable(want) and not isinstance(want, (DType, type)):
                if not want(have):
                    raise _Fail(f"{where}: attribute {key}={have!r} fails its predicate")
            elif _norm(want) != _norm(have):
                raise _Fail(f"{where}: attribute {key} is {have!r}, pattern wants {want!r}")
        state.node_map[pn] = node
        state.depth += 1
        state.deepest = max(state.deepest, state.depth)
        n = max(len(pn.inputs), len(node.inputs))
        orders = [list(range(n))]
        if self.commute and pn.op in ("add", "mul") and n == 2:
            orders.append([1, 0])
        # Of the failed input orders, report the one that got furthest (the tracer's best
        # partial match), not merely the last one tried.
        best_fail: _Fail | None = None
        best_depth = -1
        for order in orders:
            snap = state.snapshot()
            try:
                for i, j in enumerate(order):
                    pv = pn.inputs[i] if i < len(pn.inputs) else None
                    v = node.inputs[j] if j < len(node.inputs) else None
                    self._match_value(pv, v, state, f"{where}: input {node.opdef.input_name(j)}")
                return
            except _Fail as f:
                if state.depth > best_depth:
                    best_fail, best_depth = f, state.depth
                state.restore(snap)
        assert best_fail is not None
        state.depth = best_depth
        raise best_fail

    def _match_extra_root(self, po: PatternOutput, state: _State) -> None:
        """Find a node for another pattern output among readers of bound values."""
        candidates: dict[Node, None] = {}
        known = [v for v in state.bindings.values() if isinstance(v, Value)]
        for n in state.node_map.values():
            known.extend(v for v in n.inputs if v is not None)
        for v in known:
            for user, _ in v.uses:
                if user.op == po.node.op and user not in state.node_map.values():
                    candidates[user] = None
        best = _Fail(f"no {po.node.op} reads the values bound so far")
        for cand in candidates:
            snap = state.snapshot()
            try:
                self._match_output(po, None, cand, state)
                return
            except _Fail as f:
                best = f
                state.restore(snap)
        raise best

    @staticmethod
    def _interior_escapes(nodes: list[Node], outputs: list[Value]) -> str:
        inside = set(nodes)
        outs = set(outputs)
        for n in nodes:
            for v in n.outputs:
                if v in outs:
                    continue
                for user, _ in v.uses:
                    if user not in inside:
                        return (f"intermediate result of {n.op} at {n.scope or '<root>'} is also "
                                f"read by {user.op} at {user.scope or '<root>'} outside the pattern")
                if n.graph is not None and v in n.graph.outputs:
                    return f"intermediate result of {n.op} is a graph output"
        return ""

    # -- rewriting -------------------------------------------------------------------------

    def apply_match(self, graph: Graph, m: Match, order: dict[Node, int] | None = None) -> list[Node]:
        """Replace the matched outputs with what `rewrite` builds; erase dead matched nodes."""
        anchor = self._anchor(m, order)
        b = GraphBuilder(graph)
        b.insert_point = anchor
        before = anchor.prev
        with b.at_scope(m.nodes[0].scope):
            new = self.rewrite(b, **m.bindings)
        new_values = list(new) if isinstance(new, (tuple, list)) else [new]
        if len(new_values) != len(m.outputs):
            raise TypeError(f"rule {self.name}: rewrite returned {len(new_values)} values for "
                            f"{len(m.outputs)} pattern outputs")
        for old, nv in zip(m.outputs, new_values, strict=True):
            if old.type != nv.type:
                raise TypeError(f"rule {self.name}: rewrite changes a type ({old.type} -> {nv.type})")
            graph.replace_all_uses_with(old, nv)
        # Root first, then producers: erasing a reader can make its producer dead.
        pending = list(m.nodes)
        progress = True
        while pending and progress:
            progress = False
            for n in list(pending):
                if n.graph is not graph:
                    pending.remove(n)
                elif not any(v.num_uses() or v in graph.outputs for v in n.outputs):
                    graph.erase(n)
                    pending.remove(n)
                    progress = True
        # Params only the matched nodes read are dead now; a graph keeps no unused params.
        for v in m.bindings.values():
            if isinstance(v, Param) and not v.num_uses() and graph.params.get(v.name) is v:
                graph.remove_param(v.name)
        created = []
        node = before.next if before is not None else graph.first
        while node is not None and node is not anchor and node.graph is graph:
            created.append(node)
            node = node.next
        return created

    @staticmethod
    def _anchor(m: Match, order: dict[Node, int] | None) -> Node:
        """Where new nodes go: before the first matched node when every bound value is
        defined by then, else before the root."""
        if len(m.nodes) == 1 or order is None:
            return m.nodes[0]
        first = min(m.nodes, key=lambda n: order.get(n, 0))
        limit = order.get(first, 0)
        for v in m.bindings.values():
            if isinstance(v, Value) and v.producer is not None and order.get(v.producer, -1) >= limit:
                return m.nodes[0]
        return first


_UNBOUND = object()


# -- rule sets ------------------------------------------------------------------------------


@dataclass
class RuleAttempt:
    node: Node
    matched: int
    total: int
    reason: str


@dataclass
class RuleTrace:
    """What happened to one rule over a graph."""

    rule: str
    matches: int = 0
    candidates: int = 0
    best: RuleAttempt | None = None

    def summary(self) -> str:
        head = f"{self.rule}: {self.matches} match(es) among {self.candidates} candidate node(s)"
        if self.best is None:
            if self.candidates == 0:
                return head + " (no node has the pattern's root op)"
            return head
        b = self.best
        where = f"{b.node.op}{' at ' + b.node.scope if b.node.scope else ''}"
        return (f"{head}; best partial match at {where}: {b.matched}/{b.total} pattern nodes, "
                f"failed because {b.reason}")


class RuleSet:
    """Rules applied together, to a fixed point."""

    def __init__(self, rules: Iterable[RewriteRule]) -> None:
        self.rules = list(rules)
        self._by_root: dict[str, list[RewriteRule]] = {}
        for r in self.rules:
            self._by_root.setdefault(r.root_op, []).append(r)

    def find(self, graph: Graph) -> list[Match]:
        """All matches in the current graph, without rewriting."""
        found = []
        for node in graph:
            for rule in self._by_root.get(node.op, ()):
                m, _, _ = rule.try_match(node)
                if m is not None:
                    found.append(m)
        return found

    def apply(self, graph: Graph, ctx: PassContext | None = None, *, max_sweeps: int = 100) -> int:
        """Rewrite until no rule matches; returns the number of rewrites."""
        total = 0
        multi_root = any(len(r.compiled()[0]) > 1 for r in self.rules)
        for _ in range(max_sweeps):
            order = {n: i for i, n in enumerate(graph)} if multi_root else None
            changed = 0
            node = graph.first
            while node is not None:
                nxt = node.next
                for rule in self._by_root.get(node.op, ()):
                    m, _, _ = rule.try_match(node)
                    if m is None:
                        continue
                    rule.apply_match(graph, m, order)
                    changed += 1
                    if ctx is not None:
                        ctx.count(rule.name)
                    break
                if nxt is not None and nxt.graph is not graph:
                    break  # the rewrite consumed the next node; start a fresh sweep
                node = nxt
            total += changed
            if not changed:
                return total
        raise RuntimeError(f"rules {[r.name for r in self.rules]} did not reach a fixed point "
                           f"in {max_sweeps} sweeps (a rule undoes another?)")

    def explain(self, graph: Graph) -> list[RuleTrace]:
        """Per rule: matches, candidates, and the best partial match with its failure reason."""
        traces = []
        for rule in self.rules:
            t = RuleTrace(rule.name)
            for node in graph:
                if node.op != rule.root_op:
                    continue
                t.candidates += 1
                m, depth, reason = rule.try_match(node)
                if m is not None:
                    t.matches += 1
                elif t.best is None or depth > t.best.matched:
                    t.best = RuleAttempt(node, depth, rule.size, reason)
            if t.matches:
                t.best = None
            traces.append(t)
        return traces


# -- rules as passes -------------------------------------------------------------------------


class RewritePass(Pass):
    """A pass that applies `rules` to a fixed point. Subclass and set name/description/rules."""

    rules: ClassVar[Sequence[RewriteRule]] = ()
    Options = NoOptions

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        return RuleSet(self.rules).apply(graph, ctx) > 0


def rewrite_pass(name: str, description: str, rules: Sequence[RewriteRule], *,
                 requires: tuple[str, ...] = (), produces: tuple[str, ...] = ()) -> type[Pass]:
    """Make a Pass class from rules (register it with `register_pass`)."""
    return type(
        "".join(part.capitalize() for part in name.split("-")) + "Pass",
        (RewritePass,),
        {
            "name": name,
            "description": description,
            "rules": tuple(rules),
            "requires": frozenset(requires),
            "produces": frozenset(produces),
            "__module__": inspect.stack()[1].frame.f_globals.get("__name__", __name__),
        },
    )


def find_rule(name: str, passes: dict[str, type[Pass]]) -> RewriteRule:
    """The rule called `name` among registered rewrite passes (or a pass with one rule)."""
    rules: dict[str, RewriteRule] = {}
    for cls in passes.values():
        for r in getattr(cls, "rules", ()):
            rules.setdefault(r.name, r)
    if name in rules:
        return rules[name]
    cls = passes.get(name)
    if cls is not None and len(getattr(cls, "rules", ())) == 1:
        return cls.rules[0]  # type: ignore[attr-defined]
    import difflib

    close = difflib.get_close_matches(name, list(rules), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    from .base import PipelineError

    raise PipelineError(f"unknown rewrite rule {name!r}{hint}; known rules: "
                        f"{', '.join(sorted(rules)) or 'none'}")

