"""Data parallelism and ZeRO stage 1/2 sharding for training (paddle.distributed; gloo on CPU).

A data-parallel run starts `dp x world` processes (world: the artifact's model-parallel ranks,
tp x ep), ordered as Paddle's hybrid topology: process g is replica `g // world` and runs rank
graph `g % world` (`Mapping.process`). Groups (`new_groups`, with the one helper of
ernie_ir.backends.paddle.groups): one model-parallel group per replica (the graph's collectives,
the tensor-parallel clip) and one dp group per model-parallel rank (gradients, sharded updates,
the loss).

Every process reads the same global batches; replica d takes its contiguous rows of each
(`replica_rows`: b / dp each when dp divides the batch's b rows; a short final batch is split as
`numpy.array_split` does, the first b % dp replicas one row more; a replica with no rows skips
the forward and contributes zeros to the sums, still joining every collective). Each replica
backprops its summed token loss over the step's global real-target count, so the gradients
summed over the dp group (`DataParallelOptimizer.step`) and the loss summed over it are the
one-replica values over the whole batch (up to float summation order).

The optimizer step (`DataParallelOptimizer`, wrapping an AdamW):

1. every trainable gradient (zeros where a replica had no rows) is summed over the dp group:
   one all_reduce of a flat float32 buffer per bucket of `BUCKET` elements, params in name order;
2. slices that several model-parallel ranks hold are summed over the mp group and the global
   norm counts every element once (`GradientNorm`, the tensor-parallel clip's arithmetic);
3. the gradients are scaled by `clip / max(norm, clip)` (ClipGradByGlobalNorm's coefficient);
4. AdamW steps the params this rank updates; with sharding, each param is then broadcast from
   the rank that owns it (one broadcast per owner, a flat buffer).

Sharding (`partition`: params greedily by size, largest first, ties by name, to the least
loaded replica): stage 1 builds each rank's AdamW over its own params only, so the moments
(and master weights) it holds are its share; stage 2 also keeps only its own gradients after
step 1: gloo has no reduce_scatter, so it is emulated as the same all_reduce followed by
dropping the gradients of params another replica owns. That keeps stage 2 bit for bit equal
to stage 1 and to unsharded dp (the same reduction, in the same order), and costs the full
all-reduce traffic (a real reduce_scatter, as NCCL's, moves half); the gradient memory held
from the reduce to the next backward halves. The clip norm of stage 2 is computed from the
owned gradients: each rank's per-param sums of squares (zeros for params it does not own)
are summed over the dp group, which is exact (one non-zero term per entry), then added in
the unsharded order, so the coefficient, and every update, is bit for bit the unsharded one.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

import numpy as np

from ernie_ir.ir import ErnieIRError

BUCKET = 1 << 25
"""Elements per flat all-reduce / broadcast buffer (128 MiB of float32)."""


# -- layout -------------------------------------------------------------------------------------


def replica_rows(rows: int, dp: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of a batch of `rows` that replica `index` of `dp` takes: contiguous,
    b / dp each when dp divides b, else the first b % dp replicas one row more."""
    per, extra = divmod(rows, dp)
    start = index * per + min(index, extra)
    return start, start + per + (1 if index < extra else 0)


def partition(sizes: dict[str, int], dp: int) -> dict[str, int]:
    """The replica that owns each param under sharding: largest first (ties by name), each to
    the replica holding the fewest elements so far (ties: the lowest index). Deterministic, so
    every rank computes the same owners."""
    load = [0] * dp
    owners: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        d = min(range(dp), key=lambda i: (load[i], i))
        owners[name] = d
        load[d] += sizes[name]
    return owners


