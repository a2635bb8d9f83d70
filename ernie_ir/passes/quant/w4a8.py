"""w4a8c8: routed experts to W4A8 (int4 weights, static int8 activations) and the KV cache to C8.

FastDeploy's `w4a8c8` (REFERENCE 14) as a conversion of a float MoE graph:

- every `moe_experts` (float stacked weights) becomes `moe_experts_w4a8`: each expert's up_gate and
  down weights int4 per output channel (Paddle's `weight_quantize` int4: scale = abs-max / 7 in
  the weight's dtype, round half away from zero, clip to [-7, 7]), and its two activation inputs
  quantized to int8 with static per-expert scales calibrated here;
- every attention reads its keys and values through `kv_cache_dequantize(kv_cache_quantize(.))`
  with calibrated per-channel abs-maxes (C8): the `kv-cache` pass then keeps the cache as u8.

Calibration runs the graph once on `calibration_tokens` seeded random token ids (or the ids of
`calibration_file`, a .npy of [batch, seq] ints) with the pipeline's evaluator
(`PassContext.evaluator`) and records, from the float activations:

- per expert e: the abs-max of the MoE input over the tokens routed to e (up_gate's input), and
  of silu(gate) * up of those tokens, Hadamard-rotated when `hadamard_block` > 0 (down's input);
- per attention: the abs-max of each key and value channel [KV, D] over every token.

An expert no calibration token reached gets its layer's largest scale over the reached experts
(a warning counts them); fewer calibration tokens than a layer has experts is refused.

Params, per expert stack `<m>` = `ernie.layers.N.mlp.experts.{up_gate_proj,down_proj}`:
`<m>.quant_weight` i4 [E, K, N] (logical values), `<m>.weight_scale` [E, N] in the weight's dtype,
the accumulator's dequantization factor T(f32(ws / 127) / in_scale) for the int4 scale ws
(FastDeploy's in-memory `weight_scale` is this / 16, see ernie_ir/ops/moe_w4a8.py), and
`<m>.in_scale` f32 [E] = 1 / abs-max (FastDeploy's in-memory `*_in_scale`; a pre-permuted
checkpoint stores it as `activation_scale`). Per attention at scope `<a>`:
`<a>.cachek_matmul.activation_scale` / `<a>.cachev_matmul.activation_scale` f32 [KV, D], the
abs-maxes (FastDeploy's checkpoint keys and values). `graph.metadata["w4a8c8"]` records the types
and the calibration.

Under a later `split`, KV abs-maxes follow their heads (a rank holds the global per-channel
values of its heads) and expert scales follow their experts and output columns; the in-scales
stay the global per-expert ones on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from ernie_ir.ir import DType, ErnieIRError, Graph, GraphBuilder, Node, Param, Value, f32, tensor
from ernie_ir.ir.inputs import read_token_ids
from ernie_ir.ir.weights import ArraySource, WeightSource, release_mapped_pages
from ernie_ir.ops.moe import swiglu
from ernie_ir.ops.moe_w4a8 import ACT_BOUND, hadamard_blocks
from ernie_ir.ops.quant_numerics import weight_scales

from ..infra.base import Pass, PassContext, PassOptions
from ..infra.param_placer import ParamPlacer
from ..infra.registry import register_pass
from .config import module_path
from .weight_only import QuantizedWeightSource

FASTDEPLOY_HADAMARD_BLOCK = 128
"""FastDeploy's default `hadamard_block_size` for the w4a8 down_proj input."""
KV_ABSMAX_FLOOR = 1e-8
"""Smallest KV abs-max kept (a channel calibration never saw nonzero), as FastDeploy's XPU loader."""


class W4A8C8Error(ErnieIRError):
    """A graph or calibration set w4a8c8 cannot convert (one line: what and how to fix it)."""


