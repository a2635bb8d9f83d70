"""wint2: the later MoE layers' routed experts to FastDeploy's WINT2 (2-bit CCQ codes).

FastDeploy's `wint2` (REFERENCE 14) splits the MoE layers: those up to `w4_end_layer` keep INT4
experts (left float here; the `wint8mix` annotate that follows in `--quant wint2` makes them
INT4 and every other linear INT8), the later ones get 2-bit experts. This pass rewrites each
later layer's `moe_experts` weights, stacked [E, K, N], into

    wint2_dequantize(quant_weight, weight_scale, super_scales, code_scale, code_zp)

with the params `<m>.quant_weight` u8 [E, K/4, N], `<m>.weight_scale` u8 [E, K/128, N],
`<m>.super_scales` bf16 [E, N], `<m>.code_scale` f32 [E, N], `<m>.code_zp` f32 [E, N] for each
stack `<m>` = `ernie.layers.N.mlp.experts.{up_gate_proj,down_proj}`, computed on read by the
encoder (`wint2_encoder.wint2_encode`, each expert on its own: a rank holding some experts
encodes only those). The decode's dtype is the weight's, as FastDeploy decodes into the
activation dtype. `graph.metadata["wint2"]` records the layer split FastDeploy's config names.

`w4_end_layer` defaults to FastDeploy's published split scaled to the model: ERNIE-4.5-300B
keeps layers 0-6 of 54 at INT4, so a model of L layers keeps ceil(7 L / 54) - 1 (at least the
first layer); give it to choose (`--quant 'wint2{w4_end_layer=6}'`).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
from pydantic import Field

from ernie_ir.ir import DType, ErnieIRError, Graph, GraphBuilder, Node, Param, tensor
from ernie_ir.ir.weights import WeightSource, release_mapped_pages
from ernie_ir.ops.wint2 import GROUP_ROWS, ROWS_PER_CODE, ROWS_PER_SCALE_BYTE

from ..infra.base import Pass, PassContext, PassOptions
from ..infra.param_placer import ParamPlacer
from ..infra.registry import register_pass
from .config import module_path
from .wint2_encoder import Wint2Encoded, wint2_encode

PUBLISHED_W4_LAYERS, PUBLISHED_LAYERS = 7, 54
"""ERNIE-4.5-300B-A47B-2Bits: MoE layers 0-6 wint4, 7-53 wint2 (FastDeploy's moe_quant_config)."""
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
PIECES = ("quant_weight", "weight_scale", "super_scales", "code_scale", "code_zp")


class Wint2Error(ErnieIRError):
    """A graph wint2 cannot convert (one line: what and how to fix it)."""


class Wint2Options(PassOptions):
    w4_end_layer: int | None = Field(None, ge=-1)
    """The last layer whose experts stay INT4 (FastDeploy's moe_w4_quant_config end layer);
    None: the published split scaled to the model; -1: every MoE layer 2-bit."""
    refine: int = Field(1, ge=0, le=8)
    """The encoder's least-squares scale rounds (wint2_encoder)."""


def layer_index(name: str) -> int | None:
    """N of a name with `layers.N.` in it (`ernie.layers.7.mlp.experts.up_gate_proj.weight` -> 7)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def default_w4_end_layer(num_layers: int) -> int:
    """FastDeploy's published 7-of-54 INT4 layers scaled to `num_layers` (the 300B: 6)."""
    return max(0, math.ceil(PUBLISHED_W4_LAYERS * num_layers / PUBLISHED_LAYERS) - 1)


class Wint2Stack:
    """The encoding of one float expert stack [E, K, N], shared by its five WINT2 params and
    computed per expert range on first read (the last two ranges kept: the five params of a
    rank are read one after another)."""

    def __init__(self, base: WeightSource, name: str, refine: int) -> None:
        self.base, self.name, self.refine = base, name, refine
        self._memo: dict[tuple[int, int], Wint2Encoded] = {}

    def encoded(self, start: int, stop: int) -> Wint2Encoded:
        key = (start, stop)
        if key not in self._memo:
            release_mapped_pages()
            w = self.base if (start, stop) == (0, self.base.shape[0]) else self.base.sliced(0, start, stop)
            enc = wint2_encode(np.asarray(w.read()), refine=self.refine, name=self.name)
            while len(self._memo) >= 2:
                self._memo.pop(next(iter(self._memo)))
            self._memo[key] = enc
        return self._memo[key]


class Wint2PieceSource(WeightSource):
    """One of the five WINT2 tensors of experts [start, stop) of a `Wint2Stack`."""

    def __init__(self, stack: Wint2Stack, piece: str, dtype: DType, shape: tuple[int, ...],
                 start: int = 0, stop: int | None = None) -> None:
        self.stack, self.piece, self.dtype = stack, piece, dtype
        self.start, self.stop = start, stop if stop is not None else shape[0]
        self.shape = (self.stop - self.start, *shape[1:])

    def read(self) -> np.ndarray:
        return getattr(self.stack.encoded(self.start, self.stop), self.piece)

    def describe(self) -> str:
        whole = (self.start, self.stop) == (0, self.stack.base.shape[0])
        rng = "" if whole else f"[{self.start}:{self.stop}]"
        return f"wint2_encode<{self.piece}>({self.stack.base.describe()}){rng}"

    def sliced(self, axis: int, start: int, stop: int) -> WeightSource:
        # Each expert is encoded on its own: a slice of the experts encodes only those. Any other
        # slice is of the whole encoding (codebook and scales are chosen over all columns).
        if axis % len(self.shape) == 0:
            full = (self.stack.base.shape[0], *self.shape[1:])
            return Wint2PieceSource(self.stack, self.piece, self.dtype, full, self.start + start,
                                    self.start + stop)
        return super().sliced(axis, start, stop)


@register_pass
class Wint2(Pass):
    """The later MoE layers' experts to 2-bit WINT2 codes, decoded by wint2_dequantize."""

    name = "wint2"
    description = ("FastDeploy WINT2: routed experts of the MoE layers after w4_end_layer as 2-bit "
                   "convolutional codes (CCQ); earlier layers left for INT4.")
    Options = Wint2Options
    produces = frozenset({"quantized"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        opts: Wint2Options = self.options  # type: ignore[assignment]
        experts = self._experts(graph)
        layers = [layer_index(n.inputs[3].name or "") for n in experts]  # type: ignore[union-attr]
        if any(i is None for i in layers):
            raise Wint2Error("wint2: routed expert weights without a layer index (`layers.N.` in their "
                             "names): the layer split needs one")
        num_layers = 1 + max(i for p in graph.params if (i := layer_index(p)) is not None)
        end = opts.w4_end_layer if opts.w4_end_layer is not None else default_w4_end_layer(num_layers)
        moe_layers = sorted(i for i in layers if i is not None)
        late = [(n, i) for n, i in zip(experts, layers, strict=True) if i is not None and i > end]
        if not late:
            raise Wint2Error(f"wint2: w4_end_layer={end} keeps every MoE layer ({moe_layers[0]}-"
                             f"{moe_layers[-1]}) at INT4, so nothing is 2-bit: give a w4_end_layer below "
                             f"{moe_layers[-1]} (or use --quant wint8mix)")
        placer = ParamPlacer(graph)
        removed: set[str] = set()
        for n, _ in late:
            removed |= {n.inputs[3].name, n.inputs[4].name}  # type: ignore[union-attr]
            self._convert(graph, placer, n, opts.refine)
        placer.finish(removed=removed)
        w2 = [i for _, i in late]
        graph.metadata["wint2"] = {
            "w4_start_layer": 0, "w4_end_layer": end, "w2_start_layer": min(w2),
            "w2_end_layer": num_layers - 1, "group_size": GROUP_ROWS, "w2_layers": w2}
        ctx.count("wint2-expert-stacks", 2 * len(late))
        return True

    @staticmethod
    def _experts(graph: Graph) -> list[Node]:
        if any(n.op in ("all_reduce", "all_gather") for n in graph):
            raise Wint2Error(f"wint2: graph {graph.name} is already split into ranks; run wint2 before split "
                             "(the split cuts the codes on their packing boundaries)")
        if graph.nodes_by_op("moe_experts_lora"):
            raise Wint2Error("wint2: the routed experts carry LoRA adapters: merge them first (lora-merge)")
        experts = graph.nodes_by_op("moe_experts")
        if not experts:
            raise Wint2Error(f"wint2: graph {graph.name} has no routed experts (moe_experts): WINT2 is for "
                             "MoE experts (FastDeploy's w4w2); use wint8 or wint4 for a dense model")
        for n in experts:
            for i in (3, 4):
                w = n.inputs[i]
                if not isinstance(w, Param) or not w.type.dtype.is_float:
                    raise Wint2Error(f"wint2: the routed experts at {n.scope or '<root>'} are already "
                                     "quantized or computed; WINT2 encodes float expert weights (run it "
                                     "once, first)")
                k = w.type.shape[1]
                if not isinstance(k, int) or k % ROWS_PER_SCALE_BYTE:
                    raise Wint2Error(f"wint2: expert weight {w.name} has {k} input rows; WINT2 packs them in "
                                     f"groups of {ROWS_PER_SCALE_BYTE} (two 64-row scales per byte): the "
                                     f"hidden and expert intermediate sizes must be multiples of "
                                     f"{ROWS_PER_SCALE_BYTE}")
        return experts

    @staticmethod
    def _convert(graph: Graph, placer: ParamPlacer, n: Node, refine: int) -> None:
        ins: list[Any] = []
        for i in (3, 4):
            w = n.inputs[i]
            assert isinstance(w, Param)
            e, k, cols = w.type.shape
            assert isinstance(e, int) and isinstance(k, int)
            module = module_path(w.name)
            stack = Wint2Stack(w.source, w.name, refine) if w.source is not None else None
            types = {"quant_weight": tensor(DType.U8, e, k // ROWS_PER_CODE, cols),
                     "weight_scale": tensor(DType.U8, e, k // ROWS_PER_SCALE_BYTE, cols),
                     "super_scales": tensor(DType.BF16, e, cols),
                     "code_scale": tensor(DType.F32, e, cols),
                     "code_zp": tensor(DType.F32, e, cols)}
            params = []
            for piece in PIECES:
                t = types[piece]
                src = (Wint2PieceSource(stack, piece, t.dtype, tuple(t.shape))  # type: ignore[arg-type]
                       if stack is not None else None)
                params.append(placer.add(w.name, Param(f"{module}.{piece}", t, src)))
            b = GraphBuilder(graph)
            b.insert_point = n
            with b.at_scope(n.scope):
                ins.append(b.wint2_dequantize(*params, dtype=w.type.dtype))
        n.set_input(3, ins[0])
        n.set_input(4, ins[1])
