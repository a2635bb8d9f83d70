"""ONNX emitter: a (lowered or float) IR graph -> `model.onnx` + `model.onnx.data` (opset 21).

    from ernie_ir.backends.onnx.lower import emit_onnx
    files = emit_onnx(graph, Path("out"), form="qdq")   # [out/model.onnx, out/model.onnx.data]

The ONNX graph computes in float32 exactly like the reference interpreter:
bf16/f16 weights are stored as they are (an initializer of that type, then a
Cast to float32 in the graph: exact widening, folded by onnxruntime when it
loads; an embedding gathers its rows first), except MoE expert stacks and
small params, which become f32 initializers (exact widening) like f32 ones; a
result the IR types bf16/f16 is *not* rounded (the interpreter does not round
either), except where the IR op itself rounds (`cast` to bf16/f16,
`dequantize` with a bf16/f16 result): there a Cast to that type and back is
emitted. Weights live in one external data file.

Weight-only int8/int4 (`form`, `numerics`):
- "matmulnbits" (default): `com.microsoft.MatMulNBits` with `accuracy_level`
  set explicitly, so the file itself fixes its numerics in any session
  (onnxruntime's optimizer keeps an existing MatMulNBits as written).
  `numerics="weight-only"` (the default): accuracy_level 1 (float32
  compute, float32 activations); an int8 weight q is written as two 4-bit
  planes q = 16 * hi + lo (hi in [-8, 7], zero point 8, scale 16 s; lo in
  [0, 15], zero point 0, scale s) and the two products are added: 8-bit
  MatMulNBits at float32 accuracy is a slow path, 4-bit is not. A
  `dequantize` read only by a `linear` (a kernel fallback) or by the MoE
  experts becomes MatMulNBits too, so the bf16 rounding of the dequantized
  weight that the IR states is dropped: the weight is q * s in float32.
  `numerics="exact"`: the same MatMulNBits for weight-only linears, equal to
  the interpreter to float tolerance; `dequantize` nodes stay
  DequantizeLinear and keep their bf16 rounding (slower: the routed experts
  are dequantized on every call).
  `numerics="fast"`: accuracy_level 4 (activations quantised to int8 per
  block; faster, not exact), int8 written as one 8-bit MatMulNBits,
  `dequantize` + linear / experts as in weight-only.
  Per-channel scales are repeated per block of 128 (or the next power of
  two >= K); K is padded with the zero point.
- "qdq": `DequantizeLinear` (per-axis for per-channel scales, blocked for
  group-wise; int4 initializers are INT4) + `MatMul`, no contrib op. Exact
  only at ORT_ENABLE_BASIC: onnxruntime's default level rewrites it into
  MatMulNBits with accuracy_level 4 (see `ernie_ir.backends.onnx.session`).
The choice is recorded in the model's metadata (`ernie_ir.onnx_numerics`,
`ernie_ir.onnx_form`), which `run_onnx` reads.

Packed cuda weights (`weight_only_linear_packed`, `unpack_weight`) are
unpacked back to their logical int values at export: ONNX has its own layout.
MoE experts (`moe_experts`, `moe_experts_lora`) are lowered sparsely: one `If`
per expert, taken only when the call routes a token to it, gathers the expert's
rows (NonZero, Gather), runs its FFN on them alone with its weights read from
initializers of its own (views of the stack's bytes in the data file; a stacked
int8/int4 `dequantize` read only by the experts is dequantized per expert, in
the branch; with weight-only or fast numerics each expert matmul is a MatMulNBits of the
expert's own weights instead, and the stack is not written) and adds the
weighted rows back (ScatterND add). Zero-weight slots
(experts another rank holds) are skipped. `with dense_moe(): ...` exports the
dense form instead (every expert on every token, weighted by a [T, E] routing
matrix), the checking form.

A decoder graph (the `kv-cache` pass; docs/targets.md, "The ONNX decoder") lowers like any
other: `kv_cache_append` is a Transpose + Concat on the sequence axis, `key_padding_mask` a Cast
to bool, `position_ids` with an index input `offset + stride * index`; its graph inputs and
outputs are FLOAT even where the IR types the cache bf16/f16 (float32 holding those values). An
attention with a mask gives zeros, not NaN, for a query row the mask hides completely (a left
pad's), as the interpreter does; without a mask it is lowered as before.

QAT quantizers (what a converted QAT graph keeps, `qat-convert`): `pact`,
`fake_quant_moving_average` in its inference form (is_test: the learned scale, a constant)
and `fake_quant` (abs-max from x; a constant input is folded by its kernel) are their numpy
kernels (`ernie_ir.ops.quant_numerics.fake_quant_dequant`), one float32 ONNX op per numpy
operation, so the results are the interpreter's bit for bit, signed zeros included
(tests/onnx/test_onnx_qat.py; onnxruntime's CPU EP): Add/Sub/Mul/Div are IEEE float32 as
numpy's, Max/Min keep the operand np.maximum/np.minimum keep, Round is np.rint (half to
even), and round half away from zero is the kernel's trunc(t + copysign(0.49999997, t)),
exactly sign(t) * Floor(|t| + 0.49999997). A constant scale's multiplier b * inverse(s) is
computed here by the kernel's numpy. Not QuantizeLinear/DequantizeLinear: they divide by the
scale where the kernel multiplies by b * (1 / s), and round half to even. The training form
of the moving average (it updates its state) is refused (`refusal`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ernie_ir.ir import DType, ErnieIRError, Graph, Node, OpDef, Param, Value, all_ops
from ernie_ir.ir.weights import write_buffer
from ernie_ir.ops.quant_numerics import num_groups, paddle_inverse

OPSET = 21
FORMS = ("matmulnbits", "qdq")
NUMERICS = ("weight-only", "exact", "fast")
DEFAULT_NUMERICS = "weight-only"
ACCURACY_LEVEL = {"weight-only": 1, "exact": 1, "fast": 4}
"""MatMulNBits accuracy_level per numerics: 1 = float32 compute, 4 = int8 activations."""
PREFILL_ROWS = 384
"""From this many rows (tokens) on, an int8 linear at accuracy_level 1 runs as one 8-bit
MatMulNBits instead of two 4-bit planes. The 8-bit kernel widens its whole weight on every call
(a fixed cost) and then runs one float GEMM; the planes run two GEMMs' worth of work per row. On
two cores (ERNIE-4.5-0.3B widths) they cost the same near 350-380 rows; at 1,024 rows the 8-bit
form takes about 0.75x the planes' time; at one row (decode) it is over 10x slower."""
META_NUMERICS = "ernie_ir.onnx_numerics"
META_FORM = "ernie_ir.onnx_form"
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"

_INT_TYPES = {
    DType.I64: TensorProto.INT64, DType.I32: TensorProto.INT32, DType.I8: TensorProto.INT8,
    DType.I4: TensorProto.INT4, DType.U8: TensorProto.UINT8, DType.BOOL: TensorProto.BOOL,
}
_ROUND_TYPES = {DType.BF16: TensorProto.BFLOAT16, DType.F16: TensorProto.FLOAT16}


class OnnxExportError(ErnieIRError):
    """A graph (or one of its nodes) that the ONNX emitter cannot lower."""


def onnx_type(dtype: DType) -> int:
    if dtype.is_float:
        return TensorProto.FLOAT
    if dtype in _INT_TYPES:
        return _INT_TYPES[dtype]
    raise OnnxExportError(f"ONNX export: no ONNX type for {dtype}")


def _dims(shape: tuple[Any, ...]) -> list[Any]:
    return [d if isinstance(d, int) else str(d) for d in shape]


_CACHED_BYTES = 1 << 20  # params up to this size stay cached while emitting (scales, norms)
_NARROW_MIN = 4096  # bf16/f16 params of at least this many elements stay bf16/f16 in the file


LOWEST = float(np.finfo(np.float32).min)
"""What a bool or causal mask adds to a hidden attention score (see `op_attention`)."""

HALF_BELOW = np.nextafter(np.float32(0.5), np.float32(0))
"""0.49999997, the float32 below 0.5: quant_numerics.round_half_away adds it (copysigned)."""


