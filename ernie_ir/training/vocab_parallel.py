"""The vocabulary-parallel next-token loss of tensor-parallel training.

A tensor-parallel rank graph (ernie_ir.passes.parallel.split) column-splits `lm_head`: rank r
computes the logits of its vocabulary columns [r x V/tp, (r+1) x V/tp) and the graph ends in an
`all_gather` that concatenates them into the whole [B, S, V] logits, which every rank then keeps
(f32) for the cross-entropy. Training does not need them whole: the cross-entropy is computed on
the shards, as Megatron's and ERNIEKit's vocab-parallel cross-entropy
(`use_sparse_head_and_loss_fn`):

    m      = all_reduce_max(max_j logits_local[t, j])                  per token t
    z      = max(logits_local - m, CLIP)
    sumexp = all_reduce_sum(sum_j exp(z[t, j]))
    picked = all_reduce_sum(z[t, label_t - start] on the rank whose [start, stop) holds
             label_t, 0 elsewhere)
    loss_t = log(sumexp) - picked             (= log(sumexp) + m - label logit; 0 where label_t
                                               is ignore_index)

and its backward is local, with no communication: d logits_local = (softmax_local -
onehot_local) x the upstream gradient of loss_t, softmax_local = exp(z) / sumexp. The two sums
travel in one all_reduce. CLIP is Paddle's: its cross_entropy (softmax_with_cross_entropy)
clips logit - max at -64 on CPU, so a token whose label logit lies more than 64 below the
maximum costs 64 + log(sumexp), not its true loss; the same clip here (read from Paddle once
per process: none where its kernel has none) makes the loss equal the gathered one exactly
(untrained @tiny models have such tokens: their mean loss is ~41).

`keep_vocab_shards(graph)` turns a loaded training rank graph into the one this loss reads: the
final all_gather of the logits is dropped (the graph's output is this rank's [B, S, V_local]
slice) and `graph.metadata["vocab_parallel_loss"]` records the rank's vocabulary range. The
artifact's rank graphs on disk are not changed: inference (and `ernie-ir run` on a training
artifact) still outputs the whole logits.

Paddle is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ernie_ir.ir import ErnieIRError, Graph, Node

VOCAB_LOSS = "vocab_parallel_loss"
"""Graph metadata key of a training rank graph whose output is its vocabulary shard of the logits:
{vocab_start, vocab_stop, vocab_size, world_size}."""


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary columns [start, stop) of `size` a rank's logits hold."""

    start: int
    stop: int
    size: int

    @classmethod
    def of(cls, graph: Graph) -> VocabShard | None:
        meta = graph.metadata.get(VOCAB_LOSS)
        if not isinstance(meta, dict):
            return None
        return cls(int(meta["vocab_start"]), int(meta["vocab_stop"]), int(meta["vocab_size"]))


def logits_gather(graph: Graph) -> Node | None:
    """The all_gather of a tensor-parallel rank graph's logits (its first output, gathered along
    the last axis over the tensor-parallel world, read by nothing else), or None: one rank, a
    replicated head (`split{lm_head=replicate}`), an output read again inside the graph."""
    parallel = graph.metadata.get("parallel")
    if not isinstance(parallel, dict) or int(parallel.get("world_size", 1)) <= 1 or not graph.outputs:
        return None
    out = graph.outputs[0]
    node = out.producer
    if node is None or node.op != "all_gather" or out.num_uses() or out in graph.outputs[1:]:
        return None
    x = node.inputs[0]
    rank = len(x.type.shape)
    world = int(node.attrs.world_size)
    if node.attrs.axis % rank != rank - 1 or not isinstance(x.type.shape[-1], int) or world <= 1:
        return None
    if world != int(parallel["world_size"]) or int(parallel.get("tp", 1)) != world:
        return None  # the gather spans the tensor-parallel group (tp == world whenever tp > 1)
    return node


