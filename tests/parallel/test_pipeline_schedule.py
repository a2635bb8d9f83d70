"""Pipeline schedules (backends/paddle/pipeline_schedule.py): 1F1B / GPipe / forward-only programs.

- `compute_order`: 1F1B's warm-up forwards, each micro-batch's forward before its backward, and
  the activations alive on a stage (at most min(p - s, m) for 1F1B, m for GPipe).
- `schedule`: an independent rendezvous executor (a send and its matching receive run together,
  only when both stages have reached them) runs every program to completion, i.e. the p2p
  placement is deadlock-free; both sides of every edge see the same sequence of p2p calls;
  the compute ops keep `compute_order`'s order; every receive precedes the computation that
  needs it and every send follows the one that makes it; no gradient p2p on an edge without
  gradients.
- `simulated_bubble` against the closed form (p - 1) / (m + p - 1).
- ScheduleError for an unknown schedule and for empty pipelines.
"""

from __future__ import annotations

import pytest

from ernie_ir.backends.paddle.pipeline_schedule import (
    Op,
    ScheduleError,
    bubble_fraction,
    compute_order,
    schedule,
    simulated_bubble,
)

SIZES = [(1, 1), (1, 4), (2, 1), (2, 2), (2, 5), (3, 1), (3, 2), (3, 3), (3, 7), (4, 2), (4, 4), (4, 9),
         (5, 3), (6, 12)]
PAIR = {"send_act": "recv_act", "recv_act": "send_act", "send_grad": "recv_grad", "recv_grad": "send_grad"}


def _alive_peak(ops: list[Op]) -> int:
    alive: set[int] = set()
    peak = 0
    for op in ops:
        if op.kind == "F":
            alive.add(op.mb)
            peak = max(peak, len(alive))
        elif op.kind == "B":
            alive.remove(op.mb)
    assert not alive
    return peak


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_1f1b_compute_order(p: int, m: int) -> None:
    for s in range(p):
        ops = compute_order("1f1b", p, s, m)
        assert sorted((o.kind, o.mb) for o in ops) == sorted([("F", i) for i in range(m)] +
                                                           [("B", i) for i in range(m)])
        assert [o.mb for o in ops if o.kind == "F"] == list(range(m))
        assert [o.mb for o in ops if o.kind == "B"] == list(range(m))
        warmup = min(p - 1 - s, m)
        assert all(o.kind == "F" for o in ops[:warmup])
        # after the warm-up: one forward then one backward while forwards remain, then the drain
        first_b = next(i for i, o in enumerate(ops) if o.kind == "B")
        assert first_b == min(warmup + 1, m)
        steady = ops[warmup:warmup + 2 * (m - warmup)]
        assert [o.kind for o in steady] == ["F", "B"] * (m - warmup)
        assert all(o.kind == "B" for o in ops[warmup + 2 * (m - warmup):])
        for i in range(m):
            assert ops.index(Op("F", i)) < ops.index(Op("B", i))
        peak = _alive_peak(ops)
        assert peak <= min(p - s, m)
        assert peak == min(p - s, m)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_gpipe_and_forward_compute_order(p: int, m: int) -> None:
    for s in range(p):
        ops = compute_order("gpipe", p, s, m)
        assert ops == [Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)]
        assert _alive_peak(ops) == m
        assert compute_order("forward", p, s, m) == [Op("F", i) for i in range(m)]


def _edge_calls(program: list[Op], stage: int, edge: int) -> list[tuple[str, int]]:
    """The p2p calls `stage` makes on the edge between stages `edge` and `edge` + 1, as
    (what travels, micro-batch)."""
    return [(op.kind.split("_")[1], op.mb) for op in program
            if op.is_comm and min(stage, op.peer(stage)) == edge]


