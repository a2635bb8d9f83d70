"""Executable coverage: every op of a compiled graph lowers to each executable compile writes.

An artifact's executables each need a lowering of every op in its rank
graphs: `onnxruntime` (cuda inference) an ONNX lowering, `paddle` (the Paddle
inference model, the rank Layers of a multi-rank artifact, the training
recipe) a Paddle one. A lowering is the op's own (`lower_onnx`,
`lower_paddle`, docs/ops.md) or the emitter's table. `apply_coverage` runs
before anything is written and, per executable, either keeps it, or drops it
with a warning (the user skipped it, or an op declares the gap in
`no_onnx` / `no_paddle` with its reason), or refuses in one line naming the op and the
executable. A training artifact is its Paddle recipe: there it always refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ernie_ir.ir import Graph, OpDef
from ernie_ir.ir.registry import LOWERINGS

from .registry import TargetError

LOWERING_OF = {"onnxruntime": "onnx", "paddle": "paddle"}
"""The lowering kind each op-lowered executable needs (fastdeploy is a checkpoint, not lowered)."""
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
        from .emit_onnx import lowers as onnx_lowers

        return onnx_lowers
    from ernie_ir.runtime.paddle_layer import lowers as paddle_lowers

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
    found: dict[str, list[Any]] = {}
    for g in graphs:
        for node in g:
            if node.op in found or not test(node.opdef):
                entry = found.setdefault(node.op, [node.scope, 0, node.opdef.lacks(kind)])
                entry[1] += 1
    return [Gap(op, scope or "<root>", n, reason) for op, (scope, n, reason) in found.items()]


def check_skips(skip: Sequence[str], mode: str) -> list[str]:
    """The executables named by --skip-executable, checked (one line for a bad name)."""
    names = [s.strip().lower() for s in skip if s.strip()]
    for name in names:
        if name not in LOWERING_OF:
            raise CoverageError(f"unknown --skip-executable {name!r}: choose one of {', '.join(LOWERING_OF)}")
        if name == "paddle" and mode == "training":
            raise CoverageError("--skip-executable paddle: a training artifact is its Paddle recipe, so "
                                "nothing would be left to train; drop it")
    return names


def apply_coverage(graphs: Sequence[Graph], emitters: dict[str, Any], *, target: str, mode: str,
                   skip: Sequence[str] = (), warnings: list[str] | None = None) -> dict[str, Any]:
    """`emitters` less the executables skipped or declared uncovered (each with a warning).

    CoverageError (one line: the op, where, the executable and the fix) for an op with no
    lowering for an executable the target offers, unless the user skipped it or the op
    declares the gap; in training, for any op without a Paddle lowering."""
    kept = dict(emitters)
    notes = warnings if warnings is not None else []
    skipped = set(check_skips(skip, mode))
    for exe, kind in LOWERING_OF.items():
        if exe not in kept:
            continue
        if exe in skipped:
            del kept[exe]
            notes.append(f"no {exe} executable: skipped by --skip-executable {exe}")
            continue
        found = gaps(graphs, kind)
        if not found:
            continue
        undeclared = [g for g in found if g.reason is None or mode == "training"]
        if undeclared:
            raise CoverageError(_refusal(undeclared, exe, kind, target, mode))
        del kept[exe]
        first = found[0]
        why = "; ".join(f"op {g.op} has no {_LABEL[kind]} lowering ({g.reason})" for g in found)
        backends = "interpreter" + ("" if exe == "paddle" or "paddle" not in kept else " or paddle")
        notes.append(f"no {exe} executable: {why} (first at {first.scope}); run the artifact with "
                     f"--backend {backends}")
    return kept


def _refusal(found: list[Gap], exe: str, kind: str, target: str, mode: str) -> str:
    g = found[0]
    nodes = f", {g.nodes} nodes" if g.nodes > 1 else ""
    more = f" (and op(s) {', '.join(x.op for x in found[1:])})" if len(found) > 1 else ""
    what = f"the {exe} executable of the {target} {mode} artifact"
    if mode == "training":
        return (f"op {g.op!r} (at {g.scope}{nodes}) has no Paddle lowering{more}, so {what} could not "
                f"run: give the op a lower_paddle (docs/ops.md)")
    return (f"op {g.op!r} (at {g.scope}{nodes}) has no {_LABEL[kind]} lowering{more}, which {what} "
            f"needs: give the op a lower_{kind} (docs/ops.md) or pass --skip-executable {exe}")
