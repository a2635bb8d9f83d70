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
  allows (dtype, rank, param or not, single use, optional, a constant value,
  a predicate). Keyword arguments constrain attributes (a value, a predicate,
  or `op.attr("name")` to bind it); `_scope="*.mlp.*"` (glob) or
  `_scope="re:..."` (regex, full match) constrains the node's scope;
  `_single_use=True` requires the result to have one reader; `_outputs=n`
  names the results of a multi-result op. `op.either(a, b, _tag="t")` is an
  input matching the first alternative that matches.
- A pattern may return several values. When they are not all reached from
  the first (e.g. three linears sharing one input) the rule is multi-root:
  further roots are searched near what is matched, a match whose roots
  depend on each other is refused with a reason, and the replacement goes
  before the last matched node, readers between the roots moved after it.
- `check(ctx, **bindings)` returns `ctx.ok()` or `ctx.fail("why", *values)`.
- `rewrite(op, **bindings)` builds the replacement with a GraphBuilder
  positioned before the root (or the last matched node), under the root's
  scope, and returns the new value(s), one per pattern output.

`RuleSet.apply` rewrites to a fixed point; `RuleSet.find` only reports
matches; `explain` reports, for each rule, matches and the best partial
match (the attempt that matched most pattern nodes) with the reason it
failed. `rewrite_pass` makes a pass of rules, or of a function of the
pass's options returning rules. docs/pass-authoring.md is the reference.
"""

from __future__ import annotations

import fnmatch
import heapq
import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import ValidationError

from ernie_ir.ir import DType, Graph, GraphBuilder, Node, Param, Value, get_op, has_op

from .base import NoOptions, Pass, PassContext, PassOptions
from .pipeline_syntax import PipelineError

_UNBOUND: Any = object()

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
        self.value: Any = _UNBOUND

    def where(self, *, dtype: DType | None = None, rank: int | None = None,
              param: bool | None = None, single_use: bool | None = None,
              optional: bool | None = None,
              predicate: Callable[[Value], bool] | None = None,
              value: Any = _UNBOUND) -> PatternValue:
        """Add constraints (returns self, for use inside expressions).

        `value` makes the variable a constant: it matches a param with data whose every
        element equals `value` (a number, or an array it broadcasts to).
        """
        if value is not _UNBOUND:
            self.value = value
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
        if self.value is not _UNBOUND:
            why = _constant_failure(v, self.value)
            if why:
                return f"{self.describe()} must be the constant {_show(self.value)} ({why})"
        if self.predicate is not None and not self.predicate(v):
            return f"{self.describe()} fails its predicate"
        return None


def _show(value: Any) -> str:
    arr = np.asarray(value)
    return repr(arr.item()) if arr.ndim == 0 else f"array{list(arr.shape)}"


def _constant_failure(v: Value, want: Any) -> str:
    """Why `v` is not a constant equal to `want` everywhere ("" when it is)."""
    if not isinstance(v, Param):
        return "found a value that is not a param"
    if not v.has_data:
        return f"@{v.name} has no data"
    want_arr = np.asarray(want)
    try:
        target = np.broadcast_to(want_arr, v.read().shape)
    except ValueError:
        return f"@{v.name} has shape {list(v.type.shape)}"
    if not np.array_equal(v.read(), target):
        return f"@{v.name} holds other values"
    return ""


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


class Either(PatternValue):
    """Alternatives: matches the first of several sub-patterns that matches, in order.

    Variables that only some alternatives use are bound to None when another one
    matched; `tag` (if given) binds the index of the alternative that matched.
    """

    def __init__(self, alternatives: Sequence[PatternValue], tag: str | None) -> None:
        super().__init__()
        if len(alternatives) < 2:
            raise TypeError("either() needs at least two alternatives")
        if not all(isinstance(a, PatternValue) for a in alternatives):
            raise TypeError("either() takes pattern values (variables or op results)")
        self.alternatives = list(alternatives)
        self.tag = tag
        names: dict[str, None] = {}
        for a in self.alternatives:
            names.update(dict.fromkeys(_var_names(a)))
        self.var_names = list(names)

    def describe(self) -> str:
        return "either " + " or ".join(a.describe() for a in self.alternatives)


def _var_names(pv: PatternValue | None) -> list[str]:
    """Variables a pattern value mentions, in first-seen order."""
    found: dict[str, None] = {}
    stack: list[PatternValue | None] = [pv]
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, Var):
            found[v.name] = None
        elif isinstance(v, Either):
            stack.extend(reversed(v.alternatives))
        elif isinstance(v, PatternOutput):
            stack.extend(reversed(v.node.inputs))
    return list(found)


class PatternBuilder:
    """`op.<name>(inputs..., **attr_constraints)` builds pattern nodes, like GraphBuilder."""

    def attr(self, name: str) -> AttrVar:
        """Bind an attribute's value to `name` (passed to check and rewrite)."""
        return AttrVar(name)

    def either(self, *alternatives: PatternValue, _tag: str | None = None) -> Either:
        """Match the first alternative that matches (in order); `_tag` binds its index."""
        return Either(alternatives, _tag)

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
    __slots__ = ("bindings", "depth", "node_map")

    def __init__(self) -> None:
        self.bindings: dict[str, Any] = {}
        self.node_map: dict[PatternNode, Node] = {}
        self.depth = 0  # pattern nodes matched by the attempt in progress (or that failed)

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
                raise TypeError(f"rule {self.name}: pattern must return op results (put "
                                "alternatives at an input, or write one rule per root op)")
            nodes: set[PatternNode] = set()
            for o in outs:
                nodes |= _pattern_nodes(o)
            self._compiled = (outs, len(nodes))
        return self._compiled

    @property
    def root_op(self) -> str:
        return self.compiled()[0][0].node.op

    @property
    def size(self) -> int:
        """Number of nodes in the pattern (with alternatives: in its largest alternative)."""
        return self.compiled()[1]

    def __repr__(self) -> str:
        return f"<RewriteRule {self.name}>"

    # -- matching ------------------------------------------------------------------------

    def try_match(self, node: Node) -> tuple[Match | None, int, str]:
        """Match with `node` as the root. Returns (match, nodes matched, failure reason).

        On failure, the count and the reason are those of the attempt that got deepest
        (over commuted inputs, alternatives and candidate nodes for further roots).
        """
        outs, total = self.compiled()
        state = _State()
        try:
            self._match_output(outs[0], node.outputs[0] if len(node.outputs) == 1 else None,
                               node, state)
            m = self._match_roots(outs, 1, state) if len(outs) > 1 else self._complete(outs, state)
        except _Fail as f:
            return None, state.depth, f.reason
        return m, total, ""

    def _match_roots(self, outs: list[PatternOutput], k: int, state: _State) -> Match:
        """Match outputs k.. (further roots), backtracking over their candidate nodes."""
        if k == len(outs):
            return self._complete(outs, state)
        po = outs[k]
        mapped = state.node_map.get(po.node)
        if mapped is not None:  # another result of a node already matched (e.g. a split)
            self._match_output(po, None, mapped, state)
            return self._match_roots(outs, k + 1, state)
        candidates = self._root_candidates(po, state)
        if not candidates:
            raise _Fail(f"no {po.node.op} reads the values bound so far")
        best: _Fail | None = None
        best_depth = -1
        for cand in candidates:
            snap = state.snapshot()
            try:
                self._match_output(po, None, cand, state)
                return self._match_roots(outs, k + 1, state)
            except _Fail as f:
                if state.depth > best_depth:
                    best, best_depth = f, state.depth
                state.restore(snap)
        assert best is not None
        state.depth = best_depth
        raise best

    def _complete(self, outs: list[PatternOutput], state: _State) -> Match:
        """Checks on a full match: escaping values, independent roots, the rule's check."""
        state.depth = self.compiled()[1]
        node_map = state.node_map
        matched = list(dict.fromkeys([node_map[o.node] for o in outs] + list(node_map.values())))
        out_values = [state.node_map[o.node].outputs[o.index] for o in outs]
        reason = self._interior_escapes(matched, out_values)
        if not reason and len(outs) > 1:
            reason = _root_dependency(matched, state.bindings)
        if reason:
            raise _Fail(reason)
        m = Match(self, matched, dict(state.bindings), out_values)
        result = self.check(MatchContext(m), **m.bindings)
        if isinstance(result, bool):
            result = MatchResult(result, "" if result else "check() refused (no reason given)")
        if not result:
            raise _Fail(f"check: {result.reason}")
        return m

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
                     site: tuple[Node, int]) -> None:
        """Match input `site` = (node, input index), whose value is `value`, against `pv`."""
        if pv is None:
            if value is not None:
                raise _Fail(f"{_site(site)} is present but the pattern has none")
            return
        if value is None:
            if pv.optional:
                for name in _var_names(pv):
                    state.bindings.setdefault(name, None)
                return
            raise _Fail(f"{_site(site)} is absent but the pattern needs {pv.describe()}")
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
        if not isinstance(pv, PatternOutput):
            assert isinstance(pv, Either)
            self._match_either(pv, value, state, site)
            return
        producer = value.producer
        if producer is None:
            kind = f"param @{value.name}" if isinstance(value, Param) else f"graph input {value.name}"
            raise _Fail(f"{_site(site)}: expected {pv.describe()}, found {kind}")
        if value.index != pv.index:
            raise _Fail(f"{_site(site)}: expected result {pv.index} of {pv.node.op}, found result "
                        f"{value.index}")
        self._match_node(pv.node, producer, state)
        why = pv.constraint_failure(value)
        if why:
            raise _Fail(why)

    def _match_either(self, pv: Either, value: Value, state: _State, site: tuple[Node, int]) -> None:
        best: _Fail | None = None
        best_depth = -1
        for i, alt in enumerate(pv.alternatives):
            snap = state.snapshot()
            try:
                self._match_value(alt, value, state, site)
                why = pv.constraint_failure(value)
                if why:
                    raise _Fail(why)
            except _Fail as f:
                if state.depth > best_depth:
                    best, best_depth = f, state.depth
                state.restore(snap)
                continue
            for name in pv.var_names:
                state.bindings.setdefault(name, None)
            if pv.tag is not None:
                bound = state.bindings.get(pv.tag, _UNBOUND)
                if bound is not _UNBOUND and bound != i:
                    raise _Fail(f"{_site(site)}: alternative {i} matched but {pv.tag} is {bound}")
                state.bindings[pv.tag] = i
            return
        assert best is not None
        state.depth = best_depth
        raise _Fail(f"no alternative matches; the closest: {best.reason}")

    def _match_node(self, pn: PatternNode, node: Node, state: _State) -> None:
        mapped = state.node_map.get(pn)
        if mapped is not None:
            if mapped is not node:
                raise _Fail(f"one {pn.op} in the pattern would match two nodes")
            return
        if node in state.node_map.values():
            raise _Fail(f"{node.op} at {node.scope} would match two pattern nodes")
        # Messages name the node as `op at scope`; built only on failure (this is hot).
        if node.op != pn.op:
            raise _Fail(f"expected {pn.op}, found {_where_node(node)}")
        if pn.scope is not None and not pn.scope_matches(node.scope):
            raise _Fail(f"{_where_node(node)}: scope does not match {pn.scope!r}")
        for key, want in pn.attrs.items():
            have = getattr(node.attrs, key)
            if isinstance(want, AttrVar):
                bound = state.bindings.get(want.name, _UNBOUND)
                if bound is not _UNBOUND and bound != have:
                    raise _Fail(f"{_where_node(node)}: attribute {key}={have!r} differs from "
                                f"{want.name}={bound!r}")
                state.bindings[want.name] = have
            elif callable(want) and not isinstance(want, (DType, type)):
                if not want(have):
                    raise _Fail(f"{_where_node(node)}: attribute {key}={have!r} fails its predicate")
            elif _norm(want) != _norm(have):
                raise _Fail(f"{_where_node(node)}: attribute {key} is {have!r}, pattern wants {want!r}")
        state.node_map[pn] = node
        state.depth += 1
        n = max(len(pn.inputs), len(node.inputs))
        if not (self.commute and pn.op in ("add", "mul") and n == 2):
            # One order: a failure propagates, and whoever tries something else restores.
            for i in range(n):
                self._match_value(pn.inputs[i] if i < len(pn.inputs) else None,
                                  node.inputs[i] if i < len(node.inputs) else None, state, (node, i))
            return
        orders = ((0, 1), (1, 0))
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
                    self._match_value(pv, v, state, (node, j))
                return
            except _Fail as f:
                if state.depth > best_depth:
                    best_fail, best_depth = f, state.depth
                state.restore(snap)
        assert best_fail is not None
        state.depth = best_depth
        raise best_fail

    def _root_candidates(self, po: PatternOutput, state: _State) -> list[Node]:
        """Nodes that may match a further pattern output: nodes of its op reachable from the
        values bound so far within as many steps as its sub-pattern is deep."""
        taken = set(state.node_map.values())
        known: list[Value] = [v for v in state.bindings.values() if isinstance(v, Value)]
        for n in taken:
            known.extend(v for v in n.inputs if v is not None)
            known.extend(n.outputs)
        candidates: dict[Node, None] = {}
        frontier = list(dict.fromkeys(known))
        seen: set[Node] = set(taken)
        for _ in range(_pattern_depth(po)):
            nxt: list[Value] = []
            for v in frontier:
                for user, _i in v.uses:
                    if user in seen:
                        continue
                    seen.add(user)
                    if user.op == po.node.op:
                        candidates[user] = None
                    nxt.extend(user.outputs)
            frontier = nxt
        return list(candidates)

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

    def apply_match(self, graph: Graph, m: Match) -> list[Node]:
        """Replace the matched outputs with what `rewrite` builds; erase dead matched nodes.

        The replacement of a one-root pattern goes right before the root, after every value
        the pattern read. Of a multi-root pattern it goes right before the last matched node
        (after every value any root reads); readers of the replaced results that sat between
        the roots move after it, keeping their order (the roots are independent, checked when
        matching, so such an order exists). Returns the nodes created.
        """
        multi = len(m.outputs) > 1
        span = _span(m.nodes) if multi else [m.nodes[0]]
        anchor = span[-1]
        start = span[0].prev  # outside the match: stays while matched nodes are erased
        b = GraphBuilder(graph)
        b.insert_point = anchor
        before = anchor.prev
        with b.at_scope(m.nodes[0].scope):
            new = self.rewrite(b, **m.bindings)
        created: list[Node] = []
        node = anchor.prev
        while node is not None and node is not before:
            created.append(node)
            node = node.prev
        created.reverse()
        new_values = list(new) if isinstance(new, (tuple, list)) else [new]
        if len(new_values) != len(m.outputs):
            raise TypeError(f"rule {self.name}: rewrite returned {len(new_values)} values for "
                            f"{len(m.outputs)} pattern outputs")
        for old, nv in zip(m.outputs, new_values, strict=True):
            if old.type != nv.type:
                raise TypeError(f"rule {self.name}: rewrite changes a type ({old.type} -> {nv.type})")
            graph.replace_all_uses_with(old, nv)
        end = anchor.next
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
        if multi:
            _restore_order(graph, start, end, self.name)
        return created


