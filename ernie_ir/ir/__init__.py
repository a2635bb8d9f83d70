"""The IR core: dtypes, tensor types, values/params/nodes/graphs, the op
registry, the builder, the text format, the verifier and graph folders.

Nothing here imports another ernie_ir package; the op set registers its
loader from `ernie_ir.ops` (imported by `ernie_ir/__init__.py`) and loads on
first lookup, with the `ernie_ir.ops` plugins.
"""

from .builder import GraphBuilder
from .dtypes import DType, bf16, boolean, f8e4m3, f8e5m2, f16, f32, i4, i8, i32, i64, u8
from .errors import ErnieIRError, IRParseError, OpError, VerificationError, WeightError
from .graph import Graph, Node, Param, Value
from .registry import Input, NoAttrs, OpAttrs, OpDef, all_ops, get_op, has_op, register_op
from .types import Dim, TensorType, tensor

__all__ = [
    "DType",
    "Dim",
    "ErnieIRError",
    "Graph",
    "GraphBuilder",
    "IRParseError",
    "Input",
    "NoAttrs",
    "Node",
    "OpAttrs",
    "OpDef",
    "OpError",
    "Param",
    "TensorType",
    "Value",
    "VerificationError",
    "WeightError",
    "all_ops",
    "bf16",
    "boolean",
    "f8e4m3",
    "f8e5m2",
    "f16",
    "f32",
    "get_op",
    "has_op",
    "i4",
    "i8",
    "i32",
    "i64",
    "register_op",
    "tensor",
    "u8",
]
