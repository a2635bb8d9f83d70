"""Pipeline parallelism on paddle.distributed: one process's stage of a pipelined artifact.

Process g of `pp x world` runs rank graph g: stage `g // world` of model-parallel rank
`g % world` (ernie_ir.ir.mapping). `pipeline_groups` makes the groups (with the one helper of
ernie_ir.backends.paddle.groups): the tensor-parallel group of each stage (the stage graph's
collectives), one 2-rank group per pipeline edge and model-parallel rank (Paddle's gloo p2p tags
count per group, so each edge gets its own), the group of each model-parallel rank's stages
(the loss and the gradient norm) and of its first and last stage (`TiedWeights`: a trained tied
embedding, held by both ends, has its two gradients summed before each optimizer step).

`PipelineStage.run` executes one batch under a schedule (ernie_ir.backends.paddle.pipeline_schedule):
the batch's rows cut into micro-batches; forwards on the stage's Paddle Layer; activations sent
to the next stage and gradients of the received activations sent back, each tensor preceded by
a small header (dtype and shape: a stage cannot know the next one's symbolic shapes); the loss
(the same token-sum cross-entropy as one rank, vocabulary-parallel when the Layer keeps its
shard) on the last stage, scaled by the step's target-token count so that the accumulated
gradients are the one-rank step's; the step's loss sum broadcast from the last stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ernie_ir.backends.paddle.pipeline_schedule import Op, Schedule, schedule
from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.mapping import stage_info

_DTYPES = ("float32", "int64", "int32", "float64", "int8", "uint8")
_HEADER = 10  # dtype code, rank, up to 8 dims


LossSum = Callable[..., tuple[Any, Any]]
"""(paddle, logits, labels, ignore_index, vocab_shard, world_size) -> (loss sum, token count)."""


class PipelineStageError(ErnieIRError):
    """A rank graph that is not the stage its process runs."""


@dataclass
class PipelineGroups:
    """This process's place in the pipeline and the groups its calls use."""

    stage: int
    stages: int
    mp_rank: int
    world: int
    mp: Any = None
    """The stage's tensor-parallel group (None: one rank)."""
    prev: Any = None
    """The edge group to the previous stage (None on the first)."""
    next: Any = None
    """The edge group to the next stage (None on the last)."""
    ring: Any = None
    """This model-parallel rank's stages (the loss broadcast, the gradient norm's sum)."""
    ends: Any = None
    """This model-parallel rank's first and last stage (a tied embedding's gradient sum); None
    on the stages between."""

    def process(self, stage: int) -> int:
        """The global rank of `stage`'s process at this model-parallel rank."""
        return stage * self.world + self.mp_rank


def pipeline_groups(process: int, stages: int, world: int) -> PipelineGroups:
    """The groups of process `process` (ernie_ir.backends.paddle.groups: every process creates
    every group of `pipeline_group_ranks`, in the same order, each followed by a barrier)."""
    from ernie_ir.backends.paddle.groups import create_groups, pipeline_group_ranks

    stage, mp_rank = divmod(process, world)
    mine = create_groups(process, pipeline_group_ranks(stages, world))
    out = PipelineGroups(stage, stages, mp_rank, world, mp=mine.get(("mp", stage)),
                         prev=mine.get(("edge", stage - 1, mp_rank)), next=mine.get(("edge", stage, mp_rank)),
                         ring=mine.get(("ring", mp_rank)), ends=mine.get(("ends", mp_rank)))
    if stages == 2:
        out.ring = out.ends = out.next if stage == 0 else out.prev
    return out