def _pattern_nodes(pv: PatternValue | None) -> set[PatternNode]:
    """Pattern nodes under a value; of alternatives, those of the largest."""
    if isinstance(pv, Either):
        return max((_pattern_nodes(a) for a in pv.alternatives), key=len)
    if not isinstance(pv, PatternOutput):
        return set()
    nodes = {pv.node}
    for i in pv.node.inputs:
        nodes |= _pattern_nodes(i)
    return nodes


def _pattern_depth(pv: PatternValue | None) -> int:
    """Pattern nodes on the longest path from a value down to a variable."""
    if isinstance(pv, Either):
        return max(_pattern_depth(a) for a in pv.alternatives)
    if not isinstance(pv, PatternOutput):
        return 0
    return 1 + max((_pattern_depth(i) for i in pv.node.inputs), default=0)


def _where_node(n: Node) -> str:
    return f"{n.op}{' at ' + n.scope if n.scope else ''}"


def _site(site: tuple[Node, int]) -> str:
    node, j = site
    return f"{_where_node(node)}: input {node.opdef.input_name(j)}"


def _span(nodes: Sequence[Node]) -> list[Node]:
    """The graph's nodes from the first matched node to the last, in order.

    Walks both ways from the root until every matched node is seen, so the cost is the
    distance between the matched nodes, not the size of the graph.
    """
    root = nodes[0]
    left = set(nodes) - {root}
    back: list[Node] = []
    fwd: list[Node] = []
    b, f = root.prev, root.next
    while left:
        if b is None and f is None:
            raise ValueError("matched nodes are not all in the root's graph")
        if b is not None:
            back.append(b)
            left.discard(b)
            b = b.prev
        if f is not None:
            fwd.append(f)
            left.discard(f)
            f = f.next
    seq = [*reversed(back), root, *fwd]
    inside = set(nodes)
    first = next(i for i, n in enumerate(seq) if n in inside)
    last = max(i for i, n in enumerate(seq) if n in inside)
    return seq[first:last + 1]