def _fq_bound(bits: int) -> np.float32:
    """b = 2^(bits-1) - 1, the fake quantizers' bound, as the kernels hold it (float32)."""
    return np.float32(2 ** (bits - 1) - 1)


TRAINING_FORM = ("the training form (is_test=false) updates its moving-average scale on every call, "
                 "which an inference model does not keep: compile the model with --mode training, "
                 "train it (`ernie-ir train`) and compile that artifact (its quantizers then read "
                 "their learned scale)")


def refusal(node: Node) -> str | None:
    """Why `node`, of an op the emitter lowers, cannot be lowered with its attrs; None if it can."""
    if node.op == "fake_quant_moving_average" and not node.attrs.is_test:
        return TRAINING_FORM
    return None


def first_refusal(graph: Graph) -> tuple[Node, str] | None:
    """The first node of `graph` that `refusal` refuses, with why (checked before writing)."""
    for node in graph:
        why = refusal(node)
        if why is not None:
            return node, why
    return None


def _nbits_block(k: int, group_size: int) -> int | None:
    """MatMulNBits' block over K rows: the group size, or for per-channel scales 128 (or the next
    power of two >= K, at least 16); None when the group size is not a power of two >= 16."""
    block = group_size if group_size != -1 else 128 if k >= 128 else max(16, 1 << (k - 1).bit_length())
    return None if block & (block - 1) or block < 16 else block