def new_groups(rank: int, dp: int, world: int) -> tuple[Any, Any]:
    """(model-parallel group, dp group) of process `rank` (None where the group is the default
    one or a single rank): every group of `data_parallel_group_ranks`, created by the one helper
    of every parallelism (ernie_ir.backends.paddle.groups: in the same order on every process,
    each followed by gloo's barrier)."""
    from ernie_ir.backends.paddle.groups import create_groups, data_parallel_group_ranks

    if dp == 1:
        return None, None
    mine = create_groups(rank, data_parallel_group_ranks(dp, world))
    return mine.get(("mp", rank // world)), mine.get(("dp", rank % world))


@dataclass(frozen=True)
class Replica:
    """This process's place in the dp group: which rows it takes, and the loss sum over replicas."""

    dp: int
    index: int
    group: Any

    def rows(self, ids: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """This replica's rows of a batch; None when it has none (a short final batch)."""
        start, stop = replica_rows(len(ids), self.dp, self.index)
        return None if start == stop else (ids[start:stop], labels[start:stop])

    def sum(self, value: float) -> float:
        """`value` summed over the dp group (float64), the same on every replica."""
        import paddle
        import paddle.distributed as dist

        t = paddle.to_tensor([value], dtype="float64")
        dist.all_reduce(t, group=self.group)
        return float(t.numpy()[0])


# -- the global gradient norm ---------------------------------------------------------------------


class GradientNorm:
    """What a rank of a model-parallel world does to its gradients before a global-norm clip:
    params several ranks hold a slice of (KV heads replicated in groups) get the sum of those
    ranks' gradients (`sum_shared`), and the norm counts every element once: sharded slices
    summed over ranks, replicated params once, shared slices divided by how many ranks hold
    them (`terms`, `norm`). `group`: the model-parallel group (None: the default group);
    `stages`: the group of the pipeline stages of this model-parallel rank (their squared norms
    add up; None: no pipeline); `tied`: the weights this stage shares with the other end of the
    pipeline (pipeline.TiedWeights: their gradients summed over the two ends first, and counted
    in the norm by one of them)."""

    def __init__(self, paddle: Any, layer: Any, graph: Any, group: Any = None, stages: Any = None,
                 tied: Any = None) -> None:
        from ernie_ir.ir.mapping import SHARD

        self.paddle, self.layer, self.group, self.stages, self.tied = paddle, layer, group, stages, tied
        self.uncounted: set[str] = set() if tied is None else tied.uncounted(layer)
        self.world = int(getattr(layer, "world_size", 1))
        self.kinds: dict[str, str] = {}  # Paddle param name -> "replicated" | "sharded" | "shared"
        self.shared: dict[str, tuple[list[int], Any, Any]] = {}  # name -> (global shape, index, count)
        # Every rank walks the params in the same (IR) order, so their collectives pair up.
        for name in sorted(layer.trainable_names):
            tensor = layer.tensor(name)
            shard = graph.params[name].annotations.get(SHARD)
            if shard is None or self.world == 1:
                self.kinds[tensor.name] = "replicated"
                continue
            shape, index = cut_index(shard)
            cover = np.zeros(shape, np.float32)
            cover[index] = 1.0
            held = paddle.to_tensor(cover)
            self._all_reduce(held)  # how many ranks hold each element
            count = held.numpy()[index]
            self.kinds[tensor.name] = "shared" if count.max() > 1 else "sharded"
            if count.max() > 1:
                self.shared[tensor.name] = (shape, index, paddle.to_tensor(count))

    def _all_reduce(self, t: Any) -> None:
        import paddle.distributed as dist

        if self.world > 1:
            dist.all_reduce(t, group=self.group)

    def sum_shared(self, grads: dict[str, Any]) -> None:
        """Replace each shared slice's gradient (by Paddle name) with the sum of every holder's
        part (a tied weight's: first with the other pipeline end's)."""
        paddle = self.paddle
        if self.tied is not None:
            self.tied.sum(paddle, self.layer, grads)
        for pname, (shape, index, _) in self.shared.items():  # setup order: the same on every rank
            g = grads.get(pname)
            whole = np.zeros(shape, np.float32)
            if g is not None:
                whole[index] = g.numpy()
            buf = paddle.to_tensor(whole)
            self._all_reduce(buf)
            grads[pname] = paddle.to_tensor(buf.numpy()[index])

    def counted(self, pname: str) -> bool:
        """Whether this rank's gradient of `pname` enters the norm (a replicated one: rank 0's; a
        tied weight: the first pipeline stage's)."""
        replicated = self.kinds.get(pname, "replicated") == "replicated"
        return pname not in self.uncounted and not (replicated and getattr(self.layer, "rank", 0) != 0)

    def term(self, pname: str, g: Any) -> Any:
        """The sum of squares `pname`'s gradient adds to the squared norm."""
        paddle = self.paddle
        sq = paddle.square(g)
        return paddle.sum(sq / self.shared[pname][2] if self.kinds.get(pname) == "shared" else sq)

    def terms(self, grads: dict[str, Any]) -> list[Any]:
        """The counted gradients' terms, in `grads` order."""
        return [self.term(p, g) for p, g in grads.items() if g is not None and self.counted(p)]

    def norm(self, terms: list[Any] | Any) -> Any:
        """The global norm [1] from this rank's terms (a list, or them stacked): summed, then
        summed over the group."""
        paddle = self.paddle
        if isinstance(terms, list):
            total = paddle.stack(terms).sum() if terms else paddle.zeros([], "float32")
        else:
            total = terms.sum()
        total = total.reshape([1])
        self._all_reduce(total)
        if self.stages is not None:
            import paddle.distributed as dist

            dist.all_reduce(total, group=self.stages)
        return paddle.sqrt(total)


def clip_scale(paddle: Any, norm: Any, clip_norm: float) -> Any:
    """ClipGradByGlobalNorm's coefficient: clip / max(norm, clip)."""
    top = paddle.full([1], clip_norm, "float32")
    return top / paddle.maximum(norm, top)


def cut_index(shard: dict[str, Any]) -> tuple[list[int], tuple[np.ndarray, ...]]:
    """(global shape, np.ix_ index of a rank's slice) from a `shard` annotation."""
    shape = [int(d) for d in shard["global_shape"]]
    axes = [np.arange(d) for d in shape]
    for cut in shard["cuts"]:
        axes[int(cut["axis"]) % len(shape)] = np.concatenate(
            [np.arange(int(a), int(b)) for a, b in cut["ranges"]])
    return shape, np.ix_(*axes)


# -- the optimizer step --------------------------------------------------------------------------------


class DataParallelOptimizer:
    """The optimizer of one rank of a data-parallel run: an AdamW built (by the caller, without a
    grad_clip) over the params this rank updates (all of them unsharded, its own with sharding),
    behind the optimizer interface the training loop and checkpoints use (`set_lr`, `step`,
    `clear_grad`, `state_dict`, `set_state_dict`). `step` runs the module docstring's steps."""

    def __init__(self, paddle: Any, layer: Any, inner: Any, norm: GradientNorm, *, clip_norm: float | None,
                 replica: Replica, world_rank: int, world: int, sharding: str | None,
                 owners: dict[str, int] | None) -> None:
        self.paddle, self.layer, self.inner, self.norm_of = paddle, layer, inner, norm
        self.clip_norm, self.replica, self.sharding = clip_norm, replica, sharding
        self.owners = owners
        self.names = sorted(layer.trainable_names)  # IR names; the reduction order
        self.param_names = [n for n in self.names if owners is None or owners[n] == replica.index]
        """The IR names of the params this rank's AdamW holds state for."""
        self.members = [world_rank % world + d * world for d in range(replica.dp)]  # the dp group's ranks
        self.last_norm: float | None = None
        self.grad_bytes = 0
        """Bytes of the gradients this rank held at its last optimizer step (after the reduce)."""

    # the optimizer interface ------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        if self.inner is not None:
            self.inner.set_lr(lr)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.inner is None else self.inner.state_dict()

    def set_state_dict(self, state: dict[str, Any]) -> None:
        if self.inner is not None:
            self.inner.set_state_dict(state)

    def clear_grad(self) -> None:
        for n in self.names:
            self.layer.tensor(n).clear_gradient(False)

    # the step ---------------------------------------------------------------------------------

    def _flat_reduce(self, tensors: list[Any]) -> list[Any]:
        """`tensors` summed over the dp group: flat float32 buckets, one all_reduce each."""
        import paddle.distributed as dist

        paddle = self.paddle
        out: list[Any] = []
        i = 0
        while i < len(tensors):
            j, count = i, 0
            while j < len(tensors) and (j == i or count + int(tensors[j].size) <= BUCKET):
                count += int(tensors[j].size)
                j += 1
            chunk = tensors[i:j]
            flat = paddle.concat([t.reshape([-1]) for t in chunk])
            dist.all_reduce(flat, group=self.replica.group)
            parts = paddle.split(flat, [int(t.size) for t in chunk])
            out += [p.reshape(t.shape) for p, t in zip(parts, chunk, strict=True)]
            i = j
        return out

    def step(self) -> None:
        paddle = self.paddle
        layer = self.layer
        with paddle.no_grad():
            tensors = [layer.tensor(n) for n in self.names]
            grads = [t.grad if t.grad is not None else paddle.zeros(t.shape, "float32") for t in tensors]
            reduced = self._flat_reduce(grads)
            by_pname: dict[str, Any] = {t.name: g for t, g in zip(tensors, reduced, strict=True)}
            self.norm_of.sum_shared(by_pname)  # over the mp group: every rank, every param
            mine = set(self.param_names)
            if self.sharding == "stage2":  # the emulated reduce_scatter: keep the owned gradients only
                for n, t in zip(self.names, tensors, strict=True):
                    if n not in mine:
                        by_pname[t.name] = None
                        t.clear_gradient(False)
            norm = self._norm(by_pname, tensors)
            self.last_norm = float(norm.numpy()[0])
            scale = None if self.clip_norm is None else clip_scale(paddle, norm, self.clip_norm)
            for n, t in zip(self.names, tensors, strict=True):
                g = by_pname[t.name]
                if n in mine and g is not None:
                    t.grad = g if scale is None else g * scale
            self.grad_bytes = sum(int(g.size) * 4 for g in by_pname.values() if g is not None)
        if self.inner is not None:
            self.inner.step()
        if self.owners is not None:
            self._broadcast(tensors)

    def _norm(self, by_pname: dict[str, Any], tensors: list[Any]) -> Any:
        """The global gradient norm [1]: unsharded and stage 1 as the tensor-parallel clip; stage 2
        from the owned gradients, the per-param terms summed over the dp group first (exact)."""
        paddle = self.paddle
        if self.sharding != "stage2":
            return self.norm_of.norm(self.norm_of.terms(by_pname))
        import paddle.distributed as dist

        terms = []
        for t in tensors:
            if not self.norm_of.counted(t.name):
                continue
            g = by_pname[t.name]
            terms.append(self.norm_of.term(t.name, g) if g is not None else paddle.zeros([], "float32"))
        if not terms:
            return self.norm_of.norm([])
        stacked = paddle.stack(terms)
        dist.all_reduce(stacked, group=self.replica.group)  # one non-zero term per entry: exact
        return self.norm_of.norm(stacked)

    def _broadcast(self, tensors: list[Any]) -> None:
        """Each param from the replica that updated it: one flat broadcast per owner."""
        import paddle.distributed as dist

        paddle = self.paddle
        assert self.owners is not None
        with paddle.no_grad():
            for d in range(self.replica.dp):
                owned = [t for n, t in zip(self.names, tensors, strict=True) if self.owners[n] == d]
                if not owned:
                    continue
                flat = paddle.concat([t.reshape([-1]) for t in owned])
                dist.broadcast(flat, src=self.members[d], group=self.replica.group)
                if d == self.replica.index:
                    continue
                for t, part in zip(owned, paddle.split(flat, [int(t.size) for t in owned]), strict=True):
                    t.set_value(part.reshape(t.shape))


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the state tensors an optimizer holds (AdamW: moments, beta powers, master
    weights), summed from the tensors themselves."""
    total = 0
    for key, value in optimizer.state_dict().items():
        if key == "LR_Scheduler":
            continue
        items = value.values() if isinstance(value, dict) else [value]
        for t in items:
            total += int(np.prod(t.shape, dtype=np.int64)) * int(t.element_size())
    return total


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def refuse_qat_state(recipe: dict[str, Any], dp: int) -> None:
    """Data parallelism with QAT moving-average state: each replica would average the abs-max of
    its own rows, so the replicas' scales (and the one-rank result) would part ways."""
    if dp > 1 and recipe.get("qat_state"):
        raise ErnieIRError(f"--dp {dp}: this artifact trains QAT moving-average scales, statistics of the "
                           "whole batch that each replica would take over its own rows only; train it with "
                           "--dp 1 (tensor parallelism keeps them exact)")


def rank_stats(layer: Any, optimizer: Any, dp_index: int, mp_rank: int) -> dict[str, Any]:
    """What a process held at the end of its run (TrainResult.rank_stats): measured from the
    tensors (optimizer state, gradients) and the OS (peak resident memory)."""
    grads = getattr(optimizer, "grad_bytes", None)
    if grads is None:  # a plain optimizer: the gradients its params hold now
        grads = 0
        for n in getattr(layer, "trainable_names", ()):
            g = layer.tensor(n).grad
            grads += 0 if g is None else int(np.prod(g.shape, dtype=np.int64)) * int(g.element_size())
    return {"dp_index": dp_index, "mp_rank": mp_rank,
            "optimizer_state_bytes": optimizer_state_bytes(optimizer),
            "gradient_bytes": int(grads), "peak_rss_bytes": peak_rss_bytes()}
