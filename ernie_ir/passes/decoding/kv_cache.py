"""kv-cache: give every attention a KV cache, so one graph serves prefill and each decode step.

    before                                   after
    input_ids [B, S]                         input_ids [B, S], attention_mask [B, T],
                                             position_ids [B, S],
                                             past_key_values.{i}.key/.value [B, KV, P, D]
    k, v [B, S, KV, D] -> attention          present = kv_cache_append(past, k, attention_mask)
                                             attention(q, transpose(present), ..., keep)
    rope(x)           (positions 0..S-1)     rope(x, position_ids)
    position_ids(ids) (offset + stride*s)    position_ids(ids, position_ids)
    outputs: logits                          logits, present.{i}.key/.value [B, KV, T, D]

The attentions are found from the dataflow (every `attention` node, numbered in graph order),
not from names, so the pass applies to any graph the frontends and passes make: ERNIE 4.5 dense
and MoE (GQA), ERNIE-3.5-SE fused or not, GPT; quantized, with LoRA, split into ranks (a rank's
cache holds the KV heads its attention reads, replicated ones included). The names and layouts
are optimum's and onnxruntime-genai's. T = P + S is the `attention_mask` length; its zeros are
pads (left, right or holes), which no query attends to; `position_ids` is each token's index in
its own sequence (the caller's, so a padded row's positions follow its real tokens).
`dtype` stores the cache in another float dtype than the attention computes (a cast before the
append); the default keeps the keys' dtype, so the decoder computes what the graph did.

C8 (int8 cache): where an attention reads `kv_cache_dequantize(kv_cache_quantize(k, a), a)` (the
`w4a8c8` pass puts that pair in, with calibrated per-channel abs-maxes a), the cache holds the
u8 values: past/present are u8 [B, KV, P, D], the append takes the quantized step and the
attention reads `kv_cache_dequantize(transpose(present))`. `dtype=int8` asserts it (an error
on a graph without calibrated scales); a float `dtype` is refused on such a graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ernie_ir.ir import DType, ErnieIRError, Graph, Node, Value, i64, tensor
from ernie_ir.ir.graph import Param

from ..infra.base import PassContext, PassOptions, function_pass
from ..infra.registry import register_pass

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
PAST = "past_key_values.{i}.{kind}"
PRESENT = "present.{i}.{kind}"
CACHE_KINDS = ("key", "value")
PAST_DIM = "P"
TOTAL_DIM = "T"


class KvCacheError(ErnieIRError):
    """The graph cannot become a decoder (one line: what is in the way)."""


CACHE_DTYPES = ("f32", "bf16", "f16")
"""The element types a cache may have."""


class KvCacheOptions(PassOptions):
    dtype: Literal["f32", "bf16", "f16", "int8"] | None = None
    """The cache's element type; None: the attention's key dtype (u8 where the graph quantizes
    its keys/values to C8); int8: require the C8 cache."""


@dataclass(frozen=True)
class CacheLayout:
    """What a decoder graph's cache looks like: one (kv_heads, head_dim) per attention, in order."""

    layers: tuple[tuple[int, int], ...]
    dtype: str

    @classmethod
    def of(cls, graph: Graph) -> CacheLayout:
        """The layout a decoder graph records (`graph.metadata["kv_cache"]`)."""
        meta = graph.metadata.get("kv_cache")
        if not isinstance(meta, dict):
            raise KvCacheError(f"graph {graph.name} is not a decoder (run the kv-cache pass first)")
        return cls(tuple((int(kv), int(d)) for kv, d in meta["layers"]), str(meta["dtype"]))


def is_decoder(graph: Graph) -> bool:
    """Whether the kv-cache pass has made `graph` a decoder."""
    return isinstance(graph.metadata.get("kv_cache"), dict)


def _ids_input(graph: Graph) -> Value:
    ids = [v for v in graph.inputs if v.name == INPUT_IDS]
    if not ids or len(graph.inputs) != 1:
        names = ", ".join(v.name or "?" for v in graph.inputs) or "none"
        raise KvCacheError(f"a decoder is made from a graph whose only input is {INPUT_IDS}; this one "
                           f"has {names}")
    v = ids[0]
    if not v.type.dtype.is_int or v.type.rank != 2:
        raise KvCacheError(f"{INPUT_IDS} must be integer [B, S], got {v.type}")
    return v


def _node(graph: Graph, anchor: Node, op: str, inputs: list[Value | None], **attrs: object) -> Value:
    node = Node(op, inputs, attrs, scope=anchor.scope)
    graph.insert_before(anchor, node)
    return node.output


