"""Pipeline schedules: which stage runs which micro-batch's forward and backward, in what order,
and where its sends and receives go so that synchronous point-to-point calls never deadlock.

    programs = schedule("1f1b", stages=2, micro_batches=4)   # one op list per stage

1F1B (PipeDream-flush, Megatron's and Paddle fleet's default): stage s runs min(p - 1 - s, m)
warm-up forwards, then alternates one forward and one backward, then drains the backwards; at
most p - s micro-batches' activations are alive on stage s. GPipe: every forward, then every
backward (m micro-batches alive). "forward": the forwards alone (inference, evaluation).

Every call of Paddle's gloo group is synchronous (a send returns when its receive has taken
it), so the order of the p2p calls matters. `schedule` simulates the stages side by side (one
op each per sweep) with rendezvous sends, and emits a send when its receiver waits for it.
Executing the programs in that order is then deadlock-free (every stage's p2p calls are a
subsequence of one global order in which each call meets its peer), and both sides of every
pipeline edge issue their calls in the same order, which Paddle's per-group p2p tags require.

`bubble_fraction` is the idle share of the schedule in unit time slots ((p - 1) / (m + p - 1)
for 1F1B and GPipe with equal forward and backward costs); the runtime measures its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ernie_ir.ir import ErnieIRError

Schedule = Literal["1f1b", "gpipe", "forward"]
SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")
"""The training schedules `--schedule` / the `pipeline_schedule` option take."""

Kind = Literal["F", "B", "send_act", "recv_act", "send_grad", "recv_grad"]


@dataclass(frozen=True)
class Op:
    """One step of a stage's program: a forward / backward of micro-batch `mb`, or a p2p call
    carrying its activations (to the next stage) or gradients (to the previous one)."""

    kind: Kind
    mb: int

    @property
    def is_comm(self) -> bool:
        return self.kind not in ("F", "B")

    def peer(self, stage: int) -> int:
        """The stage at the other end of a p2p call."""
        return stage + 1 if self.kind in ("send_act", "recv_grad") else stage - 1

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


class ScheduleError(ErnieIRError):
    """A pipeline schedule that cannot run (unknown name, bad counts)."""


def compute_order(kind: Schedule, stages: int, stage: int, micro_batches: int) -> list[Op]:
    """The forward / backward order of one stage."""
    m = micro_batches
    if kind == "forward":
        return [Op("F", i) for i in range(m)]
    if kind == "gpipe":
        return [Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)]
    if kind != "1f1b":
        raise ScheduleError(f"pipeline schedule {kind!r}: choose 1f1b or gpipe")
    warmup = min(stages - 1 - stage, m)
    ops = [Op("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [Op("F", warmup + i), Op("B", i)]
    ops += [Op("B", i) for i in range(m - warmup, m)]
    return ops


def _with_comms(ops: list[Op], stage: int, stages: int, grads_in: bool, grads_out: bool) -> list[Op]:
    """`ops` with each receive right before the computation that needs it and each send right
    after the one that makes it. `grads_in`: gradients flow back into this stage's inputs (it
    sends them); `grads_out`: into its outputs (it receives them)."""
    out: list[Op] = []
    for op in ops:
        if op.kind == "F":
            if stage > 0:
                out.append(Op("recv_act", op.mb))
            out.append(op)
            if stage < stages - 1:
                out.append(Op("send_act", op.mb))
        else:
            if stage < stages - 1 and grads_out:
                out.append(Op("recv_grad", op.mb))
            out.append(op)
            if stage > 0 and grads_in:
                out.append(Op("send_grad", op.mb))
    return out


_MATCH = {"recv_act": "send_act", "recv_grad": "send_grad"}


def schedule(kind: Schedule, stages: int, micro_batches: int,
             grad_edges: tuple[bool, ...] | None = None) -> list[list[Op]]:
    """Each stage's program (compute and p2p calls) in a deadlock-free order. `grad_edges[s]`:
    whether gradients cross the edge between stage s and s + 1 (default: every edge)."""
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"a pipeline needs >= 1 stage and micro-batch, got {stages} and {micro_batches}")
    edges = grad_edges if grad_edges is not None else (True,) * (stages - 1)
    if kind == "forward":
        edges = (False,) * (stages - 1)
    wanted = [_with_comms(compute_order(kind, stages, s, micro_batches), s, stages,
                          s > 0 and edges[s - 1], s < stages - 1 and edges[s])
              for s in range(stages)]
    programs: list[list[Op]] = [[] for _ in range(stages)]
    at = [0] * stages
    posted: list[list[Op]] = [[] for _ in range(stages)]  # sends made but not yet taken, in order
    while True:
        moved = False
        for s in range(stages):  # one op per stage per sweep: the stages advance side by side
            if at[s] == len(wanted[s]):
                continue
            op = wanted[s][at[s]]
            if op.kind in ("F", "B"):
                programs[s].append(op)
            elif op.kind in ("send_act", "send_grad"):
                posted[s].append(op)
            else:  # a receive: its sender must have posted the matching send first on this edge
                q = op.peer(s)
                first = next((x for x in posted[q] if x.kind == _MATCH[op.kind]), None)
                if first is None or first.mb != op.mb:
                    continue
                posted[q].remove(first)
                programs[q].append(first)
                programs[s].append(op)
            at[s] += 1
            moved = True
        if all(at[s] == len(wanted[s]) for s in range(stages)):
            if any(posted):
                raise ScheduleError("pipeline schedule: a send has no receive")
            return programs
        if not moved:
            stuck = [str(w[a]) for w, a in zip(wanted, at, strict=True)]
            raise ScheduleError(f"pipeline schedule {kind} deadlocks at {stuck}")


def check_micro_batches(rows: int, micro_batches: int) -> int:
    """Rows per micro-batch; ScheduleError (one line) unless `micro_batches` divides `rows` (a
    batch size; a data file's short final batch is cut into as even micro-batches as it allows)."""
    if micro_batches < 1 or rows % micro_batches:
        ok = [d for d in range(1, rows + 1) if rows % d == 0]
        raise ScheduleError(f"--micro-batches {micro_batches} does not divide the batch of {rows} row(s): "
                            f"use one of {ok} (or change --batch-size)")
    return rows // micro_batches


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of a 1F1B / GPipe step with equal per-micro-batch costs: (p-1) / (m+p-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def simulated_bubble(kind: Schedule, stages: int, micro_batches: int, forward: float = 1.0,
                     backward: float = 1.0) -> float:
    """The idle share of the schedule in a timed simulation (each forward `forward` time units,
    each backward `backward`, p2p free): 1 - busy / (stages x makespan)."""
    progs = [compute_order(kind, stages, s, micro_batches) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * stages
    at = [0] * stages
    while any(at[s] < len(progs[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while at[s] < len(progs[s]):
                op = progs[s][at[s]]
                if op.kind == "F":
                    dep = done.get(("F", s - 1, op.mb)) if s > 0 else 0.0
                else:
                    dep = (done.get(("B", s + 1, op.mb)) if s < stages - 1
                           else done.get(("F", s, op.mb)))
                if dep is None:
                    break
                start = max(clock[s], dep)
                clock[s] = start + (forward if op.kind == "F" else backward)
                done[(op.kind, s, op.mb)] = clock[s]
                at[s] += 1
                moved = True
        if not moved:
            raise ScheduleError(f"pipeline schedule {kind} cannot progress")
    span = max(clock)
    busy = sum(len(p) for p in progs) / 2 * (forward + backward) if kind != "forward" else \
        stages * micro_batches * forward
    return 1.0 - busy / (stages * span)