def _root_dependency(nodes: list[Node], bindings: dict[str, Any]) -> str:
    """Why the roots of a multi-root match depend on each other ("" when they do not).

    One replacement stands for all roots, so it must not read what one of them computes:
    neither directly (a variable bound to a matched node's result) nor through nodes
    outside the match. Such a path lies between the first and the last matched node,
    so the search is bounded by that span.
    """
    inside = set(nodes)
    names = {id(v): k for k, v in bindings.items() if isinstance(v, Value)}
    for n in nodes:
        for v in n.inputs:
            if v is not None and id(v) in names and v.producer in inside:
                assert v.producer is not None
                return (f"the roots depend on each other: {_where_node(n)} reads the result of "
                        f"{_where_node(v.producer)} (as {names[id(v)]}), which the match replaces")
    span = set(_span(nodes))
    stack: list[tuple[Node, Node]] = []
    for n in nodes:
        for v in n.inputs:
            if v is not None and v.producer is not None and v.producer not in inside:
                stack.append((v.producer, n))
    seen: set[Node] = set()
    while stack:
        p, reader = stack.pop()
        if p in seen or p not in span:  # outside the span: before every matched node
            continue
        seen.add(p)
        for v in p.inputs:
            q = v.producer if v is not None else None
            if q is None:
                continue
            if q in inside:
                return (f"the roots depend on each other: the result of {_where_node(q)} reaches "
                        f"{_where_node(reader)} through {_where_node(p)}")
            stack.append((q, reader))
    return ""