class _ExternalData:
    """The model's weight file, written as the emitter makes each initializer (64-byte aligned),
    so no weight's bytes stay in memory after its initializer is made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 - closed by emit_onnx
        self.offset = 0

    def put(self, t: onnx.TensorProto) -> None:
        raw = t.raw_data
        pad = (-self.offset) % 64
        self.file.write(b"\0" * pad)
        self.offset += pad
        write_buffer(self.file, raw)
        del t.external_data[:]
        for k, v in (("location", self.path.name), ("offset", str(self.offset)), ("length", str(len(raw)))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        t.data_location = TensorProto.EXTERNAL
        t.ClearField("raw_data")
        self.offset += len(raw)


class _Emitter:
    def __init__(self, graph: Graph, form: str, sink: _ExternalData | None = None,
                 numerics: str = DEFAULT_NUMERICS) -> None:
        self.graph = graph
        self.form = form
        self.numerics = numerics
        self.sink = sink
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, onnx.TensorProto] = {}
        self.names: dict[Value, str] = {}
        self.consts: dict[Value, np.ndarray] = {}  # values folded at export (params, unpacked weights)
        self.counter = 0
        self.ms_domain = False
        self.node: Node | None = None
        self.const_names: dict[tuple[Any, ...], str] = {}
        self.derived_names: dict[tuple[int, str], str] = {}
        self.branch_inits: set[str] = set()  # per-expert weights: initializers of that expert's branch
        self.deferred: dict[Value, Node] = {}  # expert stacks' dequantize, lowered per expert by the MoE
        self.created: list[str] | None = None  # when a list: the names of the initializers made meanwhile

    moe_form = "sparse"
    """"sparse" (default): MoE experts run on the rows routed to them only; "dense": every expert
    on every token (the checking form; `dense_moe()` selects it)."""

    # -- helpers ---------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        self.counter += 1
        return f"{hint}_{self.counter}"

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs: Any) -> Any:
        outs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.fresh("n"), domain=domain,
                                           **attrs))
        return outs[0] if n_out == 1 else outs

    def init(self, name: str, arr: np.ndarray) -> str:
        if name not in self.inits:
            t = numpy_helper.from_array(np.ascontiguousarray(arr), name)
            if self.sink is not None and not name.startswith("const_"):
                self.sink.put(t)
            self.inits[name] = t
            if self.created is not None and not name.startswith("const_"):
                self.created.append(name)
        return name

    def const(self, arr: Any, dtype: Any = np.int64) -> str:
        a = np.asarray(arr, dtype=dtype)
        key = (a.dtype.str, a.shape, a.tobytes())
        if key not in self.const_names:
            self.const_names[key] = self.init(self.fresh("const"), a)
        return self.const_names[key]

    def fail(self, why: str) -> OnnxExportError:
        n = self.node
        where = f"{n.op} at {n.scope or '<root>'}" if n is not None else "graph"
        return OnnxExportError(f"ONNX export cannot lower {where}: {why}")

    def array(self, v: Value) -> np.ndarray:
        """The constant value of a param (or folded value), as read (no widening)."""
        if v in self.consts:
            return self.consts[v]
        if isinstance(v, Param):
            arr = np.asarray(v.read())
            if arr.nbytes <= _CACHED_BYTES:  # big weights are read again if needed, never kept
                self.consts[v] = arr
            return arr
        raise self.fail("needs a constant (param) input here")

    def derived(self, v: Value, form: str) -> str:
        """The initializer name of `v` in another form: `<param>::<form>`; a computed value (an
        unnamed stacked scale of packed experts) gets a name of its own, never a shared one."""
        if isinstance(v, Param):
            return f"{v.name}::{form}"
        key = (id(v), form)
        if key not in self.derived_names:
            self.derived_names[key] = self.fresh(f"{v.name or 'folded'}::{form}")
        return self.derived_names[key]

    def take(self, v: Value) -> np.ndarray:
        """`array(v)`, forgetting a folded value its only reader has now taken."""
        arr = self.array(v)
        if not isinstance(v, Param) and v.num_uses() <= 1:
            self.consts.pop(v, None)
        return arr

    def name(self, v: Value | None) -> str:
        if v is None:
            return ""
        if v in self.names:
            return self.names[v]
        if isinstance(v, Param) and self._kept_narrow(v):
            # bf16/f16 weights stay in their own dtype (half the bytes of float32) and widen in
            # the graph, exactly; onnxruntime folds the Cast of an initializer when it loads.
            self.names[v] = self.op("Cast", [self.init(v.name, self.array(v))], to=TensorProto.FLOAT)
            return self.names[v]
        if isinstance(v, Param) or v in self.consts:
            arr = self.array(v)
            if v.type.dtype.is_float:
                arr = arr.astype(np.float32)
            elif v.type.dtype == DType.I4:
                arr = arr.astype(DType.I4.numpy)
            pname = v.name if isinstance(v, Param) else self.fresh("folded")
            self.names[v] = self.init(pname, arr)
            return self.names[v]
        raise self.fail(f"value {v.name} is used before it is defined")

    def _kept_narrow(self, v: Param) -> bool:
        """A bf16/f16 weight stored as it is: every one but expert stacks (their per-expert views
        live in If branches) and small ones (norms, biases: not worth a node)."""
        return (v.type.dtype in _ROUND_TYPES and math.prod(v.type.shape) >= _NARROW_MIN
                and not any(u.op in ("moe_experts", "moe_experts_lora") for u in v.users))

    def shape_of(self, x: str, start: int, end: int) -> str:
        return self.op("Shape", [x], start=start, end=end)

    def f32(self, value: float) -> str:
        return self.const(np.float32(value), np.float32)

    def fusion_barrier(self, dequantized: str) -> str:
        """A float32 `DequantizeLinear` result passed on unchanged, but through an op that keeps
        onnxruntime's default optimizer from fusing it with the `MatMul` that reads it into a
        MatMulNBits of accuracy_level 4 (int8 activations: 2% of the logits on a float32
        checkpoint). A bf16/f16 result needs none: its rounding Casts stand in between. Neg twice
        is exact and survives the optimizer (checked: a bare session, and again on the file it
        optimized); a Cast to double and back is removed after fusion and then fuses when that
        file is loaded again, and Mul by 1 is removed before fusion."""
        return self.op("Neg", [self.op("Neg", [dequantized])])

    def round_to(self, x: str, dtype: DType) -> str:
        """Round a float32 tensor to bf16/f16 and back (what the interpreter's astype does)."""
        if dtype in _ROUND_TYPES:
            return self.op("Cast", [self.op("Cast", [x], to=_ROUND_TYPES[dtype])], to=TensorProto.FLOAT)
        return x

    # -- driver ----------------------------------------------------------------------------------
    def run(self) -> onnx.ModelProto:
        g = self.graph
        inputs = []
        for v in g.inputs:
            self.names[v] = v.name
            inputs.append(helper.make_tensor_value_info(v.name, onnx_type(v.type.dtype), _dims(v.type.shape)))
        for node in g:
            self.node = node
            fn = _lowering(self, node)
            if fn is None:
                raise self.fail(f"op {node.op!r} has no ONNX lowering "
                                f"(supported: {', '.join(supported_ops())})")
            outs = fn(node)
            if outs is not None:
                for v, n in zip(node.outputs, outs, strict=True):
                    self.names[v] = n
        self.node = None
        outputs = []
        producers = {out: node for node in self.nodes for out in node.output}
        taken: set[str] = set()
        for oname, v in zip(g.output_names, g.outputs, strict=True):
            src = self.name(v)
            node = producers.get(src)
            if node is not None and src not in taken and oname not in producers:
                # The producing node writes the output itself: an Identity onto a graph output is a
                # copy in onnxruntime, which for a KV cache grows with the context every step.
                self._rename(src, oname, node)
                taken.add(oname)
            else:
                self.nodes.append(helper.make_node("Identity", [src], [oname], name=self.fresh("out")))
            outputs.append(helper.make_tensor_value_info(oname, onnx_type(v.type.dtype), _dims(v.type.shape)))
        opsets = [helper.make_opsetid("", OPSET)]
        if self.ms_domain:
            opsets.append(helper.make_opsetid("com.microsoft", 1))
        graph = helper.make_graph(self.nodes, g.name or "ernie_ir", inputs, outputs,
                                  initializer=list(self.inits.values()))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="ernie-ir")
        model.ir_version = 10
        helper.set_model_props(model, {META_NUMERICS: self.numerics, META_FORM: self.form})
        return model

    def _rename(self, old: str, new: str, producer: onnx.NodeProto) -> None:
        """Rename tensor `old` (an output of `producer`) to `new` everywhere it is read."""
        producer.output[list(producer.output).index(old)] = new
        for node in self.nodes:
            for i, name in enumerate(node.input):
                if name == old:
                    node.input[i] = new
        for v, name in list(self.names.items()):
            if name == old:
                self.names[v] = new

    # -- weight-only helpers ---------------------------------------------------------------------
    def dequant(self, q: np.ndarray, qname: str, scale: Value, group_size: int) -> str:
        """DequantizeLinear of logical int values q [..., K, N] with IR scales -> float32 [..., K, N]."""
        s = self.array(scale).astype(np.float32)
        k = q.shape[-2]
        qdt = DType.I4 if q.dtype == DType.I4.numpy else DType.I8
        qn = self.init(qname, q.astype(qdt.numpy))
        if s.ndim == 0:
            return self.op("DequantizeLinear", [qn, self.init(self.derived(scale, "f32"), s)])
        if q.ndim == 2 and group_size == -1:
            return self.op("DequantizeLinear", [qn, self.init(self.derived(scale, "f32"), s)], axis=1)
        if group_size == -1:  # stacked [..., K, N] with scale [..., N]: one block of K rows
            s = s[..., None, :]
            block = k
        else:
            block = group_size
            if s.shape[-2] != num_groups(k, group_size):
                raise self.fail(f"scale {list(s.shape)} does not match groups of {group_size} over {k} rows")
        sname = self.init(self.derived(scale, "f32_blocked"), s)
        return self.op("DequantizeLinear", [qn, sname], axis=q.ndim - 2, block_size=block)

    def matmul_nbits(self, x: str, q: np.ndarray, qname: str, scale: np.ndarray, group_size: int,
                     bits: int, by_rows: bool = True) -> str:
        """com.microsoft.MatMulNBits over logical q [K, N] with scales [N] (per channel) or
        [groups, N], accuracy_level per `self.numerics` (weight-only, exact: float32 compute, int8
        as two 4-bit planes, and with `by_rows` one 8-bit MatMulNBits for calls of at least
        `PREFILL_ROWS` rows, chosen by an `If`; fast: int8 activations)."""
        k, n = q.shape
        s = np.asarray(scale).astype(np.float32)
        block = _nbits_block(k, group_size)
        if block is None:
            raise self.fail(f"MatMulNBits needs a power-of-two block >= 16, group_size is {group_size}")
        nblocks = math.ceil(k / block)
        scales = np.repeat(s[None, :], nblocks, axis=0) if group_size == -1 else s  # [nblocks, N]
        scales = np.ascontiguousarray(scales.T).reshape(-1)  # [N * nblocks]
        level = ACCURACY_LEVEL[self.numerics]
        self.ms_domain = True
        if bits == 8 and level == 1:
            q32 = q.astype(np.int32)
            hi, lo = q32 >> 4, q32 & 15  # q = 16 * hi + lo, hi in [-8, 7], lo in [0, 15]
            zeros = np.zeros(n * math.ceil(nblocks / 2), np.uint8)  # 4-bit zero points 0, packed

            def planes() -> str:
                y_hi = self._nbits(x, hi, 8, 4, block, nblocks, scales * np.float32(16),
                                   f"{qname}::nbits4_hi", level)
                y_lo = self._nbits(x, lo, 0, 4, block, nblocks, scales, f"{qname}::nbits4_lo", level, zeros)
                return self.op("Add", [y_hi, y_lo])

            if not by_rows:
                return planes()
            return self._by_rows(x, k, lambda: self._nbits(x, q32, 128, 8, block, nblocks, scales,
                                                            f"{qname}::nbits8", level), planes)
        return self._nbits(x, q.astype(np.int32), 1 << (bits - 1), bits, block, nblocks, scales,
                           f"{qname}::nbits{bits}", level)

    def _by_rows(self, x: str, k: int, many: Callable[[], str], few: Callable[[], str]) -> str:
        """If(rows of x >= PREFILL_ROWS) then `many()` else `few()`: two lowerings of one product,
        equal to float tolerance, each emitted into its branch (graphs named rows_many_* and
        rows_few_*; their initializers stay in the graph, read from the branches). Only speed
        depends on the choice."""
        cond = self.op("Greater", [self.op("Size", [x]), self.const(k * PREFILL_ROWS - 1)])
        outer = self.nodes
        branches = []
        for make, hint in ((many, "rows_many"), (few, "rows_few")):
            self.nodes = []
            y = make()
            branches.append(helper.make_graph(self.nodes, self.fresh(hint), [],
                                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)]))
        self.nodes = outer
        return self.op("If", [cond], then_branch=branches[0], else_branch=branches[1])

    def _nbits(self, x: str, v: np.ndarray, zero: int, bits: int, block: int, nblocks: int,
               scales: np.ndarray, base: str, level: int, zero_points: np.ndarray | None = None) -> str:
        """One MatMulNBits of int values v [K, N] stored as v + zero (unsigned `bits`-bit)."""
        k, n = v.shape
        padded = np.full((nblocks * block, n), zero, np.uint8)
        padded[:k] = (v + zero).astype(np.uint8)
        bt = padded.T.reshape(n, nblocks, block)  # [N, nblocks, block]
        if bits == 4:
            bt = (bt[..., 0::2] | (bt[..., 1::2] << 4)).astype(np.uint8)  # low nibble first
        inputs = [x, self.init(f"{base}.B", np.ascontiguousarray(bt)),
                  self.init(f"{base}.scales", scales.astype(np.float32))]
        if zero_points is not None:
            inputs.append(self.init(f"{base}.zero_points", zero_points))
        return self.op("MatMulNBits", inputs, domain="com.microsoft", K=k, N=n, bits=bits,
                       block_size=block, accuracy_level=level)

    def weight_only(self, node: Node, q: np.ndarray, qname: str) -> list[str]:
        x = self.name(node.inputs[0])
        scale = node.inputs[2]
        gs = node.attrs.group_size
        bits = 4 if q.dtype == DType.I4.numpy else 8
        if self.form == "matmulnbits":
            y = self.matmul_nbits(x, q, qname, self.array(scale), gs, bits)
        else:
            y = self.op("MatMul", [x, self.dequant(q, qname, scale, gs)])
        bias = node.inputs[3] if len(node.inputs) > 3 else None
        if bias is not None:
            y = self.op("Add", [y, self.name(bias)])
        return [y]

    # -- ops -------------------------------------------------------------------------------------
    def op_embedding(self, node: Node) -> list[str]:
        table = node.inputs[1]
        if isinstance(table, Param) and self._kept_narrow(table):  # gather the rows, then widen them
            rows = self.op("Gather", [self.init(table.name, self.array(table)), self.name(node.inputs[0])],
                           axis=0)
            return [self.op("Cast", [rows], to=TensorProto.FLOAT)]
        return [self.op("Gather", [self.name(table), self.name(node.inputs[0])], axis=0)]

    def op_linear(self, node: Node) -> list[str]:
        dq = self.deferred.pop(node.inputs[1], None)
        if dq is not None:  # dequantize(int) + linear as one MatMulNBits (weight-only, fast numerics)
            qv = dq.inputs[0]
            q = self.take(qv)
            bits = 4 if qv.type.dtype == DType.I4 else 8
            qname = qv.name if isinstance(qv, Param) else self.fresh("unpacked")
            y = self.matmul_nbits(self.name(node.inputs[0]), q, qname, self.array(dq.inputs[1]),
                                  dq.attrs.group_size, bits)
        else:
            y = self.op("MatMul", [self.name(node.inputs[0]), self.name(node.inputs[1])])
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            y = self.op("Add", [y, self.name(node.inputs[2])])
        return [y]

    def op_lm_head(self, node: Node) -> list[str]:
        w = self.name(node.inputs[1])
        if node.attrs.transpose_weight:
            w = self.op("Transpose", [w], perm=[1, 0])
        return [self.op("MatMul", [self.name(node.inputs[0]), w])]

    def op_weight_only_linear(self, node: Node) -> list[str]:
        q = self.array(node.inputs[1])
        return self.weight_only(node, q, node.inputs[1].name)

    def op_weight_only_linear_packed(self, node: Node) -> list[str]:
        from ernie_ir.ops.packed_weight import _unpack

        q = _unpack(self.array(node.inputs[1]), node.attrs)
        if node.attrs.bits == 4:
            q = q.astype(DType.I4.numpy)
        return self.weight_only(node, q, f"{node.inputs[1].name}::logical")

    def _fold(self, node: Node) -> None:
        args = [self.take(v) for v in node.inputs if v is not None]
        for v, arr in zip(node.outputs, node.opdef.kernel(args, node.attrs), strict=True):
            self.consts[v] = np.asarray(arr)

    def op_unpack_weight(self, node: Node) -> None:
        self._fold(node)

    def op_stack(self, node: Node) -> None:
        self._fold(node)

    def op_dequantize(self, node: Node) -> list[str]:
        qv = node.inputs[0]
        if qv.type.dtype not in (DType.I8, DType.I4):
            raise self.fail(f"only int8/int4 dequantize lowers, not {qv.type.dtype}")
        if self._nbits_experts(node) or self._nbits_linear(node):
            self.deferred[node.outputs[0]] = node
            return [self.fresh("deferred_dequantize")]  # no node reads it: its reader lowers it
        q = self.take(qv)
        qname = qv.name if isinstance(qv, Param) else self.fresh("unpacked")
        w = self.dequant(q, qname, node.inputs[1], node.attrs.group_size)
        return [self.round_to(w, node.attrs.dtype) if node.attrs.dtype in _ROUND_TYPES
                else self.fusion_barrier(w)]

    def op_lora(self, node: Node) -> list[str]:
        base, x, a, b = (self.name(v) for v in node.inputs)
        low = self.op("MatMul", [self.op("MatMul", [x, a]), b])
        return [self.op("Add", [base, self.op("Mul", [low, self.f32(node.attrs.scale)])])]

    # -- QAT quantizers (inference forms) --------------------------------------------------------
    def op_fake_quant_moving_average(self, node: Node) -> list[str]:
        """The inference form (is_test): fake_quant_dequant(x, scale) with the stored (learned)
        scale; the state passes through. A constant scale's multiplier b * inverse(s) is
        computed here by the kernel's numpy."""
        why = refusal(node)
        if why is not None:
            raise self.fail(why)
        xv, sv, accv, statev = node.inputs
        a = node.attrs
        s = self.name(sv)  # f32[1]: the kernel's scale[0], broadcast alike
        if isinstance(sv, Param) or sv in self.consts:
            s0 = np.asarray(self.array(sv), np.float32).reshape(1)
            k = self.init(self.derived(sv, f"fake_quant_k{a.bits}"), _fq_bound(a.bits) * paddle_inverse(s0))
        else:
            k = self._fq_multiplier(s, a.bits)
        y = self._fake_quant_dequant(self.name(xv), s, k, a.bits, a.round_type, one_scale=True)
        return [y, *(self._passed(node, i, v) for i, v in ((1, sv), (2, statev), (3, accv)))]

    def op_fake_quant(self, node: Node) -> list[str] | None:
        """abs-max fake quantization, its scale computed from x (ReduceMax of |x|, exact); a
        constant x (a weight qat-convert kept) is folded at export by the kernel itself."""
        xv = node.inputs[0]
        if isinstance(xv, Param) or xv in self.consts:
            self._fold(node)
            return None
        a = node.attrs
        rank = xv.type.rank
        keep = sorted({ax % rank for ax in a.axes}) if rank else []
        reduce = [i for i in range(rank) if i not in keep]
        x = self.name(xv)
        absx = self.op("Abs", [x])
        if not keep:
            s, one_scale = self.op("ReduceMax", [absx], keepdims=0), True
        else:
            s = self.op("ReduceMax", [absx, self.const(reduce)], keepdims=1) if reduce else absx
            # np.clip's path for one scale: a scale of one element against a larger x (a symbolic
            # dim counts as > 1)
            dims = xv.type.shape
            one_scale = all(dims[i] == 1 for i in keep) and not all(dims[i] == 1 for i in reduce)
        return [self._fake_quant_dequant(x, s, self._fq_multiplier(s, a.bits), a.bits, a.round_type,
                                         one_scale=one_scale)]

    def op_pact(self, node: Node) -> list[str]:
        """y = (x - max(x - alpha, 0)) + max(-alpha - x, 0), the kernel's operations in its order
        (onnxruntime's Max against a scalar 0 keeps the same operand as np.maximum)."""
        x = self.name(node.inputs[0])
        alpha = self.name(node.inputs[1])
        zero = self.f32(0.0)
        left = self.op("Max", [self.op("Sub", [x, alpha]), zero])
        right = self.op("Max", [self.op("Sub", [self.op("Neg", [alpha]), x]), zero])
        return [self.op("Add", [self.op("Sub", [x, left]), right])]

    def _passed(self, node: Node, out: int, v: Value) -> str:
        """A result that is input `v` unchanged: its name where something reads it, else a
        placeholder no node reads (so no initializer is made for it)."""
        res = node.outputs[out]
        if res.num_uses() or any(res is o for o in self.graph.outputs):
            return self.name(v)
        return self.fresh("unread")

    def _fq_multiplier(self, s: str, bits: int) -> str:
        """k = b * paddle_inverse(s) in the graph: b * Where(s <= 1e-30, 1 / (s + 1e-6), 1 / s)."""
        one = self.f32(1.0)
        inv = self.op("Where", [self.op("LessOrEqual", [s, self.f32(1e-30)]),
                                self.op("Div", [one, self.op("Add", [s, self.f32(1e-6)])]),
                                self.op("Div", [one, s])])
        return self.op("Mul", [self.f32(_fq_bound(bits)), inv])

    def _fake_quant_dequant(self, x: str, s: str, k: str, bits: int, round_type: int, *,
                            one_scale: bool) -> str:
        """quant_numerics.fake_quant_dequant(x, s) from s and k = b * inverse(s): the numpy
        kernel's operations, each one IEEE float32 ONNX op, with the signs of zeros carried by
        products (onnxruntime's Where turns a selected -0 into +0, and its Max/Min against a
        broadcast scalar keep the scalar on a tie of signed zeros, where numpy keeps the other):

          round_type 0: q = Min(b, Max(-b - 1, Round(k * x)))   np.clip(np.rint(k * x), -b - 1, b)
          round_type 1: c = sign(x) * Min(|x|, s)                np.clip(x, -s, s)
                        t = k * c
                        q = sign(t) * Floor(|t| + h)             trunc(t + copysign(h, t)), exactly
          y = (q * s) / b                                        (h = 0.49999997, round_half_away)

        sign(v) = -1 where v's sign bit is set (-0 included), else 1. Where s = 0, np.clip gives
        x's signed zero for one scale (`one_scale`) but +0 against a scale per element: there
        sign(x) is 1 where s = 0."""
        b = _fq_bound(bits)
        if round_type == 0:
            r = self.op("Round", [self.op("Mul", [k, x])])  # half to even, as np.rint
            q = self.op("Min", [self.f32(b), self.op("Max", [self.f32(-b - np.float32(1)), r])])
        else:
            neg_x = self._sign_bit(x)
            if not one_scale:
                neg_x = self.op("And", [neg_x, self.op("Greater", [s, self.f32(0.0)])])
            c = self.op("Mul", [self._unit(neg_x), self.op("Min", [self.op("Abs", [x]), s])])
            t = self.op("Mul", [k, c])
            mag = self.op("Floor", [self.op("Add", [self.op("Abs", [t]), self.f32(HALF_BELOW)])])
            q = self.op("Mul", [self._unit(self._sign_bit(t)), mag])
        return self.op("Div", [self.op("Mul", [q, s]), self.f32(b)])

    def _sign_bit(self, v: str) -> str:
        """bool: v's sign bit is set, -0 included (1 / -0 = -inf); false for NaN."""
        zero = self.f32(0.0)
        return self.op("Or", [self.op("Less", [v, zero]),
                              self.op("Less", [self.op("Div", [self.f32(1.0), v]), zero])])

    def _unit(self, neg: str) -> str:
        """-1 where `neg`, else 1 (float32): a factor that gives a product the sign bit."""
        return self.op("Where", [neg, self.f32(-1.0), self.f32(1.0)])

    def op_rms_norm(self, node: Node) -> list[str]:
        x, w = self.name(node.inputs[0]), self.name(node.inputs[1])
        var = self.op("ReduceMean", [self.op("Mul", [x, x]), self.const([-1])], keepdims=1)
        den = self.op("Sqrt", [self.op("Add", [var, self.f32(node.attrs.eps)])])
        return [self.op("Mul", [self.op("Div", [x, den]), w])]

    def op_layer_norm(self, node: Node) -> list[str]:
        x = self.name(node.inputs[0])
        axes = self.const([-1])
        c = self.op("Sub", [x, self.op("ReduceMean", [x, axes], keepdims=1)])
        var = self.op("ReduceMean", [self.op("Mul", [c, c]), axes], keepdims=1)
        y = self.op("Div", [c, self.op("Sqrt", [self.op("Add", [var, self.f32(node.attrs.eps)])])])
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            y = self.op("Mul", [y, self.name(node.inputs[1])])
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            y = self.op("Add", [y, self.name(node.inputs[2])])
        return [y]

    def op_rope(self, node: Node) -> list[str]:
        x = self.name(node.inputs[0])
        d = node.inputs[0].type.shape[3]
        if not isinstance(d, int):
            raise self.fail("rope needs a static head dim")
        pv = node.inputs[1] if len(node.inputs) > 1 else None
        if pv is not None:
            pos = self.op("Cast", [self.name(pv)], to=TensorProto.FLOAT)  # [B or 1, S]
        else:
            s = self.op("Squeeze", [self.shape_of(x, 1, 2), self.const([0])])
            pos = self.op("Unsqueeze", [self.op("Cast", [self.op("Range", [self.const(0), s, self.const(1)])],
                                                to=TensorProto.FLOAT), self.const([0])])  # [1, S]
        inv = (1.0 / (node.attrs.theta ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))))
        ang = self.op("Mul", [self.op("Unsqueeze", [pos, self.const([-1])]),
                              self.const(inv.astype(np.float32), np.float32)])  # [., S, D/2]
        ang = self.op("Unsqueeze", [ang, self.const([2])])  # [., S, 1, D/2]
        if node.attrs.style == "interleaved":
            ang = self.op("Unsqueeze", [ang, self.const([-1])])  # [., S, 1, D/2, 1]
            xr = self.op("Reshape", [x, self.const([0, 0, 0, d // 2, 2])])
            x1, x2 = self.op("Split", [xr, self.const([1, 1])], 2, axis=-1)
        else:
            x1, x2 = self.op("Split", [x, self.const([d // 2, d // 2])], 2, axis=-1)
        cos, sin = self.op("Cos", [ang]), self.op("Sin", [ang])
        r1 = self.op("Sub", [self.op("Mul", [x1, cos]), self.op("Mul", [x2, sin])])
        r2 = self.op("Add", [self.op("Mul", [x2, cos]), self.op("Mul", [x1, sin])])
        y = self.op("Concat", [r1, r2], axis=-1)
        if node.attrs.style == "interleaved":
            y = self.op("Reshape", [y, self.const([0, 0, 0, d])])
        return [y]

    def op_attention(self, node: Node) -> list[str]:
        qt, kt, vt = (v.type for v in node.inputs[:3])
        h, kv, d = qt.shape[2], kt.shape[2], qt.shape[3]
        if not all(isinstance(z, int) for z in (h, kv, d)):
            raise self.fail("attention needs static head counts and head dim")
        q, k, v = (self.name(x) for x in node.inputs[:3])
        group = h // kv
        vd = vt.shape[3]
        if not isinstance(vd, int):
            raise self.fail("attention needs a static value head dim")
        # Query heads are grouped onto their kv head ([B, H, S, D] -> [B, KV, group*S, D]: head h
        # reads kv head h // group), so the keys and values are read as they are, never copied out
        # to H heads: a decode step's cost stays that of the cache it reads.
        qh = self.op("Transpose", [q], perm=[0, 2, 1, 3])  # [B, H, S, D]
        kh = self.op("Transpose", [k], perm=[0, 2, 3, 1])  # [B, KV, D, T]
        vh = self.op("Transpose", [v], perm=[0, 2, 1, 3])  # [B, KV, T, Dv]
        if group > 1:
            qh = self.op("Reshape", [qh, self.const([0, kv, -1, d])])
        scale = np.float32(node.attrs.scale if node.attrs.scale is not None else 1.0 / np.sqrt(d))
        scores = self.op("Mul", [self.op("MatMul", [qh, kh]), self.f32(scale)])
        if group > 1:
            scores = self.op("Reshape", [scores, self.const([0, h, -1, 0])])  # [B, H, S, T]
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        keep = None
        if node.attrs.causal:
            s = self.op("Squeeze", [self.shape_of(q, 1, 2), self.const([0])])
            t = self.op("Squeeze", [self.shape_of(k, 1, 2), self.const([0])])
            rows = self.op("Range", [self.const(0), s, self.const(1)])
            rows = self.op("Add", [rows, self.op("Sub", [t, s])])
            cols = self.op("Range", [self.const(0), t, self.const(1)])
            keep = self.op("LessOrEqual", [self.op("Unsqueeze", [cols, self.const([0])]),
                                           self.op("Unsqueeze", [rows, self.const([1])])])  # [S, T]
        if mask is not None:
            if mask.type.dtype == DType.BOOL:
                keep = self.name(mask) if keep is None else self.op("And", [keep, self.name(mask)])
            else:
                scores = self.op("Add", [scores, self.name(mask)])
        if keep is not None:
            # An additive bias over [S, T] (no head axis), not a Where over the [B, H, S, T]
            # scores: onnxruntime's broadcasting Where took ~7% of a 1,024-token prefill. The
            # lowest float32 rather than -inf: a kept score + 0 is itself, a hidden one's exp is
            # 0 as with -inf, and a row hidden completely stays finite (uniform), so it can be
            # zeroed on the smaller output instead of its probabilities.
            scores = self.op("Add", [scores, self.op("Where", [keep, self.f32(0.0), self.f32(LOWEST)])])
        probs = self.op("Softmax", [scores], axis=-1)
        bool_mask = mask is not None and mask.type.dtype == DType.BOOL
        if mask is not None and not bool_mask:
            probs = self._zero_masked_rows(probs, scores, None)
        if group > 1:
            probs = self.op("Reshape", [probs, self.const([0, kv, -1, 0])])  # [B, KV, group*S, T]
        out = self.op("MatMul", [probs, vh])  # [B, KV, group*S, Dv]
        if group > 1:
            out = self.op("Reshape", [out, self.const([0, h, -1, 0])])  # [B, H, S, Dv]
        if bool_mask:
            assert keep is not None
            out = self._zero_masked_rows(out, scores, keep)
        return [self.op("Transpose", [out], perm=[0, 2, 1, 3])]

    def _zero_masked_rows(self, probs: str, scores: str, keep: str | None) -> str:
        """Zeros for the query rows a mask hides completely (a left pad's row: every key it could
        see is a pad), as the interpreter gives: Softmax of a row of -inf is NaN, and a NaN row
        would reach later layers through 0 x NaN. `keep` (bool, broadcast to the scores): a row
        lives where any of it is kept; `probs` is then the attention output [B, H, S, Dv] (a
        bool mask adds the lowest float32, not -inf: the row is finite). Without it (an
        additive mask), `probs` are the probabilities and a row lives where its max is not -inf.
        Emitted only for an attention with a mask, so graphs without one are as before."""
        if keep is not None:
            seen = self.op("ReduceMax", [self.op("Cast", [keep], to=TensorProto.FLOAT), self.const([-1])],
                           keepdims=1)
            live = self.op("Cast", [seen], to=TensorProto.BOOL)
        else:
            peak = self.op("ReduceMax", [scores, self.const([-1])], keepdims=1)
            live = self.op("Not", [self.op("IsInf", [peak], detect_positive=0)])
        return self.op("Where", [live, probs, self.f32(0.0)])

    def op_kv_cache_append(self, node: Node) -> list[str]:
        """present = Concat(past, Transpose(new, [0, 2, 1, 3]), axis=2): [B, KV, P + S, D]."""
        past, new = self.name(node.inputs[0]), self.name(node.inputs[1])
        return [self.op("Concat", [past, self.op("Transpose", [new], perm=[0, 2, 1, 3])], axis=2)]

    def op_key_padding_mask(self, node: Node) -> list[str]:
        """keep [B, 1, 1, T] = attention_mask != 0."""
        keep = self.op("Cast", [self.name(node.inputs[0])], to=TensorProto.BOOL)
        return [self.op("Unsqueeze", [keep, self.const([1, 2])])]

    def op_gelu(self, node: Node) -> list[str]:
        x = self.name(node.inputs[0])
        if node.attrs.approximate == "tanh":
            c = self.f32(math.sqrt(2.0 / math.pi))
            cube = self.op("Mul", [self.op("Mul", [self.op("Mul", [self.f32(0.044715), x]), x]), x])
            inner = self.op("Mul", [c, self.op("Add", [x, cube])])
            half = self.op("Mul", [self.f32(0.5), x])
            return [self.op("Mul", [half, self.op("Add", [self.f32(1.0), self.op("Tanh", [inner])])])]
        erf = self.op("Erf", [self.op("Div", [x, self.f32(math.sqrt(2.0))])])
        return [self.op("Mul", [self.op("Mul", [self.f32(0.5), x]), self.op("Add", [self.f32(1.0), erf])])]

    def op_softmax(self, node: Node) -> list[str]:
        return [self.op("Softmax", [self.name(node.inputs[0])], axis=node.attrs.axis)]

    def op_add(self, node: Node) -> list[str]:
        return [self.op("Add", [self.name(node.inputs[0]), self.name(node.inputs[1])])]

    def op_mul(self, node: Node) -> list[str]:
        return [self.op("Mul", [self.name(node.inputs[0]), self.name(node.inputs[1])])]

    def op_split(self, node: Node) -> list[str]:
        x = self.name(node.inputs[0])
        if len(node.attrs.sizes) == 1:
            return [self.op("Identity", [x])]
        return list(self.op("Split", [x, self.const(list(node.attrs.sizes))], len(node.attrs.sizes),
                            axis=node.attrs.axis))

    def op_concat(self, node: Node) -> list[str]:
        return [self.op("Concat", [self.name(v) for v in node.inputs], axis=node.attrs.axis)]

    def op_reshape(self, node: Node) -> list[str]:
        return [self.op("Reshape", [self.name(node.inputs[0]), self.const(list(node.attrs.shape))])]

    def op_transpose(self, node: Node) -> list[str]:
        return [self.op("Transpose", [self.name(node.inputs[0])], perm=list(node.attrs.perm))]

    def op_cast(self, node: Node) -> list[str]:
        x = self.name(node.inputs[0])
        dt = node.attrs.dtype
        if dt.is_float:
            if not node.inputs[0].type.dtype.is_float:
                x = self.op("Cast", [x], to=TensorProto.FLOAT)
            return [self.round_to(x, dt) if dt in _ROUND_TYPES else self.op("Identity", [x])]
        return [self.op("Cast", [x], to=onnx_type(dt))]

    def op_position_ids(self, node: Node) -> list[str]:
        ids = self.name(node.inputs[0])
        index = node.inputs[1] if len(node.inputs) > 1 else None
        if index is not None:  # each token's index in its own sequence (a decoder's position_ids)
            idx = self.name(index)
            if index.type.dtype != DType.I64:
                idx = self.op("Cast", [idx], to=TensorProto.INT64)
            pos = self.op("Mul", [idx, self.const(node.attrs.stride)])
            return [self.op("Add", [pos, self.const(node.attrs.offset)])]
        s = self.op("Squeeze", [self.shape_of(ids, 1, 2), self.const([0])])
        r = self.op("Range", [self.const(0), s, self.const(1)])
        pos = self.op("Mul", [r, self.const(node.attrs.stride)])
        pos = self.op("Add", [pos, self.const(node.attrs.offset)])
        return [self.op("Expand", [pos, self.op("Shape", [ids])])]

    def op_moe_gate(self, node: Node) -> list[str]:
        x, w = self.name(node.inputs[0]), self.name(node.inputs[1])
        p = self.op("Softmax", [self.op("MatMul", [x, w])], axis=-1)
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is not None:
            scores = self.op("Add", [p, self.op("Reshape", [self.name(bias), self.const([-1])])])
        else:
            scores = p
        _, idx = self.op("TopK", [scores, self.const([node.attrs.top_k])], 2, axis=-1, largest=1, sorted=1)
        wts = self.op("GatherElements", [p, idx], axis=-1)
        if node.attrs.normalize:
            total = self.op("ReduceSum", [wts, self.const([-1])], keepdims=1)
            wts = self.op("Div", [wts, self.op("Max", [total, self.f32(node.attrs.norm_min)])])
        return [wts, idx]

    def op_moe_experts(self, node: Node) -> list[str]:
        return self._moe(node, lora=False)

    def op_moe_experts_lora(self, node: Node) -> list[str]:
        return self._moe(node, lora=True)

    def _moe(self, node: Node, lora: bool) -> list[str]:
        e, hidden, two_i = node.inputs[3].type.shape
        if not all(isinstance(z, int) for z in (e, hidden, two_i)):
            raise self.fail("moe_experts needs static expert weights")
        x = self.name(node.inputs[0])
        k = node.inputs[1].type.shape[-1]
        tokens = self.op("Reshape", [x, self.const([-1, hidden])])  # [T, H]
        flat_w = self.op("Reshape", [self.name(node.inputs[1]), self.const([-1, k])])
        flat_i = self.op("Reshape", [self.name(node.inputs[2]), self.const([-1, k])])
        if node.inputs[2].type.dtype != DType.I64:
            flat_i = self.op("Cast", [flat_i], to=TensorProto.INT64)
        pad = list(node.inputs) + [None] * (9 - len(node.inputs))
        scale = float(node.attrs.scale) if lora else 0.0
        adapters = [(self.name(pad[5]), self.name(pad[6])) if lora and pad[5] is not None else None,
                    (self.name(pad[7]), self.name(pad[8])) if lora and pad[7] is not None else None]
        if self.moe_form == "dense":
            return [self._moe_dense(node, x, tokens, flat_w, flat_i, e, two_i // 2, adapters, scale)]
        return [self._moe_sparse(node, x, tokens, flat_w, flat_i, two_i // 2, adapters, scale)]

    def _moe_ffn(self, v: str, ug: str | Callable[[str], str], dn: str | Callable[[str], str], inter: int,
                 adapters: list[tuple[str, str] | None], scale: float) -> str:
        """SwiGLU expert FFN of rows v (optionally with LoRA adapters) -> [., H]; `ug` / `dn` are
        weights, or functions of rows -> rows @ weight (MatMulNBits experts)."""
        def times(x: str, w: str | Callable[[str], str]) -> str:
            return w(x) if callable(w) else self.op("MatMul", [x, w])

        h = times(v, ug)
        if adapters[0] is not None:
            low = self.op("MatMul", [self.op("MatMul", [v, adapters[0][0]]), adapters[0][1]])
            h = self.op("Add", [h, self.op("Mul", [low, self.f32(scale)])])
        gate, up = self.op("Split", [h, self.const([inter, inter])], 2, axis=-1)
        den = self.op("Add", [self.f32(1.0), self.op("Exp", [self.op("Neg", [gate])])])
        act = self.op("Mul", [self.op("Div", [gate, den]), up])
        y = times(act, dn)
        if adapters[1] is not None:
            low = self.op("MatMul", [self.op("MatMul", [act, adapters[1][0]]), adapters[1][1]])
            y = self.op("Add", [y, self.op("Mul", [low, self.f32(scale)])])
        return y

    def _moe_dense(self, node: Node, x: str, tokens: str, flat_w: str, flat_i: str, e: int, inter: int,
                   adapters: list[tuple[str, str] | None], scale: float) -> str:
        """Every expert on every token, weighted by a [T, E] routing matrix (checking form)."""
        ug, dn = self.name(node.inputs[3]), self.name(node.inputs[4])
        zeros_shape = self.op("Concat", [self.shape_of(tokens, 0, 1), self.const([e])], axis=0)
        zeros = self.op("ConstantOfShape", [zeros_shape],
                        value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
        route = self.op("ScatterElements", [zeros, flat_i, flat_w], axis=1)  # [T, E]
        y = self._moe_ffn(self.op("Unsqueeze", [tokens, self.const([0])]), ug, dn, inter, adapters, scale)
        r = self.op("Unsqueeze", [self.op("Transpose", [route], perm=[1, 0]), self.const([-1])])  # [E, T, 1]
        out = self.op("ReduceSum", [self.op("Mul", [y, r]), self.const([0])], keepdims=0)  # [T, H]
        return self.op("Reshape", [out, self.op("Shape", [x])])

    def _expert_views(self, name: str) -> list[str]:
        """One initializer per expert of a stacked initializer [E, ...] over the same bytes (each
        expert's slice is contiguous): external data entries at the expert's offset, or the
        expert's slice of the raw data. No byte is written twice."""
        t = self.inits[name]
        e, inner = t.dims[0], math.prod(t.dims[1:])
        if t.data_type == TensorProto.INT4:
            if inner % 2:
                raise self.fail(f"int4 expert stack {name} has an odd expert size")
            per = inner // 2
        else:
            per = inner * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        ext = {x.key: x.value for x in t.external_data} if t.data_location == TensorProto.EXTERNAL else None
        views = []
        for i in range(e):
            u = onnx.TensorProto()
            u.name, u.data_type = f"{name}[{i}]", t.data_type
            u.dims.extend(t.dims[1:])
            if ext is not None:
                u.data_location = TensorProto.EXTERNAL
                offset = int(ext.get("offset", "0")) + i * per
                for k, val in (("location", ext["location"]), ("offset", str(offset)), ("length", str(per))):
                    entry = u.external_data.add()
                    entry.key, entry.value = k, val
            else:
                u.raw_data = t.raw_data[i * per:(i + 1) * per]
            self.inits[u.name] = u
            views.append(u.name)
        return views

    def _drop_unread(self, names: list[str]) -> None:
        """Forget initializers no node reads any more (their bytes are still the experts' views)."""
        read = {i for nd in self.nodes for i in nd.input}
        for n in names:
            if n not in read:
                self.inits.pop(n, None)

    def _nbits_linear(self, node: Node) -> bool:
        """Whether this `dequantize` of a [K, N] weight (a fallback of the target's kernel choice)
        is lowered, with the `linear` that is its only reader, as one MatMulNBits: with
        weight-only or fast numerics (not exact: the bf16 rounding of the dequantized weight is
        dropped), when its groups fit MatMulNBits."""
        uses = node.outputs[0].uses
        k = node.inputs[0].type.shape[0] if node.inputs[0].type.rank == 2 else None
        return (self.form == "matmulnbits" and self.numerics != "exact"
                and isinstance(k, int) and _nbits_block(k, node.attrs.group_size) is not None
                and len(uses) == 1 and uses[0][0].op == "linear" and uses[0][1] == 1)

    def _nbits_experts(self, node: Node) -> bool:
        """Whether this `dequantize` of an expert stack is lowered per expert as MatMulNBits: with
        weight-only or fast numerics (the bf16 rounding of the dequantized weight that exact
        numerics keep is dropped), in the sparse form, when the MoE is its only reader and the
        groups fit MatMulNBits."""
        uses = node.outputs[0].uses
        k = node.inputs[0].type.shape[-2] if node.inputs[0].type.rank == 3 else None
        return (self.form == "matmulnbits" and self.numerics != "exact" and self.moe_form == "sparse"
                and isinstance(k, int) and _nbits_block(k, node.attrs.group_size) is not None
                and len(uses) == 1 and uses[0][0].op in ("moe_experts", "moe_experts_lora")
                and uses[0][1] in (3, 4))

    def _expert_matmuls(self, v: Value) -> Callable[[int], Callable[[str], str]]:
        """A function of an expert index -> a function of rows x -> x @ that expert's weight."""
        node = self.deferred.pop(v, None)
        if node is None:
            weight = self._expert_weights(v)
            return lambda i: (lambda x: self.op("MatMul", [x, weight(i)]))
        qv, sv = node.inputs[0], node.inputs[1]
        q, s = self.take(qv), self.take(sv)
        bits = 4 if qv.type.dtype == DType.I4 else 8
        gs = node.attrs.group_size
        base = qv.name if isinstance(qv, Param) else self.fresh("unpacked")

        def matmul(i: int) -> Callable[[str], str]:
            def rows_times_expert(x: str) -> str:
                self.created = []
                y = self.matmul_nbits(x, np.asarray(q[i]).astype(np.int8),
                                      f"{base}[{i}]", s if s.ndim == 0 else s[i], gs, bits, by_rows=False)
                self.branch_inits.update(self.created)  # the expert's weights live in its branch
                self.created = None
                return y
            return rows_times_expert

        return matmul

    def _expert_weights(self, v: Value) -> Callable[[int], str]:
        """A function of an expert index -> that expert's float32 weight [K, N], read from an
        initializer of its own (a view of the stack's bytes).

        A stack dequantized here (a `dequantize` read only by this node) is viewed before the
        DequantizeLinear, so a call dequantizes only the experts it routes to; the stacked
        DequantizeLinear (and its rounding Casts) is dropped from the graph."""
        stacked = self.name(v)
        by_out = {o: nd for nd in self.nodes for o in nd.output}
        casts: list[int] = []
        cur = by_out.get(stacked)
        chain: list[onnx.NodeProto] = []
        while cur is not None and cur.op_type == "Cast":
            chain.append(cur)
            casts.append(helper.get_attribute_value(cur.attribute[0]))
            cur = by_out.get(cur.input[0])
        fusable = (v.producer is not None and v.producer.op == "dequantize" and v.num_uses() == 1
                   and cur is not None and cur.op_type == "DequantizeLinear" and len(cur.input) == 2
                   and cur.input[0] in self.inits and cur.input[1] in self.inits)
        if not fusable:
            if stacked in self.inits and v.num_uses() == 1:  # a float param stack: view it per expert
                views = self._expert_views(stacked)
                self.branch_inits.update(views)
                self._drop_unread([stacked])
                return lambda i: views[i]
            return lambda i: self.op("Gather", [stacked, self.const(i)], axis=0)
        assert cur is not None
        dq = cur
        chain.append(dq)
        for nd in chain:
            self.nodes.remove(nd)
        attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
        qn, sn = dq.input[0], dq.input[1]
        q_views = self._expert_views(qn)
        per_tensor = len(self.inits[sn].dims) == 0
        s_views = [sn] * len(q_views) if per_tensor else self._expert_views(sn)
        self._drop_unread([qn, sn])
        kw: dict[str, int] = {}
        if not per_tensor:
            kw["axis"] = int(attrs.get("axis", 1)) - 1
            if "block_size" in attrs:
                kw["block_size"] = int(attrs["block_size"])

        def weight(i: int) -> str:
            w = self.op("DequantizeLinear", [q_views[i], s_views[i]], **kw)
            for to in reversed(casts):
                w = self.op("Cast", [w], to=to)
            return w if casts else self.fusion_barrier(w)

        return weight

    def _moe_sparse(self, node: Node, x: str, tokens: str, flat_w: str, flat_i: str, inter: int,
                    adapters: list[tuple[str, str] | None], scale: float) -> str:
        """Grouped by expert: one `If` per expert, taken only when the call routes a token to it;
        its branch gathers the expert's (row, slot) pairs (NonZero / Gather), runs the expert's
        FFN on those rows alone, reading its weights from initializers of its own (dequantized
        there, so only routed experts are dequantized), and adds the weighted rows to the
        output (ScatterND add). Slots of weight 0 (experts another rank holds) are skipped:
        dense adds 0 for them."""
        e = node.inputs[3].type.shape[0]
        ug_of, dn_of = self._expert_matmuls(node.inputs[3]), self._expert_matmuls(node.inputs[4])
        routed = self.op("Not", [self.op("Equal", [flat_w, self.f32(0.0)])])
        masked = self.op("Where", [routed, flat_i, self.const(-1)])  # [T, k], -1 where skipped
        hit = self.op("Equal", [self.op("Unsqueeze", [masked, self.const([-1])]), self.const(np.arange(e))])
        present = self.op("Cast", [self.op("ReduceMax", [self.op("Cast", [hit], to=TensorProto.INT32),
                                                         self.const([0, 1])], keepdims=0)],
                          to=TensorProto.BOOL)  # [E]: is expert e routed to in this call
        acc = self.op("Mul", [tokens, self.f32(0.0)])
        for i in range(e):
            outer = self.nodes
            self.nodes = []
            hits = self.op("NonZero", [self.op("Equal", [masked, self.const(i)])])  # [2, n]: (row, slot)
            rows = self.op("Gather", [hits, self.const(0)], axis=0)  # [n]
            wr = self.op("GatherND", [flat_w, self.op("Transpose", [hits], perm=[1, 0])])  # [n]
            xr = self.op("Gather", [tokens, rows], axis=0)  # [n, H]
            y = self._moe_ffn(xr, ug_of(i), dn_of(i), inter,
                              [None if ad is None else (self.op("Gather", [ad[0], self.const(i)], axis=0),
                                                        self.op("Gather", [ad[1], self.const(i)], axis=0))
                               for ad in adapters], scale)
            y = self.op("Mul", [y, self.op("Unsqueeze", [wr, self.const([-1])])])
            taken = self.op("ScatterND", [acc, self.op("Unsqueeze", [rows, self.const([-1])]), y],
                            reduction="add")
            then_nodes, self.nodes = self.nodes, []
            kept = self.op("Identity", [acc])
            else_nodes, self.nodes = self.nodes, outer
            branch = self.fresh(f"moe_expert{i}")
            # the expert's float weight views live in its branch, where onnxruntime pre-packs them
            own = [self.inits.pop(n) for n in dict.fromkeys(i for nd in then_nodes for i in nd.input)
                   if n in self.branch_inits]
            then_g = helper.make_graph(then_nodes, f"{branch}_then", [],
                                       [helper.make_tensor_value_info(taken, TensorProto.FLOAT, None)],
                                       initializer=own)
            else_g = helper.make_graph(else_nodes, f"{branch}_else", [],
                                       [helper.make_tensor_value_info(kept, TensorProto.FLOAT, None)])
            cond = self.op("Gather", [present, self.const(i)], axis=0)
            acc = self.op("If", [cond], then_branch=then_g, else_branch=else_g)
        return self.op("Reshape", [acc, self.op("Shape", [x])])

@contextmanager
def dense_moe() -> Iterator[None]:
    """Within the block, MoE experts export densely (every expert on every token): for checking."""
    _Emitter.moe_form = "dense"
    try:
        yield
    finally:
        _Emitter.moe_form = "sparse"


def _lowering(e: _Emitter, node: Node) -> Callable[[Node], list[str] | None] | None:
    """The op's own `lower_onnx` (docs/ops.md) first, else the emitter's `op_<name>`."""
    hook = node.opdef.lower_onnx
    if hook is not None:
        return lambda n: hook(n, e)
    fn: Callable[[Node], list[str] | None] | None = getattr(e, f"op_{node.op}", None)
    return fn


def lowers(op: OpDef) -> bool:
    """Whether `op` has an ONNX lowering: its own `lower_onnx` or the emitter's `op_<name>`."""
    return op.lower_onnx is not None or hasattr(_Emitter, f"op_{op.name}")


def supported_ops() -> list[str]:
    return sorted(name for name, op in all_ops().items() if lowers(op))


def unsupported_ops(graph: Graph) -> list[str]:
    """The ops of `graph` that have no ONNX lowering (sorted, unique)."""
    return sorted({n.op for n in graph if not lowers(n.opdef)})


def _check_choice(form: str, numerics: str | None) -> str:
    """The numerics to write (`None`: the default of the form; qdq has only exact), checked."""
    if numerics is None:
        numerics = "exact" if form == "qdq" else DEFAULT_NUMERICS
    if form not in FORMS:
        raise OnnxExportError(f"unknown ONNX form {form!r}: choose one of {', '.join(FORMS)}")
    if numerics not in NUMERICS:
        raise OnnxExportError(f"unknown ONNX numerics {numerics!r}: choose {', '.join(NUMERICS)}")
    if form == "qdq" and numerics != "exact":
        raise OnnxExportError(f"ONNX form qdq has no {numerics} numerics of its own (onnxruntime's "
                              "default optimizer chooses them): use form matmulnbits for numerics "
                              f"{numerics}")
    return numerics


def build_onnx(graph: Graph, *, form: str = "matmulnbits", numerics: str | None = None) -> onnx.ModelProto:
    """The ONNX model of `graph` in memory (initializers inline)."""
    numerics = _check_choice(form, numerics)
    return _Emitter(graph, form, numerics=numerics).run()


def emit_onnx(graph: Graph, folder: Path, *, form: str = "matmulnbits",
              numerics: str | None = None) -> list[Path]:
    """Write `folder/model.onnx` + `folder/model.onnx.data` (every initializer external); returns both.

    `numerics` (see the module): "weight-only" (the default: float32 activations, every
    quantized weight dequantized in float32 inside a MatMulNBits), "exact" (equal to the
    interpreter, the bf16 rounding of dequantized weights included, in any onnxruntime session)
    or "fast" (int8 activations in the matmuls, accuracy_level 4); recorded in the model's
    metadata. The model passes `onnx.checker.check_model` (checked here, path-based).
    """
    numerics = _check_choice(form, numerics)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / MODEL_FILE
    data = folder / DATA_FILE
    sink = _ExternalData(data)
    try:
        model = _Emitter(graph, form, sink, numerics).run()  # weights go to `data` as they are made
    finally:
        sink.file.close()
    onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path), full_check=False)
    return [path, data]