def add_kv_cache(graph: Graph, dtype: str | DType | None = None) -> CacheLayout:
    """Make `graph` (one input `input_ids`) a decoder in place; its cache layout.

    KvCacheError (one line) where it cannot: already a decoder, other inputs, no attention, an
    attention that already has a mask or is not causal, a cache dtype that is not a float."""
    if is_decoder(graph):
        raise KvCacheError(f"graph {graph.name} is already a decoder (it has a KV cache)")
    ids = _ids_input(graph)
    attentions = graph.nodes_by_op("attention")
    if not attentions:
        raise KvCacheError(f"graph {graph.name} has no attention, so it has no KV cache to keep")
    want_c8 = dtype in ("int8", "u8", DType.U8)
    c8 = any(_c8_pair(n.inputs[i]) is not None for n in attentions for i in (1, 2))
    if want_c8 and not c8:
        raise KvCacheError(f"graph {graph.name} has no calibrated C8 scales, so it cannot keep an int8 KV "
                           "cache: run the w4a8c8 pass first (it inserts kv_cache_quantize/dequantize)")
    cache = None if want_c8 else DType.parse(dtype) if isinstance(dtype, str) else dtype
    if cache is not None and cache.value not in CACHE_DTYPES:
        raise KvCacheError(f"a KV cache holds {', '.join(CACHE_DTYPES)}; not {cache}")
    if cache is not None and c8:
        raise KvCacheError(f"graph {graph.name} quantizes its KV cache to int8 (C8, calibrated): it "
                           f"cannot keep a {cache} cache (leave the cache dtype unset)")
    for n in attentions:
        if len(n.inputs) > 3 and n.inputs[3] is not None:
            raise KvCacheError(f"the attention at {n.scope or '<root>'} already has a mask; the kv-cache "
                               "pass makes the padding mask itself")
        if not n.attrs.causal:  # type: ignore[attr-defined]
            raise KvCacheError(f"the attention at {n.scope or '<root>'} is not causal: a decoder's "
                               "queries see only earlier tokens")
        k = n.inputs[1]
        assert k is not None
        if k.type.shape[:2] != ids.type.shape or not all(isinstance(d, int) for d in k.type.shape[2:]):
            raise KvCacheError(f"the attention at {n.scope or '<root>'} reads keys {k.type}, not "
                               f"[{', '.join(map(str, ids.type.shape))}, KV, D] of this step's tokens "
                               "with static heads")

    batch, seq = ids.type.shape
    mask = graph.add_input(ATTENTION_MASK, tensor(i64, batch, TOTAL_DIM))
    positions = graph.add_input(POSITION_IDS, tensor(i64, batch, seq))
    first = graph.first
    assert first is not None
    keep_node = Node("key_padding_mask", [mask], scope="")
    graph.insert_before(first, keep_node)
    keep = keep_node.output

    for n in graph.nodes_by_op("position_ids"):
        if len(n.inputs) < 2 or n.inputs[1] is None:
            n.set_input(1, positions)
    for n in graph.nodes_by_op("rope"):
        if len(n.inputs) < 2 or n.inputs[1] is None:
            n.set_input(1, positions)

    layers: list[tuple[int, int]] = []
    dtypes: list[DType] = []  # each cache's dtype, in order (the layout records the first's)
    for i, n in enumerate(attentions):
        presents: list[Value] = []
        for slot, kind in zip((1, 2), CACHE_KINDS, strict=True):
            new = n.inputs[slot]
            assert new is not None and not isinstance(new, Param)
            pair = _c8_pair(new)
            if pair is not None:
                presents.append(_c8_cache(graph, n, slot, pair, PAST.format(i=i, kind=kind), mask))
                dtypes.append(DType.U8)
                continue
            b, _, kv, d = new.type.shape
            dt = cache or new.type.dtype
            dtypes.append(dt)
            past = graph.add_input(PAST.format(i=i, kind=kind), tensor(dt, b, kv, PAST_DIM, d))
            if new.type.dtype != dt:
                new = _node(graph, n, "cast", [new], dtype=dt)
            present = _node(graph, n, "kv_cache_append", [past, new, mask])
            n.set_input(slot, _node(graph, n, "transpose", [present], perm=(0, 2, 1, 3)))
            presents.append(present)
        n.set_input(3, keep)
        for kind, present in zip(CACHE_KINDS, presents, strict=True):
            graph.add_output(present, PRESENT.format(i=i, kind=kind))
        kt = n.inputs[1]
        assert kt is not None
        layers.append((int(kt.type.shape[2]), int(kt.type.shape[3])))
    layout = CacheLayout(tuple(layers), str(dtypes[0]))
    graph.metadata["kv_cache"] = {"layers": [list(x) for x in layout.layers], "dtype": layout.dtype}
    return layout


def _c8_pair(v: Value | None) -> tuple[Node, Node] | None:
    """(kv_cache_quantize, kv_cache_dequantize) when `v` is dequantize(quantize(k)) of one scale."""
    dq = v.producer if v is not None and not isinstance(v, Param) else None
    if dq is None or dq.op != "kv_cache_dequantize":
        return None
    q = dq.inputs[0].producer if dq.inputs[0] is not None else None
    if q is None or q.op != "kv_cache_quantize" or q.inputs[1] is not dq.inputs[1]:
        return None
    return q, dq


def _c8_cache(graph: Graph, attention: Node, slot: int, pair: tuple[Node, Node], past_name: str,
              mask: Value) -> Value:
    """The u8 cache of one C8 key/value input: past u8 -> append(quantized step) -> present; the
    attention reads the dequantized, transposed present. Returns the present."""
    quant, dequant = pair
    step = quant.output
    b, _, kv, d = step.type.shape
    past = graph.add_input(past_name, tensor(DType.U8, b, kv, PAST_DIM, d))
    present = _node(graph, attention, "kv_cache_append", [past, step, mask])
    full = _node(graph, attention, "transpose", [present], perm=(0, 2, 1, 3))
    read = Node("kv_cache_dequantize", [full, dequant.inputs[1]], dequant.attrs, scope=dequant.scope)
    graph.insert_before(attention, read)
    attention.set_input(slot, read.output)
    if not dequant.output.users:
        graph.erase(dequant)
    return present


@register_pass
@function_pass("kv-cache", "Give every attention a KV cache (past_key_values in, present out), an "
               "attention mask and position ids: one graph for prefill and decode.",
               options=KvCacheOptions, produces=("kv-cache",))
def kv_cache(graph: Graph, options: KvCacheOptions, ctx: PassContext) -> bool:
    """See the module docstring."""
    layout = add_kv_cache(graph, options.dtype)
    ctx.count("attentions", len(layout.layers))
    return True