def _restore_order(graph: Graph, start: Node | None, end: Node | None, rule: str) -> None:
    """Reorder the nodes strictly between `start` and `end` (None: the graph's ends) so each
    reads only values defined before it, moving as few as possible (a stable order)."""
    segment: list[Node] = []
    node = start.next if start is not None else graph.first
    while node is not None and node is not end:
        segment.append(node)
        node = node.next
    members = set(segment)
    defined: set[Node] = set()
    for n in segment:
        if any(v is not None and v.producer in members and v.producer not in defined
               for v in n.inputs):
            break
        defined.add(n)
    else:
        return  # already in order: the common case
    pos = {n: i for i, n in enumerate(segment)}
    waiting = {n: len({v.producer for v in n.inputs if v is not None and v.producer in members})
               for n in segment}
    heap = [(pos[n], n) for n in segment if waiting[n] == 0]
    heapq.heapify(heap)
    order: list[Node] = []
    while heap:
        _, n = heapq.heappop(heap)
        order.append(n)
        for user in dict.fromkeys(u for v in n.outputs for u, _ in v.uses):
            if user in members:
                waiting[user] -= 1
                if waiting[user] == 0:
                    heapq.heappush(heap, (pos[user], user))
    if len(order) != len(segment):
        raise RuntimeError(f"rule {rule}: the rewrite made a cycle (a bug in the rule's rewrite)")
    graph.move_after(start, order)


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
        """All matches in the current graph, without rewriting.

        A multi-root match found again from another of its roots is reported once.
        """
        found = []
        seen: set[tuple[int, frozenset[Node]]] = set()
        for node in graph:
            for rule in self._by_root.get(node.op, ()):
                m, _, _ = rule.try_match(node)
                if m is not None and not _seen_before(m, seen):
                    found.append(m)
        return found

    def apply(self, graph: Graph, ctx: PassContext | None = None, *, max_sweeps: int = 100) -> int:
        """Rewrite until no rule matches; returns the number of rewrites."""
        total = 0
        for _ in range(max_sweeps):
            changed = 0
            node = graph.first
            while node is not None:
                nxt = node.next
                for rule in self._by_root.get(node.op, ()):
                    m, _, _ = rule.try_match(node)
                    if m is None:
                        continue
                    rule.apply_match(graph, m)
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
            seen: set[tuple[int, frozenset[Node]]] = set()
            for node in graph:
                if node.op != rule.root_op:
                    continue
                t.candidates += 1
                m, depth, reason = rule.try_match(node)
                if m is not None:
                    t.matches += 0 if _seen_before(m, seen) else 1
                elif t.best is None or depth > t.best.matched:
                    t.best = RuleAttempt(node, depth, rule.size, reason)
            if t.matches:
                t.best = None
            traces.append(t)
        return traces