def keep_vocab_shards(graph: Graph) -> VocabShard | None:
    """Drop the all_gather of a rank graph's logits (`logits_gather`) in place and record the
    rank's vocabulary range in its metadata; None (the graph unchanged) where there is none."""
    if VOCAB_LOSS in graph.metadata:
        return VocabShard.of(graph)
    node = logits_gather(graph)
    if node is None:
        return None
    parallel = graph.metadata["parallel"]
    x = node.inputs[0]
    local, world = int(x.type.shape[-1]), int(node.attrs.world_size)
    r = int(parallel["rank"])  # the all_gather concatenates the ranks' slices in rank order
    start, stop, size = r * local, (r + 1) * local, local * world
    ranks = parallel.get("ranks") or []
    held = ranks[r].get("vocab") if r < len(ranks) and isinstance(ranks[r], dict) else None
    if parallel.get("vocab_size") == size and held is not None and list(held) != [start, stop]:
        raise ErnieIRError(f"rank {r}'s logits hold vocabulary columns [{start}, {stop}) but its layout "
                           f"says [{held[0]}, {held[1]})")
    graph.set_outputs([x, *graph.outputs[1:]], list(graph.output_names))
    graph.erase(node)
    graph.metadata[VOCAB_LOSS] = {"vocab_start": start, "vocab_stop": stop, "vocab_size": size,
                                  "world_size": world}
    return VocabShard(start, stop, size)


_FUNCTIONS: dict[str, Any] = {}


def paddle_logit_clip(paddle: Any) -> float | None:
    """Where Paddle's cross_entropy clips logit - max on the current device (-64 on CPU), or None:
    read from the loss of a label 1000 below the maximum."""
    x = paddle.to_tensor([[0.0, -1000.0]], dtype="float32")
    loss = paddle.nn.functional.cross_entropy(x, paddle.to_tensor([1]), reduction="none")
    loss = float(loss.numpy().ravel()[0])
    return -loss if loss < 999.0 else None


def _loss_function() -> Any:
    """The PyLayer (built once; its collectives span paddle_layer's model-parallel group)."""
    if _FUNCTIONS:
        return _FUNCTIONS["loss"]
    from ernie_ir.backends.paddle.layer import _MODEL_PARALLEL, require_paddle

    paddle = require_paddle()
    import paddle.distributed as dist
    from paddle.autograd import PyLayer

    clip = paddle_logit_clip(paddle)

    class VocabParallelCrossEntropy(PyLayer):  # type: ignore[misc]
        """Per-token cross-entropy of vocabulary-sharded logits [N, V_local] (f32) against
        global labels [N] (int64); forward: one MAX and one SUM all_reduce; backward: local."""

        @staticmethod
        def forward(ctx: Any, logits: Any, labels: Any, start: int, ignore_index: int,
                    world: int) -> Any:
            x = paddle.cast(logits, "float32")
            n_local = int(x.shape[-1])
            group = _MODEL_PARALLEL[0]
            m = paddle.max(x, axis=-1)
            if world > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            z = x - m.unsqueeze(-1)
            if clip is not None:
                z = paddle.clip(z, min=clip)
            e = paddle.exp(z)
            local = labels - start
            held = paddle.logical_and(paddle.logical_and(local >= 0, local < n_local), labels != ignore_index)
            index = paddle.where(held, local, paddle.zeros_like(local))
            picked = paddle.take_along_axis(z, index.unsqueeze(-1), axis=-1).squeeze(-1)
            picked = picked * paddle.cast(held, "float32")
            sums = paddle.stack([paddle.sum(e, axis=-1), picked])
            if world > 1:
                dist.all_reduce(sums, group=group)  # SUM of sumexp and of the label's shifted logit
            keep = paddle.cast(labels != ignore_index, "float32")
            loss = (paddle.log(sums[0]) - sums[1]) * keep
            onehot = paddle.nn.functional.one_hot(index, n_local) * paddle.cast(held, "float32").unsqueeze(-1)
            ctx.save_for_backward(e / sums[0].unsqueeze(-1) - onehot, keep)
            return loss

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            d, keep = ctx.saved_tensor()
            return d * (grad * keep).unsqueeze(-1)

    _FUNCTIONS["loss"] = VocabParallelCrossEntropy
    return VocabParallelCrossEntropy


def vocab_parallel_cross_entropy(logits: Any, labels: Any, start: int, *, ignore_index: int = -100,
                                 world: int) -> Any:
    """Per-token loss [N] of this rank's logits [N, V_local] (columns [start, start + V_local) of
    the vocabulary) against the global labels [N]; 0 where the label is `ignore_index`. Every rank
    of the model-parallel group calls it with its own shard (the loss it returns is replicated);
    `world` 1 is the plain cross-entropy (no collectives)."""
    return _loss_function().apply(logits, labels, int(start), int(ignore_index), int(world))