class W4A8C8Options(PassOptions):
    calibration_tokens: int = Field(256, ge=1, le=1 << 16)
    """Length of the seeded random token sequence calibrated on (without calibration_file)."""
    calibration_seed: int = 0
    calibration_file: str | None = None
    """A .npy file of token ids [batch, seq] to calibrate with instead."""
    kv_cache: Literal["int8", "float"] = "int8"
    """int8: C8, the KV cache quantized per channel; float: the cache stays as it is (W4A8 only)."""
    hadamard_block: int = Field(-1, ge=-1)
    """The down_proj input's Hadamard block (FastDeploy's hadamard_block_size): -1, 128 where it
    divides the expert intermediate size, else 0 (no rotation; FastDeploy always rotates, so such
    a model does not run on its w4a8 kernel); 0: none; b: a power of two dividing it."""


class HadamardSource(WeightSource):
    """blockdiag(H_b) @ W / b along the input rows (axis -2) of a base weight, in its dtype."""

    def __init__(self, base: WeightSource, block: int) -> None:
        self.base, self.block = base, block
        self.dtype, self.shape = base.dtype, tuple(base.shape)

    def read(self) -> np.ndarray:
        w = np.asarray(self.base.read())
        rot = hadamard_blocks(w.astype(np.float32), self.block, axis=-2) / np.float32(self.block)
        return rot.astype(w.dtype)

    def describe(self) -> str:
        return f"hadamard<{self.block}>({self.base.describe()})"

    def sliced(self, axis: int, start: int, stop: int) -> WeightSource:
        if axis % len(self.shape) != len(self.shape) - 2:  # experts or columns: the rotation commutes
            return HadamardSource(self.base.sliced(axis, start, stop), self.block)
        return super().sliced(axis, start, stop)


def _vocab(graph: Graph) -> int:
    tables = [n.inputs[1] for n in graph if n.op == "embedding"]
    return int(tables[0].type.shape[0]) if tables else 2  # type: ignore[union-attr]


def _block_for(node: Node, option: int) -> int:
    inter = node.inputs[4].type.shape[1]  # type: ignore[union-attr]
    assert isinstance(inter, int)
    if option == -1:
        return FASTDEPLOY_HADAMARD_BLOCK if inter % FASTDEPLOY_HADAMARD_BLOCK == 0 else 0
    if option and (option & (option - 1) or inter % option):
        raise W4A8C8Error(f"w4a8c8: hadamard_block={option} must be 0 or a power of two dividing the "
                          f"expert intermediate size {inter} (at {node.scope or '<root>'})")
    return option


