"""Executable coverage: every op of a compiled graph lowers to each executable compile writes.

An artifact's executables each need a lowering of every op in its rank
graphs: `onnxruntime` (cuda inference) an ONNX lowering, `paddle` (the Paddle
inference model, the rank Layers of a multi-rank artifact, the training
recipe) a Paddle one. A lowering is the op's own (`lower_onnx`,
`lower_paddle`, docs/ops.md) or the emitter's table. `check_coverage` runs
before anything is written and, per executable, either keeps it, or leaves it
out with a warning (an op declares the gap in `no_onnx` / `no_paddle` and the
user did not ask for that executable), or refuses in one line naming the op
and the executable. A training artifact is its Paddle recipe: there it always
refuses. compile calls it with the executables of `--emit` (or the target's
default, where a declared gap leaves an executable out with a warning).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ernie_ir.ir import Graph, OpDef
from ernie_ir.ir.registry import LOWERINGS
from ernie_ir.targets.registry import TargetError

LOWERING_OF = {"onnx": "onnx", "onnxruntime": "onnx", "paddle": "paddle", "paddle-inference": "paddle"}
"""The lowering kind each op-lowered executable needs, by executable (`--emit`) or backend name
(fastdeploy is a checkpoint over the rank bytes, not lowered)."""
SKIP_HINT = "leave {exe} out of --emit"
"""How the refusal tells the user to do without an executable."""
_LABEL = {"onnx": "ONNX", "paddle": "Paddle"}


class CoverageError(TargetError):
    """An op has no lowering for an executable the artifact would carry."""


@dataclass(frozen=True)
class Gap:
    """Op `op` (in `nodes` nodes, the first at `scope`) lacks the lowering an executable needs."""

    op: str
    scope: str
    nodes: int
    reason: str | None
    """The op's declared reason (`no_onnx` / `no_paddle`), or None for an undeclared gap."""


def lowers(kind: str) -> Callable[[OpDef], bool]:
    """The test of the emitter of `kind` ("onnx" or "paddle"): does it lower an op?"""
    if kind == "onnx":
        from ernie_ir.backends.onnx.lower import lowers as onnx_lowers

        return onnx_lowers
    from ernie_ir.backends.paddle.layer import lowers as paddle_lowers

    return paddle_lowers


def lowering_status(op: OpDef) -> dict[str, str]:
    """Per lowering kind: "op" (the op's own), "emitter" (the emitter's table), "no: why"
    (a declared gap) or "missing"."""
    status = {}
    for kind in LOWERINGS:
        if op.lowering(kind) is not None:
            status[kind] = "op"
        elif lowers(kind)(op):
            status[kind] = "emitter"
        else:
            why = op.lacks(kind)
            status[kind] = f"no: {why}" if why else "missing"
    return status


def gaps(graphs: Iterable[Graph], kind: str) -> list[Gap]:
    """The ops of `graphs` (rank graphs) without a lowering of `kind`, in graph order."""
    test = lowers(kind)
    lowered: set[str] = set()
    found: dict[str, list[Any]] = {}  # op -> [first scope, nodes, declared reason]
    for g in graphs:
        for node in g:
            if node.op in lowered:
                continue
            entry = found.get(node.op)
            if entry is None:
                if test(node.opdef):
                    lowered.add(node.op)
                    continue
                entry = found[node.op] = [node.scope, 0, node.opdef.lacks(kind)]
            entry[1] += 1
    return [Gap(op, scope or "<root>", n, reason) for op, (scope, n, reason) in found.items()]


def check_coverage(graphs: Sequence[Graph], executables: Sequence[str], *, target: str, mode: str,
                   explicit: Collection[str] = (), warnings: list[str] | None = None) -> list[str]:
    """The executables of `executables` that can be written (names as `--emit` or the manifest's
    backends give them: onnx/onnxruntime, paddle, paddle-inference; others are not op-lowered).

    An op without a lowering an executable needs is refused (CoverageError, one line: the op,
    where, the executable and the fix), unless the op declares the gap (`no_onnx`/`no_paddle`)
    and the user did not ask for that executable (`explicit`): then it is left out, with a
    warning. Training is its Paddle recipe: any op without a Paddle lowering is refused."""
    kept = list(executables)
    notes = warnings if warnings is not None else []
    for exe in executables:
        kind = LOWERING_OF.get(exe)
        found = gaps(graphs, kind) if kind is not None else []
        if not found:
            continue
        if mode == "training" or exe in explicit or any(g.reason is None for g in found):
            raise CoverageError(_refusal([g for g in found if g.reason is None] or found, exe, kind or "",
                                         target, mode))
        kept.remove(exe)
        why = "; ".join(f"op {g.op} has no {_LABEL[kind or '']} lowering ({g.reason})" for g in found)
        others = [e for e in kept if LOWERING_OF.get(e) == "paddle"]
        backends = "interpreter" + (" or paddle" if others else "")
        notes.append(f"no {exe} executable: {why} (first at {found[0].scope}); run the artifact with "
                     f"--backend {backends}")
    return kept


def _refusal(found: list[Gap], exe: str, kind: str, target: str, mode: str) -> str:
    g = found[0]
    nodes = f", {g.nodes} nodes" if g.nodes > 1 else ""
    nodes += f"; {g.reason}" if g.reason else ""
    more = f" (and op(s) {', '.join(x.op for x in found[1:])})" if len(found) > 1 else ""
    what = f"the {exe} executable of the {target} {mode} artifact"
    if mode == "training":
        return (f"op {g.op!r} (at {g.scope}{nodes}) has no Paddle lowering{more}, so {what} could not "
                f"run: give the op a lower_paddle (docs/ops.md)")
    return (f"op {g.op!r} (at {g.scope}{nodes}) has no {_LABEL[kind]} lowering{more}, which {what} "
            f"needs: give the op a lower_{kind} (docs/ops.md) or {SKIP_HINT.format(exe=exe)}")
