"""A `paddle.nn.Layer` built from an IR graph: its forward evaluates the graph with Paddle ops.

Each IR op maps to Paddle ops with the math of its numpy reference kernel
(ernie_ir/ops/*.py), in float32 (params stored in bf16/f16/fp8 are widened
exactly, int4 is held one value per int8). Weight-only linears use Paddle's
device kernel (`paddle.nn.quant.weight_only_linear`) when the Layer is built
for a GPU and the weight fits its layout; everywhere else (CPU, custom
devices, `portable=True`) they run the portable form: logical int values
times scales, then matmul. The choice is made once, at build time, from the
device, and recorded in `layer.kernels`.

Params the IR marks `trainable` (LoRA A/B, PACT alpha, QAT weights) become
trainable Paddle parameters; every other param is frozen (`stop_gradient`).
QAT fake quantization has straight-through gradients (x + (fq(x) - x).detach()).
With `layer.track_state = True`, each forward queues the next moving-average
state of `fake_quant_moving_average` nodes; `layer.commit_state()` writes it
into the state params (the training loop calls it after every step).

Rank graphs of a multi-rank artifact (ernie_ir.passes.parallel.split) lower their
collectives to `paddle.distributed` calls inside autograd functions:
all_reduce is a sum forward and the identity backward (every rank computes
the same replicated loss, so each already holds the gradient of the sum),
all_gather is a concatenation forward and the rank's slice backward;
sequence parallelism's reduce_scatter is all_reduce + this rank's token
slice forward (gloo has no reduce_scatter) and an all-gather backward, its
all_gather_sequence a gather forward and the rank's token slice backward. With
`grad_sync=True` (tensor-parallel training), every replicated value a
rank-dependent node reads goes through Megatron's "f": identity forward,
all-reduce backward, since each rank's sharded computation contributes only
its part of that value's gradient. With world_size 1 the collectives are
the identity and need no `paddle.distributed`.

Paddle is imported lazily: importing this module needs no Paddle.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ernie_ir.backends.paddle import devices
from ernie_ir.backends.paddle.paddle_import import (
    PaddleMissingError as PaddleMissingError,  # re-exported: build_layer raises it
)
from ernie_ir.backends.paddle.paddle_import import require_paddle
from ernie_ir.ir import DType, ErnieIRError, Graph, Node, OpDef, Param, Value
from ernie_ir.ir.mapping import SHARD
from ernie_ir.ops.cuda_layout import pack, packable, unpack
from ernie_ir.ops.quant_numerics import FP8_MAX
from ernie_ir.ops.rope import rope_angles
from ernie_ir.passes.parallel.rank_varying import COLLECTIVE_OPS, rank_varying


class PaddleEmitError(ErnieIRError):
    """The graph cannot be expressed as a Paddle Layer."""


_PREV_HALF = 0.49999997  # float32 just below 0.5, as ernie_ir.ops.quant_numerics.round_half_away


def _round_half_away(P: Any, t: Any) -> Any:
    return P.trunc(t + P.sign(t) * _PREV_HALF)


def _fq(P: Any, x: Any, s: Any, bits: int, round_type: int) -> Any:
    """Paddle's ClipAndFakeQuantDequant (ernie_ir.ops.quant_numerics.fake_quant_dequant)."""
    b = float(2 ** (bits - 1) - 1)
    inv = P.where(s <= 1e-30, 1.0 / (s + 1e-6), 1.0 / s)
    k = inv * b
    if round_type == 0:
        q = P.clip(P.round(k * x), -b - 1.0, b)  # paddle.round: half to even (= rint)
    else:
        q = _round_half_away(P, k * P.minimum(P.maximum(x, -s), s))
    return (q * s) / b


def _ste(x: Any, y: Any) -> Any:
    """y forward, identity gradient to x."""
    return x + (y - x).detach()


def _abs_max(P: Any, x: Any, keep: Sequence[int]) -> Any:
    nd = len(x.shape)
    keep = {a % nd for a in keep} if nd else set()
    axes = [i for i in range(nd) if i not in keep]
    a = P.abs(x)
    return P.max(a, axis=axes, keepdim=True) if axes else a


def _expand_scale(P: Any, s: Any, k: int, group_size: int) -> Any:
    if len(s.shape) == 0:
        return s
    if group_size == -1:
        return s.unsqueeze(-2)
    return P.repeat_interleave(s, group_size, axis=-2)[..., :k, :]


def _round_to(P: Any, x: Any, dtype: DType) -> Any:
    """Round float32 values to `dtype` and widen back (what the interpreter's dtype rounding does)."""
    name = {DType.BF16: "bfloat16", DType.F16: "float16", DType.F8E4M3: "float8_e4m3fn",
            DType.F8E5M2: "float8_e5m2"}.get(dtype)
    return x if name is None else P.cast(P.cast(x, name), "float32")


def _fp8_fq(P: Any, x: Any, s: Any, fmt: DType) -> Any:
    top = float(FP8_MAX[fmt])
    return _round_to(P, P.clip(x / s, -top, top), fmt) * s


# -- op implementations: f(layer, node, args) -> list of outputs ------------------------------------------

OpImpl = Callable[[Any, Node, list[Any]], list[Any]]
OPS: dict[str, OpImpl] = {}


def _op(name: str) -> Callable[[OpImpl], OpImpl]:
    def deco(fn: OpImpl) -> OpImpl:
        OPS[name] = fn
        return fn
    return deco


def _arg(args: list[Any], i: int) -> Any:
    return args[i] if len(args) > i else None