@register_pass
class W4A8C8(Pass):
    """Routed experts to moe_experts_w4a8 and the KV cache to C8, with calibrated static scales."""

    name = "w4a8c8"
    description = ("FastDeploy W4A8C8: routed experts int4 x static int8 activations, int8 KV cache per "
                   "channel; scales calibrated on token ids.")
    Options = W4A8C8Options
    produces = frozenset({"quantized"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        opts: W4A8C8Options = self.options  # type: ignore[assignment]
        experts = self._experts(graph)
        attentions = graph.nodes_by_op("attention") if opts.kv_cache == "int8" else []
        for n in attentions:
            for i in (1, 2):
                v = n.inputs[i]
                if v is None or isinstance(v, Param) or v.type.rank != 4 or \
                        not all(isinstance(d, int) for d in v.type.shape[2:]):
                    raise W4A8C8Error(f"w4a8c8: the attention at {n.scope or '<root>'} reads keys/values "
                                      f"{v.type if v is not None else None}, not [B, S, KV, D] with static "
                                      "heads: C8 needs them")
                if v.producer is not None and v.producer.op == "kv_cache_dequantize":
                    raise W4A8C8Error(f"w4a8c8: the attention at {n.scope or '<root>'} already reads a "
                                      "C8 cache (run w4a8c8 once)")
        blocks = {n: _block_for(n, opts.hadamard_block) for n in experts}
        weights = {n: self._weight_scales(n, blocks[n]) for n in experts}
        stats = self._calibrate(graph, experts, attentions, blocks, opts, ctx)
        placer = ParamPlacer(graph)
        removed: set[str] = set()
        unreached = 0
        for n in experts:
            removed |= {n.inputs[3].name, n.inputs[4].name}  # type: ignore[union-attr]
            unreached += self._convert_experts(graph, placer, n, blocks[n], weights[n], stats)
        for n in attentions:
            self._convert_attention(graph, n, stats)
        placer.finish(removed=removed)
        if unreached:
            ctx.warn(f"w4a8c8: {unreached} routed expert(s) got no calibration token; they use their "
                     "layer's largest activation scale (calibrate on more tokens)")
        block_set = sorted(set(blocks.values()))
        graph.metadata["w4a8c8"] = {
            "moe_quant_type": "w4a8", "kv_cache_quant_type": "int8" if attentions else None,
            "hadamard_block_size": block_set[0] if len(block_set) == 1 else block_set,
            "calibration": ({"file": opts.calibration_file} if opts.calibration_file else
                            {"tokens": opts.calibration_tokens, "seed": opts.calibration_seed})
            if stats is not None else None,
            "unreached_experts": unreached}
        ctx.count("w4a8-experts", len(experts))
        ctx.count("c8-attentions", len(attentions))
        return True

    # ---- what is converted
    @staticmethod
    def _experts(graph: Graph) -> list[Node]:
        if graph.metadata.get("kv_cache") is not None:
            raise W4A8C8Error(f"w4a8c8: graph {graph.name} is already a decoder; convert before the kv-cache "
                              "pass (calibration runs the full-sequence graph)")
        if any(n.op in ("all_reduce", "all_gather") for n in graph):
            raise W4A8C8Error(f"w4a8c8: graph {graph.name} is already split into ranks; run w4a8c8 before "
                              "split (scales are calibrated on the global graph and sliced by the split)")
        if graph.nodes_by_op("moe_experts_lora"):
            raise W4A8C8Error("w4a8c8: the routed experts carry LoRA adapters: merge them first (lora-merge)")
        experts = graph.nodes_by_op("moe_experts")
        if not experts and graph.nodes_by_op("moe_experts_w4a8"):
            raise W4A8C8Error(f"w4a8c8: graph {graph.name} is already W4A8 (run w4a8c8 once)")
        if not experts:
            raise W4A8C8Error(f"w4a8c8: graph {graph.name} has no routed experts (moe_experts): W4A8 "
                              "quantizes routed experts only (FastDeploy's w4a8 takes only FusedMoE); "
                              "use wint8 or wint4 for a dense model")
        for n in experts:
            for i in (3, 4):
                w = n.inputs[i]
                if not isinstance(w, Param) or not w.type.dtype.is_float:
                    raise W4A8C8Error(f"w4a8c8: the routed experts at {n.scope or '<root>'} are already "
                                      "quantized or computed; W4A8 converts float expert weights (leave "
                                      "routed experts out of other quantization)")
        return experts

    @staticmethod
    def _weight_scales(n: Node, block: int) -> dict[str, tuple[WeightSource | None, np.ndarray | None]]:
        """Per projection: (the source to quantize, its int4 scales [E, N]); NaN/Inf fail here."""
        out: dict[str, tuple[WeightSource | None, np.ndarray | None]] = {}
        for i, key in ((3, "up_gate"), (4, "down")):
            w = n.inputs[i]
            assert isinstance(w, Param)
            src: WeightSource | None = w.source
            if src is not None and key == "down" and block:
                src = HadamardSource(src, block)
            if src is None:
                out[key] = (None, None)
                continue
            release_mapped_pages()
            out[key] = (src, weight_scales(np.asarray(src.read()), 4, -1, name=w.name))
        return out

    # ---- calibration
    def _calibrate(self, graph: Graph, experts: list[Node], attentions: list[Node], blocks: dict[Node, int],
                   opts: W4A8C8Options, ctx: PassContext) -> dict[Any, np.ndarray] | None:
        """{(node, "up_gate"|"down"): abs-max [E] (0: unreached), (node, slot): abs-max [KV, D]}; None
        for a graph without weight data (typed params without data are made)."""
        if any(p.source is None for p in graph.params.values()):
            return None
        ints = [v for v in graph.inputs if v.type.dtype.is_int]
        if len(graph.inputs) != 1 or len(ints) != 1 or ints[0].type.rank != 2:
            raise W4A8C8Error("w4a8c8: calibration runs a graph whose only input is token ids [batch, seq]; "
                              f"this one takes {', '.join(v.name or '?' for v in graph.inputs)}")
        if ctx.evaluator is None:
            raise W4A8C8Error("w4a8c8: calibrating needs a graph evaluator: pass evaluator="
                              "ernie_ir.runtime.Interpreter to run_pipeline (compile_model and the CLI do)")
        ids = self._ids(graph, opts)
        most = max(int(n.inputs[3].type.shape[0]) for n in experts)  # type: ignore[union-attr]
        if ids.size < most:
            raise W4A8C8Error(f"w4a8c8: {ids.size} calibration token(s) cannot reach the {most} routed "
                              f"experts (fewer than one per expert); calibrate on at least {most} tokens")
        want: dict[Value, list[tuple[Node, int]]] = {}
        for n in experts:
            for i in (0, 2):
                want.setdefault(n.inputs[i], []).append((n, i))  # type: ignore[index]
        for n in attentions:
            for i in (1, 2):
                want.setdefault(n.inputs[i], []).append((n, i))  # type: ignore[index]
        held: dict[tuple[Node, int], np.ndarray] = {}
        stats: dict[Any, np.ndarray] = {}
        moe = set(experts)

        def observe(node: Node, results: list[np.ndarray]) -> None:
            for v, arr in zip(node.outputs, results, strict=True):
                for user, slot in want.get(v, ()):
                    if user.op == "attention":
                        a = np.abs(np.asarray(arr, np.float32)).reshape(-1, *arr.shape[2:])
                        stats[(user, slot)] = a.max(axis=0) if a.size else np.zeros(arr.shape[2:], np.float32)
                    else:
                        held[(user, slot)] = arr
            if node in moe:  # its inputs are in `held`; its float up_gate weights are read once, now
                x, idx = held.pop((node, 0)), held.pop((node, 2))
                up_gate = np.asarray(node.inputs[3].read()).astype(np.float32)  # type: ignore[union-attr]
                absmax = _expert_absmax(x, idx, up_gate, blocks[node])
                stats[(node, "up_gate")], stats[(node, "down")] = absmax

        runner = ctx.evaluator(graph)
        runner.run({ints[0].name: ids}, observer=observe)  # type: ignore[dict-item]
        return stats

    @staticmethod
    def _ids(graph: Graph, opts: W4A8C8Options) -> np.ndarray:
        vocab = _vocab(graph)
        if opts.calibration_file is None:
            rng = np.random.default_rng(opts.calibration_seed)
            return rng.integers(0, vocab, size=(1, opts.calibration_tokens))
        path = Path(opts.calibration_file)
        if not path.exists():
            raise W4A8C8Error(f"w4a8c8: calibration file {path} does not exist")
        ids = read_token_ids(path, "w4a8c8 calibration file")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise W4A8C8Error(f"w4a8c8: calibration file {path}: token ids must be in [0, {vocab}), got "
                              f"{int(ids.min())}..{int(ids.max())}")
        return ids

    # ---- rewriting
    @staticmethod
    def _convert_experts(graph: Graph, placer: ParamPlacer, n: Node, block: int,
                         weights: dict[str, tuple[WeightSource | None, np.ndarray | None]],
                         stats: dict[Any, np.ndarray] | None) -> int:
        """Replace one moe_experts by moe_experts_w4a8; returns how many experts no token reached."""
        unreached = 0
        new: list[Param] = []
        for i, key in ((3, "up_gate"), (4, "down")):
            w = n.inputs[i]
            assert isinstance(w, Param)
            e, _, cols = w.type.shape
            module = module_path(w.name)
            src, ws = weights[key]
            q_src = sc_src = in_src = None
            if stats is not None and src is not None and ws is not None:
                absmax = stats[(n, key)].astype(np.float32)
                seen = absmax > 0
                if key == "up_gate":  # the down projection sees the same tokens
                    unreached += int((~seen).sum())
                fill = np.float32(absmax[seen].max()) if seen.any() else np.float32(1)
                absmax = np.where(seen, absmax, fill).astype(np.float32)
                in_scale = (np.float32(1) / absmax).astype(np.float32)
                acc_scale = (ws.astype(np.float32) / np.float32(ACT_BOUND)) / in_scale[:, None]
                q_src = QuantizedWeightSource(src, 4, -1, w.name, scale=ws)
                sc_src = ArraySource(acc_scale.astype(w.type.dtype.numpy))
                in_src = ArraySource(in_scale)
            for p in (Param(f"{module}.quant_weight", w.type.with_dtype(DType.I4), q_src),
                      Param(f"{module}.weight_scale", tensor(w.type.dtype, e, cols), sc_src),
                      Param(f"{module}.in_scale", tensor(f32, e), in_src)):
                new.append(placer.add(w.name, p))
        b = GraphBuilder(graph)
        b.insert_point = n
        with b.at_scope(n.scope):
            y = b.moe_experts_w4a8(n.inputs[0], n.inputs[1], n.inputs[2], *new, hadamard_block=block)
        y.name = n.output.name
        graph.replace_all_uses_with(n.output, y)
        graph.erase(n)
        return unreached

    @staticmethod
    def _convert_attention(graph: Graph, n: Node, stats: dict[Any, np.ndarray] | None) -> None:
        for slot, kind in ((1, "cachek"), (2, "cachev")):
            v = n.inputs[slot]
            assert v is not None
            kv, d = v.type.shape[2:]
            src = None
            if stats is not None:
                absmax = np.maximum(stats[(n, slot)], np.float32(KV_ABSMAX_FLOOR))
                src = ArraySource(absmax.astype(np.float32))
            name = f"{n.scope + '.' if n.scope else ''}{kind}_matmul.activation_scale"
            p = Param(name, tensor(f32, kv, d), src)
            graph.add_param(p)
            b = GraphBuilder(graph)
            b.insert_point = n
            t = v.type.dtype
            with b.at_scope(n.scope):
                q = b.kv_cache_quantize(v, p, scale_dtype=t)
                n.set_input(slot, b.kv_cache_dequantize(q, p, dtype=t, scale_dtype=t))


def _expert_absmax(x: np.ndarray, idx: np.ndarray, up_gate: np.ndarray,
                   block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per expert (0 where no row is routed): abs-max of its rows of x, and of silu(gate) * up of
    them (Hadamard-rotated in blocks of `block`), as moe_experts computes them in float32."""
    experts, hidden, inter = up_gate.shape[0], x.shape[-1], up_gate.shape[2] // 2
    rows_x = np.asarray(x, np.float32).reshape(-1, hidden)
    flat = np.asarray(idx).reshape(rows_x.shape[0], -1)
    a_in, a_down = np.zeros(experts, np.float32), np.zeros(experts, np.float32)
    for e in np.unique(flat):
        rows, _ = np.nonzero(flat == e)
        v = rows_x[rows]
        a_in[e] = np.abs(v).max()
        act = hadamard_blocks(swiglu(np.matmul(v, up_gate[e]), inter), block)
        a_down[e] = np.abs(act).max()
    return a_in, a_down