def _rendezvous(programs: list[list[Op]]) -> list[list[tuple[str, int]]]:
    """Execute the programs with synchronous p2p: a compute op runs alone; a send and its
    receive run together when both stages are at them. Returns what crossed each edge, in order;
    fails on a deadlock or a mismatched pair."""
    p = len(programs)
    at = [0] * p
    crossed: list[list[tuple[str, int]]] = [[] for _ in range(max(p - 1, 0))]
    while any(at[s] < len(programs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if at[s] == len(programs[s]):
                continue
            op = programs[s][at[s]]
            if not op.is_comm:
                at[s] += 1
                moved = True
                continue
            q = op.peer(s)
            assert 0 <= q < p, f"stage {s} {op} has no peer"
            if at[q] == len(programs[q]):
                continue
            other = programs[q][at[q]]
            if other.kind != PAIR[op.kind] or other.peer(q) != s:
                continue
            assert other.mb == op.mb, f"stage {s} {op} meets stage {q} {other}"
            crossed[min(s, q)].append((op.kind.split("_")[1], op.mb))
            at[s] += 1
            at[q] += 1
            moved = True
        if not moved:
            stuck = {s: str(programs[s][at[s]]) for s in range(p) if at[s] < len(programs[s])}
            raise AssertionError(f"deadlock at {stuck}")
    return crossed


def _grad_cases() -> list[tuple[str, int, int, tuple[bool, ...] | None]]:
    cases: list[tuple[str, int, int, tuple[bool, ...] | None]] = []
    for kind in ("1f1b", "gpipe", "forward"):
        for p, m in SIZES:
            cases.append((kind, p, m, None))
            if p > 1 and kind != "forward":
                cases.append((kind, p, m, (False,) * (p - 1)))
                cases.append((kind, p, m, tuple(e % 2 == 1 for e in range(p - 1))))  # mixed
    return cases


@pytest.mark.parametrize(("kind", "p", "m", "grad_edges"), _grad_cases())
def test_schedule_is_deadlock_free_and_matched(kind: str, p: int, m: int,
                                               grad_edges: tuple[bool, ...] | None) -> None:
    programs = schedule(kind, p, m, grad_edges)  # type: ignore[arg-type]
    assert len(programs) == p
    edges = (False,) * (p - 1) if kind == "forward" else (grad_edges or (True,) * (p - 1))

    crossed = _rendezvous(programs)
    for e in range(p - 1):
        left, right = _edge_calls(programs[e], e, e), _edge_calls(programs[e + 1], e + 1, e)
        assert left == right, f"edge {e}: {left} vs {right}"
        assert crossed[e] == left
        acts = [mb for what, mb in left if what == "act"]
        grads = [mb for what, mb in left if what == "grad"]
        assert acts == list(range(m))
        assert grads == (list(range(m)) if edges[e] else [])

    for s, prog in enumerate(programs):
        assert [op for op in prog if not op.is_comm] == compute_order(kind, p, s, m)  # type: ignore[arg-type]
        pos = {(op.kind, op.mb): i for i, op in enumerate(prog)}
        assert len(pos) == len(prog), "an op appears twice"
        grads_in = s > 0 and edges[s - 1]
        grads_out = s < p - 1 and edges[s]
        for op in prog:
            if op.is_comm:
                assert 0 <= op.peer(s) < p
        for i in range(m):
            f = pos[("F", i)]
            assert (("recv_act", i) in pos) == (s > 0)
            assert (("send_act", i) in pos) == (s < p - 1)
            if s > 0:
                assert pos[("recv_act", i)] < f
            if s < p - 1:
                assert pos[("send_act", i)] > f
            assert (("recv_grad", i) in pos) == grads_out
            assert (("send_grad", i) in pos) == grads_in
            if kind == "forward":
                continue
            b = pos[("B", i)]
            if grads_out:
                assert pos[("recv_grad", i)] < b
            if grads_in:
                assert pos[("send_grad", i)] > b
        if not any(edges):
            assert not any(op.kind in ("send_grad", "recv_grad") for op in prog)


def test_single_stage_has_no_p2p() -> None:
    for kind in ("1f1b", "gpipe", "forward"):
        (prog,) = schedule(kind, 1, 3)  # type: ignore[arg-type]
        assert prog == compute_order(kind, 1, 0, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_simulated_bubble_matches_the_closed_form(kind: str, p: int, m: int) -> None:
    want = (p - 1) / (m + p - 1)
    assert bubble_fraction(p, m) == pytest.approx(want, abs=1e-12)
    assert abs(simulated_bubble(kind, p, m) - want) < 1e-9  # type: ignore[arg-type]
    assert abs(simulated_bubble(kind, p, m, forward=3.0, backward=3.0) - want) < 1e-9  # type: ignore[arg-type]


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_1f1b_bubble_with_a_costlier_backward(p: int, m: int) -> None:
    assert abs(simulated_bubble("1f1b", p, m, forward=1.0, backward=2.0) - (p - 1) / (m + p - 1)) < 1e-9


def test_bubble_shrinks_with_micro_batches() -> None:
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 1) == pytest.approx(0.75)
    values = [simulated_bubble("1f1b", 4, m) for m in (1, 2, 4, 8, 16)]
    assert values == sorted(values, reverse=True) and values[0] > values[-1]


def test_schedule_errors() -> None:
    with pytest.raises(ScheduleError, match="choose 1f1b or gpipe"):
        schedule("interleaved", 2, 2)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="choose 1f1b or gpipe"):
        compute_order("zero-bubble", 2, 0, 2)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=">= 1 stage and micro-batch, got 0 and 2"):
        schedule("1f1b", 0, 2)
    with pytest.raises(ScheduleError, match=">= 1 stage and micro-batch, got 2 and 0"):
        schedule("1f1b", 2, 0)
    with pytest.raises(ScheduleError):
        schedule("gpipe", 0, 0)