@dataclass(frozen=True)
class TiedWeights:
    """The trainable weights this stage shares with the other end of the pipeline (a tied
    embedding: the embedding reads it on the first stage, lm_head on the last). Megatron's
    shared-weight all-reduce: after the backward, before the clip and the optimizer step, each
    end's gradient is summed over `group` (the two stages of this model-parallel rank), so both
    copies take the one-rank gradient and the same update; the global norm counts the weight on
    the first stage only (`counted`)."""

    names: tuple[str, ...]
    """IR names, sorted (the order of the all-reduces on both ends)."""
    group: Any
    counted: bool

    def sum(self, paddle: Any, layer: Any, grads: dict[str, Any]) -> None:
        """Replace each tied weight's gradient in `grads` (by Paddle name) with the sum over the
        two ends (zeros for a missing one: both ends join every all-reduce)."""
        import paddle.distributed as dist

        for name in self.names:
            t = layer.tensor(name)
            g = grads.get(t.name)
            total = paddle.zeros(t.shape, "float32") if g is None else g.astype("float32").clone()
            dist.all_reduce(total, group=self.group)
            grads[t.name] = total if g is None else total.astype(g.dtype)

    def uncounted(self, layer: Any) -> set[str]:
        """Paddle names of the weights whose norm term the other end counts."""
        return set() if self.counted else {layer.tensor(n).name for n in self.names}


def tied_weights(graph: Graph, groups: PipelineGroups) -> TiedWeights | None:
    """The tied weights of this stage's graph (the trainable params the cut found on the first
    and the last stage: `tied`); None when there are none (or the stage is a middle one)."""
    info = stage_info(graph.metadata) or {}
    names = tuple(sorted(info.get("tied", [])))
    if not names or groups.ends is None:
        return None
    return TiedWeights(names, groups.ends, counted=groups.stage == 0)


@dataclass
class StepTiming:
    """Wall-clock seconds of the last `run`: the whole schedule and the stage's own compute."""

    total_s: float = 0.0
    compute_s: float = 0.0
    peak_in_flight: int = 0

    @property
    def idle_fraction(self) -> float:
        return 0.0 if self.total_s <= 0 else max(0.0, 1.0 - self.compute_s / self.total_s)