def _seen_before(m: Match, seen: set[tuple[int, frozenset[Node]]]) -> bool:
    """Whether this multi-root match (the same nodes, by the same rule) was already found."""
    if len(m.outputs) < 2:
        return False
    key = (id(m.rule), frozenset(m.nodes))
    if key in seen:
        return True
    seen.add(key)
    return False


# -- rules as passes -------------------------------------------------------------------------


class RewritePass(Pass):
    """A pass that applies rules to a fixed point. Subclass and set name/description/rules,
    or `rule_factory` (options -> rules) for rules that depend on the pass's options."""

    rules: ClassVar[Sequence[RewriteRule]] = ()
    """The rules (of a factory: those for the default options, for `explain` and listings)."""
    rule_factory: ClassVar[Callable[[Any], Sequence[RewriteRule]] | None] = None
    Options = NoOptions

    def active_rules(self) -> Sequence[RewriteRule]:
        """The rules this pass runs with its options."""
        factory = type(self).rule_factory
        return self.rules if factory is None else list(factory(self.options))

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        return RuleSet(self.active_rules()).apply(graph, ctx) > 0


RuleSource = Sequence[RewriteRule] | Callable[[Any], Sequence[RewriteRule]]


def rewrite_pass(name: str, description: str, rules: RuleSource, *,
                 options: type[PassOptions] = NoOptions,
                 requires: tuple[str, ...] = (), produces: tuple[str, ...] = (),
                 invalidates: tuple[str, ...] = ()) -> type[Pass]:
    """Make a Pass class from rules (register it with `register_pass`).

    `rules` is a sequence of rules, or a function of the pass's options (an instance of
    `options`, a PassOptions model) returning them: `rewrite_pass("fold", "...",
    lambda o: [Fold(o.threshold)], options=FoldOptions)`. `requires`, `produces` and
    `invalidates` are graph properties, as for any pass.
    """
    factory: Callable[[Any], Sequence[RewriteRule]] | None = None
    if callable(rules) and not isinstance(rules, (list, tuple)):
        factory = rules
        try:
            default_rules: tuple[RewriteRule, ...] = tuple(factory(options()))
        except (ValidationError, TypeError):  # options without defaults: none until given
            default_rules = ()
    else:
        default_rules = tuple(rules)
    for r in default_rules:
        if not isinstance(r, RewriteRule):
            raise TypeError(f"rewrite pass {name}: {r!r} is not a RewriteRule")
    return type(
        "".join(part.capitalize() for part in name.split("-")) + "Pass",
        (RewritePass,),
        {
            "name": name,
            "description": description,
            "rules": default_rules,
            "rule_factory": staticmethod(factory) if factory is not None else None,
            "Options": options,
            "requires": frozenset(requires),
            "produces": frozenset(produces),
            "invalidates": frozenset(invalidates),
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
    from ernie_ir.ir.suggest import did_you_mean

    hint = did_you_mean(name, rules, n=3)
    raise PipelineError(f"unknown rewrite rule {name!r}{hint}; known rules: "
                        f"{', '.join(sorted(rules)) or 'none'}")