@_op("embedding")
def _embedding(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return [L.F.embedding(a[0], a[1])]


@_op("vocab_parallel_embedding")
def _vocab_parallel_embedding(L: Any, n: Node, a: list[Any]) -> list[Any]:
    P = L.P
    ids, table = a
    local = ids - n.attrs.vocab_start
    held = P.logical_and(local >= 0, local < int(table.shape[0]))
    out = L.F.embedding(P.where(held, local, P.zeros_like(local)), table)
    # rows held elsewhere give exactly 0 (their sum over ranks is the whole lookup)
    return [out * P.cast(held, out.dtype).unsqueeze(-1)]


@_op("moe_local_experts")
def _moe_local_experts(L: Any, n: Node, a: list[Any]) -> list[Any]:
    P = L.P
    w, idx = a
    local = idx - n.attrs.first
    held = P.logical_and(local >= 0, local < n.attrs.count)
    return [P.where(held, w, P.zeros_like(w)), P.where(held, local, P.zeros_like(local))]


@_op("all_reduce")
def _all_reduce(L: Any, n: Node, a: list[Any]) -> list[Any]:
    if n.attrs.world_size == 1:
        return [a[0]]
    return [collective_functions(n.op, n.attrs.world_size)["all_reduce"].apply(a[0])]


@_op("all_gather")
def _all_gather(L: Any, n: Node, a: list[Any]) -> list[Any]:
    world = n.attrs.world_size
    if world == 1:
        return [a[0]]
    axis = n.attrs.axis % len(a[0].shape)
    return [collective_functions(n.op, world)["all_gather"].apply(a[0], axis, world)]


@_op("reduce_scatter")
def _reduce_scatter(L: Any, n: Node, a: list[Any]) -> list[Any]:
    world, dims = n.attrs.world_size, n.attrs.dims
    if world == 1:
        return [a[0].reshape([-1, *a[0].shape[dims:]])]
    return [collective_functions(n.op, world)["reduce_scatter"].apply(a[0], dims, world)]


@_op("scatter_sequence")
def _scatter_sequence(L: Any, n: Node, a: list[Any]) -> list[Any]:
    """This rank's token slice of a replicated value (no communication; its gradient is zero
    elsewhere, and the "f" before it sums the ranks' slices into the whole gradient)."""
    from ernie_ir.ops.collectives import sequence_tokens_error

    world, dims = n.attrs.world_size, n.attrs.dims
    flat = a[0].reshape([-1, *a[0].shape[dims:]])
    tokens = int(flat.shape[0])
    if tokens % world:
        raise PaddleEmitError(sequence_tokens_error(tokens, world))
    k = tokens // world
    return [flat[L.rank * k:(L.rank + 1) * k]]


@_op("all_gather_sequence")
def _all_gather_sequence(L: Any, n: Node, a: list[Any]) -> list[Any]:
    world, lead = n.attrs.world_size, list(a[1].shape[:n.attrs.dims])
    if world == 1:
        return [a[0].reshape([*lead, *a[0].shape[1:]])]
    return [collective_functions(n.op, world)["all_gather_sequence"].apply(a[0], lead, world)]


def _copy_to_parallel(L: Any, n: Node, a: list[Any]) -> list[Any]:
    """Megatron's "f" before a rank-dependent reader of a replicated value (see build_layer)."""
    return [collective_functions(n.op, L.world_size)["copy_to_parallel"].apply(a[0])]


_COLLECTIVES: dict[str, Any] = {}
_MODEL_PARALLEL: list[Any] = [None]
"""The group a rank graph's collectives span: None for the default (whole-world) group."""


def set_model_parallel_group(group: Any) -> None:
    """Make the rank graphs' collectives span `group` (a paddle.distributed group: this data-
    parallel replica's model-parallel ranks); None: the default group (no data parallelism)."""
    _MODEL_PARALLEL[0] = group


def collective_functions(op: str, world: int) -> dict[str, Any]:
    """The autograd functions behind the collectives (PyLayers over paddle.distributed), over the
    model-parallel group (`set_model_parallel_group`; the default group unless data parallel).

    PaddleEmitError when paddle.distributed is not running with `world` ranks in that group (a
    rank graph built into a Layer outside `paddle.distributed.launch`).
    """
    paddle = require_paddle()
    import paddle.distributed as dist

    group = _MODEL_PARALLEL[0]
    size = group.nranks if group is not None else dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized() or size != world:
        have = size
        raise PaddleEmitError(
            f"{op} over {world} ranks needs {world} paddle.distributed processes, but this process "
            f"runs in a world of {have}: run the artifact with `ernie-ir run ARTIFACT --backend paddle` "
            "(one process per rank) or `--backend interpreter` (SPMD)")
    if not _COLLECTIVES:
        _COLLECTIVES.update(_tensor_parallel_layers(paddle, dist))
        _COLLECTIVES.update(_sequence_parallel_layers(paddle, dist))
    return _COLLECTIVES


def _tensor_parallel_layers(paddle: Any, dist: Any) -> dict[str, Any]:
    """all_reduce, all_gather and copy_to_parallel ("f") as PyLayers over the model-parallel group."""
    from paddle.autograd import PyLayer

    class AllReduceSum(PyLayer):  # type: ignore[misc]
        """Sum over ranks; backward identity: the loss after it is replicated on every rank."""

        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            y = x.clone()  # all_reduce works in place; the input may be read again
            dist.all_reduce(y, group=_MODEL_PARALLEL[0])
            return y

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad

    class AllGather(PyLayer):  # type: ignore[misc]
        """Concatenation over ranks; backward: this rank's slice of the gradient."""

        @staticmethod
        def forward(ctx: Any, x: Any, axis: int, world: int) -> Any:
            ctx.axis, ctx.world = axis, world
            parts: list[Any] = []
            dist.all_gather(parts, x, group=_MODEL_PARALLEL[0])
            return paddle.concat(parts, axis=axis)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            group = _MODEL_PARALLEL[0]
            index = dist.get_rank() if group is None else group.rank
            return paddle.split(grad, ctx.world, axis=ctx.axis)[index]

    class CopyToParallel(PyLayer):  # type: ignore[misc]
        """Identity forward; backward: the sum over ranks of the gradient (each rank's sharded
        reader contributes only its part)."""

        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            g = grad.clone()
            dist.all_reduce(g, group=_MODEL_PARALLEL[0])
            return g

    return {"all_reduce": AllReduceSum, "all_gather": AllGather, "copy_to_parallel": CopyToParallel}


def _sequence_parallel_layers(paddle: Any, dist: Any) -> dict[str, Any]:
    """Sequence parallelism's reduce_scatter and all_gather_sequence as PyLayers over the
    model-parallel group."""
    from paddle.autograd import PyLayer

    def group_rank() -> int:
        group = _MODEL_PARALLEL[0]
        return dist.get_rank() if group is None else group.rank

    class ReduceScatter(PyLayer):  # type: ignore[misc]
        """Sequence parallelism's reduce-scatter: the sum over ranks of x, flattened to its tokens,
        this rank's contiguous shard. gloo has no reduce_scatter: all_reduce, then the slice.
        Backward: the all-gather of the shards' gradients."""

        @staticmethod
        def forward(ctx: Any, x: Any, dims: int, world: int) -> Any:
            from ernie_ir.ops.collectives import sequence_tokens_error

            ctx.shape = list(x.shape)
            y = x.clone()
            dist.all_reduce(y, group=_MODEL_PARALLEL[0])
            flat = y.reshape([-1, *x.shape[dims:]])
            tokens = int(flat.shape[0])
            if tokens % world:
                raise PaddleEmitError(sequence_tokens_error(tokens, world))
            n = tokens // world
            r = group_rank()
            return flat[r * n:(r + 1) * n].clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            parts: list[Any] = []
            dist.all_gather(parts, grad.contiguous(), group=_MODEL_PARALLEL[0])
            return paddle.concat(parts, axis=0).reshape(ctx.shape)

    class AllGatherSequence(PyLayer):  # type: ignore[misc]
        """Sequence parallelism's all-gather of the token shards into [*lead, ...]; backward: this
        rank's token shard of the gradient (summed over ranks by the "f" of its sharded readers,
        so together: the reduce-scatter of Megatron's backward)."""

        @staticmethod
        def forward(ctx: Any, x: Any, lead: list[int], world: int) -> Any:
            ctx.n, ctx.rest = int(x.shape[0]), list(x.shape[1:])
            parts: list[Any] = []
            dist.all_gather(parts, x.contiguous(), group=_MODEL_PARALLEL[0])
            return paddle.concat(parts, axis=0).reshape([*lead, *x.shape[1:]])

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            n, r = ctx.n, group_rank()
            return grad.reshape([-1, *ctx.rest])[r * n:(r + 1) * n].clone()

    return {"reduce_scatter": ReduceScatter, "all_gather_sequence": AllGatherSequence}


@_op("linear")
def _linear(L: Any, n: Node, a: list[Any]) -> list[Any]:
    y = L.P.matmul(a[0], a[1])
    return [y if _arg(a, 2) is None else y + a[2]]


def _dequant_matmul(L: Any, x: Any, q: Any, s: Any, bias: Any, group_size: int) -> Any:
    w = L.P.cast(q, "float32") * _expand_scale(L.P, s, q.shape[-2], group_size)
    y = L.P.matmul(x, w)
    return y if bias is None else y + bias


@_op("weight_only_linear")
def _weight_only_linear(L: Any, n: Node, a: list[Any]) -> list[Any]:
    dev = L._device_weights.get(id(n))
    if dev is not None:
        return [L._device_weight_only(a[0], dev, _arg(a, 3))]
    return [_dequant_matmul(L, a[0], a[1], a[2], _arg(a, 3), n.attrs.group_size)]


@_op("weight_only_linear_packed")
def _weight_only_linear_packed(L: Any, n: Node, a: list[Any]) -> list[Any]:
    dev = L._device_weights.get(id(n))
    if dev is not None:
        return [L._device_weight_only(a[0], dev, _arg(a, 3))]
    q = getattr(L, L._node_consts[id(n)])  # the logical int values, unpacked at build time
    return [_dequant_matmul(L, a[0], q, a[2], _arg(a, 3), n.attrs.group_size)]


@_op("weight_only_linear_xpu")
def _weight_only_linear_xpu(L: Any, n: Node, a: list[Any]) -> list[Any]:
    # portable form of the XPU layout: int8 [N, K] transposed back to [K, N], dequantized, matmul
    q = L.P.transpose(a[1], [1, 0])
    return [_dequant_matmul(L, a[0], q, a[2], _arg(a, 3), -1)]


@_op("dequantize")
def _dequantize(L: Any, n: Node, a: list[Any]) -> list[Any]:
    q, s = a
    P = L.P
    if n.inputs[0] is not None and n.inputs[0].type.dtype in (DType.F8E4M3, DType.F8E5M2):
        w = q * s.reshape(list(s.shape) + [1] * (len(q.shape) - len(s.shape)))
    elif id(n) in getattr(L, "_expert_stacks", ()):  # read by MoE experts only: dequantized per expert
        return [_ExpertStack(P, q, s, n.attrs.group_size, n.attrs.dtype)]
    else:
        w = P.cast(q, "float32") * _expand_scale(P, s, q.shape[-2], n.attrs.group_size)
    return [_round_to(P, w, n.attrs.dtype)]


@_op("rms_norm")
def _rms_norm(L: Any, n: Node, a: list[Any]) -> list[Any]:
    x, w = a
    var = L.P.mean(L.P.square(x), axis=-1, keepdim=True)
    return [x / L.P.sqrt(var + n.attrs.eps) * w]


@_op("layer_norm")
def _layer_norm(L: Any, n: Node, a: list[Any]) -> list[Any]:
    P, x = L.P, a[0]
    c = x - P.mean(x, axis=-1, keepdim=True)
    y = c / P.sqrt(P.mean(P.square(c), axis=-1, keepdim=True) + n.attrs.eps)
    if _arg(a, 1) is not None:
        y = y * a[1]
    if _arg(a, 2) is not None:
        y = y + a[2]
    return [y]


@_op("rope")
def _rope(L: Any, n: Node, a: list[Any]) -> list[Any]:
    """x * cos + partner(x) * (-sin | +sin): the pair (x1, x2) becomes (x1 cos - x2 sin,
    x2 cos + x1 sin), with each lane's partner gathered (interleaved: 2i <-> 2i + 1, half:
    i <-> i + D/2) rather than sliced out (a strided slice of the last axis makes every
    elementwise op it feeds a slow one). a + (-b) rounds as a - b does: the same values."""
    P, x = L.P, a[0]
    d = int(x.shape[3])
    pos = _arg(a, 1)
    interleaved = n.attrs.style == "interleaved"
    # q and k of a layer rotate by the same angles: an eager call computes them once per forward
    # (keyed by the positions tensor, which lives for the whole forward); tracing does not cache.
    cache = getattr(L, "_forward_cache", None) if P.in_dynamic_mode() else None
    key = ("rope", id(pos) if pos is not None else int(x.shape[1]), d, n.attrs.theta, interleaved)
    if cache is not None and key in cache:
        cos, sin, partner = cache[key]
    else:
        inv = P.to_tensor(rope_angles(np.ones((), np.float32), d, n.attrs.theta).reshape(-1))
        if pos is None:
            pos = P.arange(P.shape(x)[1], dtype="int64").unsqueeze(0)
        ang = (P.cast(pos, "float32").unsqueeze(-1) * inv).unsqueeze(2)  # [B|1, S, 1, D/2]
        cos, sin = P.cos(ang), P.sin(ang)
        lanes = np.arange(d, dtype=np.int64)
        if interleaved:
            cos = P.repeat_interleave(cos, 2, axis=-1)
            sin = P.reshape(P.stack([-sin, sin], axis=-1), [0, 0, 0, d])
            partner = P.to_tensor(lanes ^ 1)
        else:
            cos, sin = P.concat([cos, cos], axis=-1), P.concat([-sin, sin], axis=-1)
            partner = P.to_tensor((lanes + d // 2) % d)
        if cache is not None:
            cache[key] = (cos, sin, partner)
    if cache is not None:  # eager: the angles expanded to x's shape (a broadcast multiply is slower)
        full = (*key, tuple(x.shape))
        if full not in cache:
            cache[full] = tuple(P.expand(t, x.shape).contiguous() for t in (cos, sin))
        cos, sin = cache[full]
    return [x * cos + P.gather(x, partner, axis=3) * sin]


@_op("attention")
def _attention(L: Any, n: Node, a: list[Any]) -> list[Any]:
    P = L.P
    q, k, v = a[0], a[1], a[2]
    mask = _arg(a, 3)
    h, kv, d = int(q.shape[2]), int(k.shape[2]), int(q.shape[3])
    scale = n.attrs.scale if n.attrs.scale is not None else 1.0 / math.sqrt(d)
    qh = P.transpose(q, [0, 2, 1, 3])  # [B, H, S, D]
    kh = P.transpose(k, [0, 2, 1, 3])  # [B, KV, T, D]
    vh = P.transpose(v, [0, 2, 1, 3])
    group = h // kv
    # Query head i reads kv head i // group: the query heads are grouped onto their kv head
    # ([B, KV, group*S, D]) rather than the keys and values copied out to H heads, so a decode
    # step reads its cache once.
    if group > 1:
        qh = P.reshape(qh, [0, kv, -1, d])
    scores = P.matmul(qh, kh, transpose_y=True) * scale
    if group > 1:
        scores = P.reshape(scores, [0, h, -1, 0])  # [B, H, S, T] (0: that dim as it is)
    keep = _causal_keep(L, q, k) if n.attrs.causal else None
    if mask is not None:
        probs = _masked_softmax(L, scores, keep, mask)
    else:
        if keep is not None:
            scores = P.where(keep, scores, P.full_like(scores, float("-inf")))
        probs = L.F.softmax(scores, axis=-1)
    if group > 1:
        probs = P.reshape(probs, [0, kv, -1, 0])
    out = P.matmul(probs, vh)  # [B, KV, group*S, Dv]
    if group > 1:
        out = P.reshape(out, [0, h, -1, 0])
    return [P.transpose(out, [0, 2, 1, 3])]


_LOWEST = float(np.finfo(np.float32).min)


def _masked_softmax(L: Any, scores: Any, causal: Any, mask: Any) -> Any:
    """softmax over the keys a query may see, zeros for a query that may see none (the kernel's
    fully masked row: a left pad's query row, whose every key is a pad). Masked scores become
    the lowest float32 rather than -inf (exp of it less any finite peak is exactly 0, as exp(-inf)
    is), so a fully masked row's softmax is a finite uniform row, multiplied by 0; softmax of a
    row of -inf would be NaN, and 0 * NaN in the next layer's matmul poisons every row.

    A bool mask (the kv-cache pass's key_padding_mask) combines with the causal mask; their
    combination and the rows that see a key are made once per forward when eager (keyed by the
    mask tensor, which lives for the whole forward). A float mask is added; -inf in it masks."""
    P = L.P
    if mask.dtype == P.bool:
        cache = getattr(L, "_forward_cache", None) if P.in_dynamic_mode() else None
        key = ("keep", id(mask), None if causal is None else id(causal))
        if cache is not None and key in cache:
            keep, live = cache[key]
        else:
            keep = mask if causal is None else P.logical_and(causal, mask)
            live = P.cast(P.any(keep, axis=-1, keepdim=True), "float32")  # [B|1, 1, S|1, 1]
            if cache is not None:
                cache[key] = (keep, live)
        scores = P.where(keep, scores, P.full_like(scores, _LOWEST))
    else:
        scores = scores + mask
        if causal is not None:
            scores = P.where(causal, scores, P.full_like(scores, float("-inf")))
        live = P.cast(P.isfinite(P.max(scores, axis=-1, keepdim=True)), "float32")
        scores = P.maximum(scores, P.full_like(scores, _LOWEST))
    return L.F.softmax(scores, axis=-1) * live


def _causal_keep(L: Any, q: Any, k: Any) -> Any:
    """[S, T] bool: query i sees key j <= i + T - S. Eager: None when nothing is masked (one
    query row), else made once per forward; traced: computed from the dynamic shapes."""
    P = L.P
    if not P.in_dynamic_mode():
        s_len, t_len = P.shape(q)[1], P.shape(k)[1]
        return P.arange(t_len).unsqueeze(0) <= P.arange(s_len).unsqueeze(1) + (t_len - s_len)
    s_len, t_len = int(q.shape[1]), int(k.shape[1])
    if s_len == 1:
        return None
    cache = getattr(L, "_forward_cache", None)
    key = ("causal", s_len, t_len)
    keep = None if cache is None else cache.get(key)
    if keep is None:
        keep = P.to_tensor(np.tril(np.ones((s_len, t_len), dtype=bool), t_len - s_len))
        if cache is not None:
            cache[key] = keep
    return keep


@_op("gelu")
def _gelu(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return [L.F.gelu(a[0], approximate=n.attrs.approximate == "tanh")]


@_op("softmax")
def _softmax(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return [L.F.softmax(a[0], axis=n.attrs.axis)]


@_op("add")
def _add(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return [a[0] + a[1]]


@_op("mul")
def _mul(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return [a[0] * a[1]]


@_op("cast")
def _cast(L: Any, n: Node, a: list[Any]) -> list[Any]:
    dt: DType = n.attrs.dtype
    if dt.is_float:
        return [_round_to(L.P, L.P.cast(a[0], "float32"), dt)]
    return [L.P.cast(a[0], _int_name(dt))]


@_op("lm_head")
def _lm_head(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return [L.P.matmul(a[0], a[1], transpose_y=n.attrs.transpose_weight)]


@_op("split")
def _split(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return list(L.P.split(a[0], list(n.attrs.sizes), axis=n.attrs.axis))


@_op("concat")
def _concat(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return [L.P.concat(list(a), axis=n.attrs.axis)]


@_op("reshape")
def _reshape(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return [L.P.reshape(a[0], list(n.attrs.shape))]  # 0 and -1 mean what they mean in the IR


@_op("transpose")
def _transpose(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return [L.P.transpose(a[0], list(n.attrs.perm))]


@_op("stack")
def _stack(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return [L.P.stack(list(a), axis=0)]


@_op("position_ids")
def _position_ids(L: Any, n: Node, a: list[Any]) -> list[Any]:
    P, ids = L.P, a[0]
    index = _arg(a, 1)
    if index is not None:  # a decoder's position_ids input: each token's index in its own row
        return [P.cast(index, "int64") * n.attrs.stride + n.attrs.offset]
    pos = P.arange(P.shape(ids)[1], dtype="int64") * n.attrs.stride + n.attrs.offset
    return [P.zeros_like(ids, dtype="int64") + pos.unsqueeze(0)]


@_op("kv_cache_append")
def _kv_cache_append(L: Any, n: Node, a: list[Any]) -> list[Any]:
    """present = concat(past, new transposed to [B, KV, S, D]) on the length axis."""
    P = L.P
    past, new, mask = a
    if P.in_dynamic_mode():  # the kernel's check (traced: the shapes are not known here)
        p, s, t = int(past.shape[2]), int(new.shape[1]), int(mask.shape[1])
        if p + s != t:
            raise PaddleEmitError(f"kv_cache_append: past length {p} + {s} new tokens = {p + s}, but "
                                  f"the attention_mask covers {t}: the mask must cover the past and "
                                  "the new tokens")
    return [P.concat([past, P.transpose(new, [0, 2, 1, 3])], axis=2)]


@_op("key_padding_mask")
def _key_padding_mask(L: Any, n: Node, a: list[Any]) -> list[Any]:
    """keep [B, 1, 1, T]: where the attention_mask [B, T] holds a real token (not 0)."""
    return [L.P.unsqueeze(a[0] != 0, [1, 2])]


@_op("moe_gate")
def _moe_gate(L: Any, n: Node, a: list[Any]) -> list[Any]:
    P = L.P
    probs = L.F.softmax(P.matmul(a[0], a[1]), axis=-1)
    bias = _arg(a, 2)
    scores = probs if bias is None else probs + bias.reshape([-1])
    idx = P.argsort(scores, axis=-1, descending=True, stable=True)[..., : n.attrs.top_k]
    w = P.take_along_axis(probs, idx, axis=-1)
    if n.attrs.normalize:
        w = w / P.clip(P.sum(w, axis=-1, keepdim=True), min=n.attrs.norm_min)
    return [w, idx]


class _ExpertStack:
    """A stacked int8/int4 expert weight [E, K, N] whose `dequantize` is deferred to the MoE op,
    so that only the experts a call routes to are dequantized (`stack[e]`); `full()` is all."""

    def __init__(self, P: Any, q: Any, s: Any, group_size: int, dtype: DType) -> None:
        self.P, self.q, self.s, self.group_size, self.dtype = P, q, s, group_size, dtype
        self.shape = q.shape

    def __getitem__(self, e: int) -> Any:
        s = self.s if len(self.s.shape) == 0 else self.s[e]
        w = self.P.cast(self.q[e], "float32") * _expand_scale(self.P, s, self.q.shape[-2], self.group_size)
        return _round_to(self.P, w, self.dtype)

    def full(self) -> Any:
        w = self.P.cast(self.q, "float32") * _expand_scale(self.P, self.s, self.q.shape[-2], self.group_size)
        return _round_to(self.P, w, self.dtype)


def _whole(w: Any) -> Any:
    return w.full() if isinstance(w, _ExpertStack) else w


def _moe(L: Any, n: Node, a: list[Any], lora: bool) -> list[Any]:
    """The grouped (sparse) experts unless the layer's `moe_dense` is set: each expert runs on the
    rows routed to it only."""
    if getattr(L, "moe_dense", False):
        return _moe_dense(L, n, [_whole(v) for v in a], lora)
    return _moe_sparse(L, n, a, lora)


def _moe_sparse(L: Any, n: Node, a: list[Any], lora: bool) -> list[Any]:
    """Grouped by expert: each expert a call routes to runs its FFN on the rows routed to it
    alone, with its weights sliced (and dequantized) for it only, and the weighted rows are
    index_added back. Slots of weight 0 (experts another rank holds, moe_local_experts) are
    skipped; the dense form adds 0 for them. Differentiable (gather / concat / index_add).

    Eager runs read one array to the host per call (each (row, slot) pair's expert, -1 for a
    zero weight) for the experts' row counts, and write nothing back: the device sorts the
    pairs by expert (stable, as the counts are), then one gather of the rows, one activation,
    one weighting and one index_add serve all experts, so that the per-expert work is its two
    matmuls (per-op overhead is what separates a decode step from its weight reads). A traced
    program (no data-dependent loop) visits every expert with its (possibly empty) row
    set instead. Both add each row's contributions in ascending expert order."""
    P = L.P
    x, wts, idx, ug = a[:4]
    e, hidden = int(ug.shape[0]), int(x.shape[-1])
    k = int(wts.shape[-1])
    xt = P.reshape(x, [-1, hidden])
    if not P.in_dynamic_mode():
        flat_w = P.reshape(wts, [-1, k])
        masked = P.where(flat_w != 0, P.reshape(idx, [-1, k]).astype("int64"),
                         P.full_like(P.reshape(idx, [-1, k]), -1, dtype="int64"))
        out = P.zeros_like(xt)
        for ex in range(e):
            hits = P.nonzero(masked == ex)  # [n, 2]: (row, slot)
            rows = hits[:, 0]
            y = _expert_ffns(L, n, a, lora, [ex], P.gather(xt, rows, axis=0))
            out = P.index_add(out, rows, 0, y * P.gather_nd(flat_w, hits).unsqueeze(-1))
        return [P.reshape(out, P.shape(x))]
    flat_w, flat_i = P.reshape(wts, [-1]), P.reshape(idx, [-1])
    if flat_i.dtype != P.int64:
        flat_i = flat_i.astype("int64")
    masked = P.where(flat_w != 0, flat_i, P.full_like(flat_i, -1))  # pair (row * k + slot) -> expert
    counts = np.bincount(masked.numpy() + 1, minlength=e + 1)  # the host sync; [0]: weight-0 pairs
    skip = int(counts[0])
    if skip == counts.sum():
        return [P.zeros_like(x)]
    order = P.argsort(masked, stable=True)[skip:]  # the held pairs by expert, then by pair
    rows = order // k
    experts = np.flatnonzero(counts[1:])
    sizes = counts[1:][experts].tolist()
    y = _expert_ffns(L, n, a, lora, experts.tolist(), P.gather(xt, rows, axis=0), sizes)
    y = y * P.gather(flat_w, order).unsqueeze(-1)
    return [P.reshape(P.index_add(P.zeros_like(xt), rows, 0, y), x.shape)]


def _expert_ffns(L: Any, n: Node, a: list[Any], lora: bool, experts: list[int], v: Any,
                 sizes: list[int] | None = None) -> Any:
    """The SwiGLU FFNs (with their LoRA adapters) of `experts` on their rows of `v`: sizes[i]
    consecutive rows for experts[i] (None: one expert, every row). Each expert's two matmuls
    run alone; the activation runs once on all the rows (the same values, fewer ops)."""
    P = L.P
    ug, dn = a[3], a[4]
    pad = list(a) + [None] * (9 - len(a))
    many = sizes is not None and len(sizes) > 1

    def each(t: Any) -> list[Any]:
        return list(P.split(t, sizes, axis=0)) if many else [t]

    def joined(parts: list[Any]) -> Any:
        return P.concat(parts, axis=0) if many else parts[0]

    hs = []
    for ex, vi in zip(experts, each(v), strict=True):
        h = P.matmul(vi, ug[ex])
        if lora and pad[5] is not None:
            h = h + P.matmul(P.matmul(_drop(L, n, vi), pad[5][ex]), pad[6][ex]) * n.attrs.scale
        hs.append(h)
    gate, up = P.split(joined(hs), 2, axis=-1)  # contiguous halves (last-axis slices are strided)
    ys = []
    for ex, act in zip(experts, each(L.F.silu(gate) * up), strict=True):
        y = P.matmul(act, dn[ex])
        if lora and pad[7] is not None:
            y = y + P.matmul(P.matmul(_drop(L, n, act), pad[7][ex]), pad[8][ex]) * n.attrs.scale
        ys.append(y)
    return joined(ys)


def _moe_dense(L: Any, n: Node, a: list[Any], lora: bool) -> list[Any]:
    """Dense formulation (checking form): every expert runs on every token; the routing weights
    (zero for the experts a token did not choose) combine them. Same math as the grouped kernel."""
    P = L.P
    x, wts, idx, ug, dn = a[:5]
    e, inter, hidden = int(ug.shape[0]), int(dn.shape[1]), int(x.shape[-1])
    xt = P.reshape(x, [-1, hidden])
    k = int(wts.shape[-1])
    combine = P.sum(L.F.one_hot(P.reshape(idx, [-1, k]), e) * P.reshape(wts, [-1, k]).unsqueeze(-1), axis=1)
    h = P.matmul(xt.unsqueeze(0), ug)  # [E, T, 2I]
    scale = n.attrs.scale if lora else 0.0
    pad = list(a) + [None] * (9 - len(a))
    if lora and pad[5] is not None:
        h = h + P.matmul(P.matmul(_drop(L, n, xt).unsqueeze(0), pad[5]), pad[6]) * scale
    act = L.F.silu(h[..., :inter]) * h[..., inter:]
    y = P.matmul(act, dn)  # [E, T, H]
    if lora and pad[7] is not None:
        y = y + P.matmul(P.matmul(_drop(L, n, act), pad[7]), pad[8]) * scale
    out = P.sum(y * P.transpose(combine, [1, 0]).unsqueeze(-1), axis=0)
    return [P.reshape(out, P.shape(x))]


def _drop(L: Any, n: Node, x: Any) -> Any:
    p = getattr(n.attrs, "dropout", 0.0)
    return L.F.dropout(x, p=p, training=True) if p > 0 and L.training else x


@_op("moe_experts")
def _moe_experts(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return _moe(L, n, a, lora=False)


@_op("moe_experts_lora")
def _moe_experts_lora(L: Any, n: Node, a: list[Any]) -> list[Any]:
    return _moe(L, n, a, lora=True)


@_op("lora")
def _lora(L: Any, n: Node, a: list[Any]) -> list[Any]:
    base, x, la, lb = a
    return [base + L.P.matmul(L.P.matmul(_drop(L, n, x), la), lb) * n.attrs.scale]


@_op("fake_quant")
def _fake_quant(L: Any, n: Node, a: list[Any]) -> list[Any]:
    x = a[0]
    s = _abs_max(L.P, x, n.attrs.axes).detach()
    return [_ste(x, _fq(L.P, x.detach(), s, n.attrs.bits, n.attrs.round_type))]


@_op("fake_quant_moving_average")
def _fake_quant_ma(L: Any, n: Node, a: list[Any]) -> list[Any]:
    P = L.P
    x, scale, accum, state = a
    at = n.attrs
    if at.is_test:
        return [_ste(x, _fq(P, x.detach(), scale, at.bits, at.round_type)), scale, state, accum]
    r = at.moving_rate
    new_state = state * r + 1.0
    new_accum = accum * r + P.max(P.abs(x.detach())).reshape([1])
    s = new_accum / new_state
    if L.track_state:
        L._pending.extend([(n.inputs[1], s), (n.inputs[2], new_accum), (n.inputs[3], new_state)])
    return [_ste(x, _fq(P, x.detach(), s, at.bits, at.round_type)), s, new_state, new_accum]


@_op("pact")
def _pact(L: Any, n: Node, a: list[Any]) -> list[Any]:
    x, alpha = a
    return [(x - L.F.relu(x - alpha)) + L.F.relu(-alpha - x)]


@_op("fake_quant_fp8")
def _fake_quant_fp8(L: Any, n: Node, a: list[Any]) -> list[Any]:
    P, x = L.P, a[0]
    m = _abs_max(P, x.detach(), n.attrs.axes)
    top = float(FP8_MAX[n.attrs.format])
    s = P.where(m == 0, P.ones_like(m), m / top)
    return [_ste(x, _fp8_fq(P, x.detach(), s, n.attrs.format))]


@_op("fp8_linear")
def _fp8_linear(L: Any, n: Node, a: list[Any]) -> list[Any]:
    x, w, ws, xs = a[:4]
    y = L.P.matmul(_fp8_fq(L.P, x, xs, n.attrs.format), w * ws)
    return [y if _arg(a, 4) is None else y + a[4]]


_INT_NAMES = {DType.I64: "int64", DType.I32: "int32", DType.I8: "int8", DType.I4: "int8",
              DType.U8: "uint8", DType.BOOL: "bool"}


def _int_name(dt: DType) -> str:
    try:
        return _INT_NAMES[dt]
    except KeyError:
        raise PaddleEmitError(f"no Paddle dtype for {dt}") from None


def _param_array(p: Param) -> np.ndarray:
    arr = np.asarray(p.read())
    if p.type.dtype.is_float:
        return np.ascontiguousarray(arr.astype(np.float32))
    return np.ascontiguousarray(arr.astype(np.dtype(_int_name(p.type.dtype))))


def device_arch(paddle: Any) -> int:
    """The CUDA arch Paddle's weight-only kernel takes for the current GPU (backends.paddle.devices)."""
    return devices.cuda_arch()


_LAYER_CLASS: type | None = None


def _layer_class() -> type:
    global _LAYER_CLASS
    if _LAYER_CLASS is not None:
        return _LAYER_CLASS
    paddle = require_paddle()

    class GraphLayer(paddle.nn.Layer):  # type: ignore[misc, name-defined]
        """forward(*graph inputs) -> the graph's output (a tuple if it has several)."""

        def _device_weight_only(self, x: Any, dev: dict[str, Any], bias: Any) -> Any:
            P = self.P
            dt = dev["dtype"]
            y = P.nn.quant.weight_only_linear(
                P.cast(x, dt), getattr(self, dev["weight"]),
                bias=None if bias is None else P.cast(bias, dt),
                weight_scale=getattr(self, dev["scale"]), weight_dtype=dev["weight_dtype"],
                arch=dev["arch"], group_size=dev["group_size"])
            return P.cast(y, "float32")

        def forward(self, *inputs: Any) -> Any:
            return self._run(list(inputs))

        @paddle.jit.not_to_static
        def _run(self, inputs: list[Any]) -> Any:
            # Not AST-transformed: tracing runs this code as is (no data-dependent control flow).
            env: dict[int, Any] = dict(zip(self._input_slots, inputs, strict=True))
            self._forward_cache: dict[Any, Any] = {}  # per forward (see _rope, _causal_keep)
            for slot, attr in self._param_slots.items():
                env[slot] = getattr(self, attr)
            for fn, node, ins, outs in self._program:
                args = [None if s is None else env[s] for s in ins]
                while args and args[-1] is None:
                    args.pop()
                for s, r in zip(outs, fn(self, node, args), strict=True):
                    env[s] = r
            res = [env[s] for s in self._output_slots]
            return res[0] if len(res) == 1 else tuple(res)

        def commit_state(self) -> int:
            """Write the queued QAT moving-average state into its params; returns how many."""
            n = 0
            with self.P.no_grad():
                for p, value in self._pending:
                    self.P.assign(value.detach().reshape(self.tensor(p).shape), self.tensor(p))
                    n += 1
            self._pending = []
            return n

        def tensor(self, p: Param | str) -> Any:
            """The Paddle tensor that holds IR param `p`."""
            name = p if isinstance(p, str) else p.name
            return getattr(self, self.param_attrs[name])

        def trainable_parameters(self) -> list[Any]:
            return [self.tensor(n) for n in self.trainable_names]

        def state_numpy(self, names: Sequence[str]) -> dict[str, np.ndarray]:
            return {n: np.asarray(self.tensor(n).numpy()) for n in names}

    _LAYER_CLASS = GraphLayer
    return GraphLayer


_FOLDED = ("unpack_weight", "unpack_weight_xpu")  # packed layouts back to int values, at build time


def lowers(op: OpDef) -> bool:
    """Whether `op` has a Paddle lowering: its own `lower_paddle`, or `OPS` (or folded at build)."""
    return op.lower_paddle is not None or op.name in OPS or op.name in _FOLDED


def unsupported_ops(graph: Graph) -> list[str]:
    """The ops of `graph` with no Paddle lowering (sorted, unique)."""
    return sorted({n.op for n in graph if not lowers(n.opdef)})


def build_layer(graph: Graph, *, device: str | None = None, portable: bool | None = None,
                grad_sync: bool = False) -> Any:
    """A `paddle.nn.Layer` evaluating `graph` with Paddle ops, for `device` (default: Paddle's current).

    portable=None: Paddle's weight-only kernel on GPUs, the portable form elsewhere;
    portable=True: always the portable form (what a CPU can trace and `paddle.jit.save`).
    grad_sync=True (training a rank graph of world_size > 1): each replicated float value or
    trainable param that a rank-dependent node reads (`rank_varying`) goes through the "f"
    function (identity forward, all-reduce backward), so every gradient is the whole model's.
    """
    paddle = require_paddle()
    unknown = unsupported_ops(graph)
    if unknown:
        raise PaddleEmitError(f"the Paddle emitter has no lowering for op(s) {', '.join(unknown)}")
    dev = device or devices.current_device()
    arch = devices.cuda_arch() if devices.device_kind(dev) == "gpu" and not portable else None
    if device is not None:
        devices.set_device(device)
    builder = _LayerBuilder(paddle, graph, grad_sync)
    for node in graph:
        builder.lower(node, dev, bool(portable), arch)
    return builder.finish(dev)


class _LayerBuilder:
    """The Layer `build_layer` returns, filled node by node: its params and folded constants, and
    the program of (op lowering, node, input slots, output slots) its forward runs."""

    def __init__(self, paddle: Any, graph: Graph, grad_sync: bool) -> None:
        self.paddle, self.graph = paddle, graph
        layer = self.layer = _layer_class()()
        layer.P, layer.F = paddle, paddle.nn.functional
        layer.track_state = False
        layer._pending = []
        layer.graph_name = graph.metadata.get("model", "")
        parallel = graph.metadata.get("parallel") or {}
        layer.world_size = int(parallel.get("world_size", 1)) if isinstance(parallel, dict) else 1
        layer.rank = int(parallel.get("rank", 0)) if isinstance(parallel, dict) else 0
        self.sync = grad_sync and layer.world_size > 1
        self.varying = rank_varying(graph) if self.sync else set()
        self.synced: dict[int, int] = {}  # value id -> slot of its "f" copy (one per value, all readers)
        self.slots: dict[Any, int] = {}
        layer._input_slots = [self.slot(v) for v in graph.inputs]
        layer.param_attrs = {}
        layer.trainable_names = []
        layer._param_slots = {}
        layer.kernels = {}
        layer._device_weights = {}
        layer._node_consts = {}
        layer.moe_dense = False  # True: MoE experts run densely (every expert on every token), for checking
        # deferred per-expert dequantize (not when rank-varying reads go through the "f" function)
        layer._expert_stacks = set() if self.sync else {id(n) for n in graph if _feeds_experts_only(n)}
        self.consts: dict[int, np.ndarray] = {}  # folded values (unpack_weight of params), by value id
        self.program: list[tuple[OpImpl, Node, list[int | None], list[int]]] = []

    def slot(self, v: Value) -> int:
        return self.slots.setdefault(id(v), len(self.slots))

    def value_array(self, v: Value) -> np.ndarray | None:
        if isinstance(v, Param):
            return np.asarray(v.read())
        return self.consts.get(id(v))

    def add_param(self, p: Param) -> None:
        layer, paddle = self.layer, self.paddle
        if p.name in layer.param_attrs:
            return
        attr = f"p{len(layer.param_attrs)}"
        arr = _param_array(p)
        if p.type.dtype.is_float:
            lr = float(p.annotations.get("learning_rate", 1.0))
            # Assign(arr) would turn the array into a Python list of floats (65M objects for one
            # 32000 x 2048 embedding): create the parameter zeroed, then copy the array in.
            t = layer.create_parameter(
                list(arr.shape), dtype="float32",
                attr=paddle.ParamAttr(learning_rate=lr, trainable=p.trainable),
                default_initializer=paddle.nn.initializer.Constant(0.0))
            t.set_value(arr)
            del arr
            t.stop_gradient = not p.trainable
            layer.add_parameter(attr, t)
            if p.trainable:
                layer.trainable_names.append(p.name)
        else:
            layer.register_buffer(attr, paddle.to_tensor(arr), persistable=True)
        layer.param_attrs[p.name] = attr
        layer._param_slots[self.slot(p)] = attr

    def add_const(self, v: Value, arr: np.ndarray) -> None:
        attr = f"c{len(self.consts)}"
        self.consts[id(v)] = arr
        self.layer.register_buffer(attr, self.paddle.to_tensor(arr), persistable=True)
        self.layer._param_slots[self.slot(v)] = attr

    def logical_packed(self, n: Node) -> np.ndarray:
        at = n.attrs
        packed = np.asarray(self.value_array(n.inputs[1]))
        rows = packed.shape[0]
        return unpack(packed, at.in_features, rows if at.bits == 8 else 2 * rows, at.bits, at.arch)

    def lower(self, node: Node, dev: str, portable: bool, arch: int | None) -> None:
        """Append `node` to the program (a function of params is folded now instead)."""
        if node.op in _FOLDED:  # a function of params: fold it now (int values, stored int8)
            parts = [self.value_array(v) for v in node.inputs if v is not None]
            if any(x is None for x in parts):
                raise PaddleEmitError(f"{node.op} at {node.scope}: its inputs must be params")
            res = node.opdef.kernel(parts, node.attrs)[0]
            self.add_const(node.outputs[0], np.asarray(res).astype(np.int8))
            return
        for v in node.inputs:
            if isinstance(v, Param):
                self.add_param(v)
        if node.op in ("weight_only_linear", "weight_only_linear_packed"):
            _plan_weight_only(self.layer, self.paddle, node, dev, portable, arch, self.logical_packed,
                              self.value_array)
        ins: list[int | None] = [None if v is None else self.slot(v) for v in node.inputs]
        if self.sync and node.op not in COLLECTIVE_OPS and any(id(o) in self.varying for o in node.outputs):
            self._sync_inputs(node, ins)
        self.program.append((node.opdef.lower_paddle or OPS[node.op], node, ins,
                             [self.slot(v) for v in node.outputs]))

    def _sync_inputs(self, node: Node, ins: list[int | None]) -> None:
        """Route the replicated float inputs of a rank-dependent node through the "f" function."""
        for i, v in enumerate(node.inputs):
            if (v is None or id(v) in self.varying or not v.type.dtype.is_float
                    or (isinstance(v, Param) and (not v.trainable or SHARD in v.annotations))):
                continue  # no gradient, or a slice whose gradient this rank holds whole
            if id(v) not in self.synced:
                self.synced[id(v)] = self.slots.setdefault(("f", id(v)), len(self.slots))
                self.program.append((_copy_to_parallel, node, [self.slot(v)], [self.synced[id(v)]]))
            ins[i] = self.synced[id(v)]

    def finish(self, dev: str) -> Any:
        layer = self.layer
        for v in self.graph.outputs:
            if isinstance(v, Param):
                self.add_param(v)
        layer._program = self.program
        layer.synced_values = len(self.synced)
        layer._output_slots = [self.slot(v) for v in self.graph.outputs]
        layer.output_names = list(self.graph.output_names)
        layer.device = dev
        return layer


def _feeds_experts_only(n: Node) -> bool:
    """A stacked int `dequantize` read only as the expert weights of MoE ops (deferred per expert)."""
    if n.op != "dequantize" or n.inputs[0] is None or n.inputs[0].type.dtype not in (DType.I8, DType.I4):
        return False
    uses = n.outputs[0].uses
    return bool(uses) and n.outputs[0].type.rank == 3 and all(
        u.op in ("moe_experts", "moe_experts_lora") and i in (3, 4) for u, i in uses)


def _plan_weight_only(layer: Any, paddle: Any, node: Node, device: str, portable: bool,
                      arch: int | None, logical_packed: Callable[[Node], np.ndarray],
                      value_array: Callable[[Value], np.ndarray | None]) -> None:
    """Choose Paddle's device kernel or the portable form for one weight-only linear
    (ernie_ir.backends.paddle.devices.weight_only_kernel decides; the Layer calls the GPU kernel)."""
    packed = node.op == "weight_only_linear_packed"
    q = logical_packed(node) if packed else None
    where = node.scope or node.outputs[0].name or "?"
    w = node.inputs[1]
    bits = node.attrs.bits if packed else (4 if w is not None and w.type.dtype == DType.I4 else 8)
    choice = devices.weight_only_kernel(device, bits, arch, portable=portable)
    if choice.device_kernel:
        arch = choice.arch
        logical = q if q is not None else np.asarray(value_array(w)).astype(np.int8)  # type: ignore[arg-type]
        k, n = logical.shape
        if packable(k, n, bits, arch) is None and node.inputs[2] is not None:
            if packed and (node.attrs.arch == 70) == (arch == 70):
                data = np.asarray(value_array(w))  # type: ignore[arg-type]
            else:
                data = pack(logical, bits, arch)
            scale = node.inputs[2]
            sdt = "bfloat16" if scale.type.dtype == DType.BF16 else "float16"
            wa, sa = f"k{len(layer._device_weights)}w", f"k{len(layer._device_weights)}s"
            layer.register_buffer(wa, paddle.to_tensor(data), persistable=True)
            sarr = np.asarray(value_array(scale)).astype(np.float32)  # type: ignore[arg-type]
            layer.register_buffer(sa, paddle.cast(paddle.to_tensor(sarr), sdt), persistable=True)
            layer._device_weights[id(node)] = {
                "weight": wa, "scale": sa, "dtype": sdt, "arch": arch,
                "weight_dtype": "int8" if bits == 8 else "int4", "group_size": node.attrs.group_size}
            layer.kernels[where] = choice.kernel
            return
    if q is not None:
        attr = f"u{len(layer._node_consts)}"
        layer.register_buffer(attr, paddle.to_tensor(q), persistable=True)
        layer._node_consts[id(node)] = attr
    wired = choice.kernel in (devices.PORTABLE, devices.GPU_KERNEL)
    layer.kernels[where] = devices.PORTABLE if wired else f"{devices.PORTABLE}; {choice.kernel} not called"