@dataclass
class PipelineStage:
    """One stage's Layer and how to run a batch through the pipeline."""

    paddle: Any
    layer: Any
    graph: Graph
    groups: PipelineGroups
    micro_batches: int
    kind: Schedule = "1f1b"
    ignore_index: int = -100
    timing: StepTiming = field(default_factory=StepTiming)
    history: list[StepTiming] = field(default_factory=list)
    """The timing of every training batch run so far."""
    loss_sum: LossSum | None = None
    """The last stage's loss of a micro-batch (training's `logits_loss_sum`); None: no labels."""

    def __post_init__(self) -> None:
        info = stage_info(self.graph.metadata)
        if info is None or int(info["stage"]) != self.groups.stage or int(info["pp"]) != self.groups.stages:
            raise PipelineStageError(f"{self.graph.name}: not stage {self.groups.stage} of "
                                     f"{self.groups.stages}: recompile the artifact with --pp")
        self.inputs = [v.name for v in self.graph.inputs]
        self.needs_grad = set(info.get("needs_grad", []))
        self.outputs_need_grad = list(info.get("outputs_need_grad", []))
        self.first = self.groups.stage == 0
        self.last = self.groups.stage == self.groups.stages - 1

    # -- p2p ----------------------------------------------------------------------------------

    def _send(self, tensors: list[Any], stage: int, group: Any) -> None:
        import paddle.distributed as dist

        paddle = self.paddle
        for t in tensors:
            t = t.detach()
            dtype = str(t.dtype).replace("paddle.", "")
            if dtype not in _DTYPES:
                t, dtype = paddle.cast(t, "float32"), "float32"
            header = np.zeros(_HEADER, np.int64)
            header[0], header[1] = _DTYPES.index(dtype), len(t.shape)
            header[2:2 + len(t.shape)] = t.shape
            dist.send(paddle.to_tensor(header), dst=self.groups.process(stage), group=group)
            dist.send(t.contiguous(), dst=self.groups.process(stage), group=group)

    def _recv(self, n: int, stage: int, group: Any) -> list[Any]:
        import paddle.distributed as dist

        paddle = self.paddle
        out = []
        for _ in range(n):
            header = paddle.zeros([_HEADER], "int64")
            dist.recv(header, src=self.groups.process(stage), group=group)
            h = header.numpy()
            t = paddle.empty([int(d) for d in h[2:2 + int(h[1])]], dtype=_DTYPES[int(h[0])])
            dist.recv(t, src=self.groups.process(stage), group=group)
            out.append(t)
        return out

    # -- one batch ----------------------------------------------------------------------------

    def run(self, ids: np.ndarray, labels: np.ndarray | None = None, *, train: bool = False,
            count: int = 1, logits: bool = False) -> tuple[float, np.ndarray | None]:
        """One batch through the pipeline: (the batch's summed token loss on every stage (0.0
        without `labels`), the logits on the last stage with `logits`, else None). `train`: the
        backward too (1F1B or GPipe), the gradients accumulated into the params, the loss
        scaled by 1 / `count` (the step's target tokens)."""
        paddle = self.paddle
        m = min(self.micro_batches, len(ids))  # a short final batch: fewer, and uneven, micro-batches
        cuts = [len(part) for part in np.array_split(np.arange(len(ids)), m)]
        rows = [sum(cuts[:i]) for i in range(m + 1)]
        kind: Schedule = self.kind if train else "forward"
        edges = tuple(bool(x) for x in self._grad_edges()) if train else None
        program = schedule(kind, self.groups.stages, m, edges)[self.groups.stage]
        acts: dict[int, tuple[list[Any], list[Any]]] = {}
        grads: dict[int, list[Any]] = {}
        received: dict[int, list[Any]] = {}
        total = 0.0
        pieces: list[np.ndarray] = []
        timing = StepTiming()
        start = time.perf_counter()
        for op in program:
            if op.kind in ("F", "B"):
                t0 = time.perf_counter()
                if op.kind == "F":
                    total += self._forward(op, ids, labels, rows, received, acts, pieces, count, train,
                                           logits)
                else:
                    self._backward(op, acts, grads)
                timing.compute_s += time.perf_counter() - t0
                timing.peak_in_flight = max(timing.peak_in_flight, len(acts))
            elif op.kind == "recv_act":
                received[op.mb] = self._recv(len(self.inputs), op.peer(self.groups.stage), self.groups.prev)
            elif op.kind == "send_act":
                self._send(acts[op.mb][1], op.peer(self.groups.stage), self.groups.next)
                if not train:
                    acts.pop(op.mb)
            elif op.kind == "recv_grad":
                grads[op.mb] = self._recv(len(self.outputs_need_grad), op.peer(self.groups.stage),
                                          self.groups.next)
            else:  # send_grad
                inputs = acts.pop(op.mb)[0]
                back = [x.grad if x.grad is not None else paddle.zeros_like(x)
                        for x, name in zip(inputs, self.inputs, strict=True) if name in self.needs_grad]
                self._send(back, op.peer(self.groups.stage), self.groups.prev)
        if train:
            acts.clear()
        timing.total_s = time.perf_counter() - start
        self.timing = timing
        if train:
            self.history.append(timing)
        total = self._broadcast_loss(total) if labels is not None else 0.0
        out = np.concatenate(pieces, axis=0) if pieces else None
        return total, out

    def summary(self, skip_first: bool = True) -> dict[str, Any]:
        """This stage's measured schedule over the training batches (the first left out when
        there are others: it pays for warm-up): seconds in the schedule and in its own compute,
        the idle fraction 1 - compute / total (the bubble plus the p2p time), the most
        micro-batches alive at once, and the schedule's ideal bubble (p - 1) / (m + p - 1)."""
        from ernie_ir.backends.paddle.pipeline_schedule import bubble_fraction

        runs = self.history[1:] if skip_first and len(self.history) > 1 else self.history
        total = sum(t.total_s for t in runs)
        compute = sum(t.compute_s for t in runs)
        return {"stage": self.groups.stage, "stages": self.groups.stages, "schedule": self.kind,
                "micro_batches": self.micro_batches, "batches": len(runs), "total_s": total,
                "compute_s": compute, "idle_fraction": 0.0 if total <= 0 else max(0.0, 1 - compute / total),
                "peak_in_flight": max((t.peak_in_flight for t in runs), default=0),
                "ideal_bubble": bubble_fraction(self.groups.stages, self.micro_batches)}

    def logits_to_first(self, logits: np.ndarray | None) -> np.ndarray | None:
        """The last stage's logits handed to the first stage (where rank 0 reports): the array
        on the first stage, None on the stages between."""
        if self.first and self.last:
            return logits
        if self.last:
            self._send([self.paddle.to_tensor(logits)], 0, self.groups.ring)
            return None
        if self.first:
            return np.asarray(self._recv(1, self.groups.stages - 1, self.groups.ring)[0].numpy())
        return None

    def _grad_edges(self) -> list[bool]:
        """Whether gradients cross each edge: the cut records it in every stage graph, so every
        stage plans the same global schedule (its p2p order depends on all the edges)."""
        info = stage_info(self.graph.metadata) or {}
        return list(info.get("grad_edges", [True] * (self.groups.stages - 1)))

    def _forward(self, op: Op, ids: np.ndarray, labels: np.ndarray | None, rows: list[int],
                 received: dict[int, list[Any]], acts: dict[int, tuple[list[Any], list[Any]]],
                 pieces: list[np.ndarray], count: int, train: bool, logits: bool) -> float:
        paddle = self.paddle
        lo, hi = rows[op.mb], rows[op.mb + 1]
        if self.first:
            inputs = [paddle.to_tensor(ids[lo:hi])]
        else:
            inputs = received.pop(op.mb)
            for x, name in zip(inputs, self.inputs, strict=True):
                x.stop_gradient = not (train and name in self.needs_grad)
        out = self.layer(*inputs)
        outs = list(out) if isinstance(out, tuple) else [out]
        if not self.last:
            acts[op.mb] = (inputs, outs)
            return 0.0
        value = 0.0
        if labels is not None:
            if self.loss_sum is None:
                raise PipelineStageError("a pipeline stage given labels needs a loss (loss_sum)")
            loss_sum, _ = self.loss_sum(paddle, outs[0], labels[lo:hi], self.ignore_index,
                                        getattr(self.layer, "vocab_shard", None), self.layer.world_size)
            value = float(loss_sum.numpy())
            if train:
                acts[op.mb] = (inputs, [loss_sum / max(count, 1)])
        if logits:
            pieces.append(np.asarray(outs[0].numpy()))
        return value

    def _backward(self, op: Op, acts: dict[int, tuple[list[Any], list[Any]]],
                  grads: dict[int, list[Any]]) -> None:
        paddle = self.paddle
        inputs, outs = acts[op.mb]
        if self.last:
            outs[0].backward()
        else:
            chosen = [o for o, name in zip(outs, self._output_names(), strict=True)
                      if name in self.outputs_need_grad]
            if chosen:
                paddle.autograd.backward(chosen, grads.pop(op.mb))
        if self.first or not self._grad_edges()[self.groups.stage - 1]:
            acts.pop(op.mb)  # no gradient to send back: nothing of this micro-batch is kept
        else:
            acts[op.mb] = (inputs, [])  # the outputs' graph is freed; the inputs' grads are still to send

    def _output_names(self) -> list[str]:
        return list(self.graph.output_names)

    def _broadcast_loss(self, value: float) -> float:
        """The last stage's loss sum on every stage of this model-parallel rank."""
        import paddle.distributed as dist

        t = self.paddle.to_tensor([value], dtype="float64")
        dist.broadcast(t, src=self.groups.process(self.groups.stages - 1), group=self.groups.ring)
        return float(t.numpy()[0])
