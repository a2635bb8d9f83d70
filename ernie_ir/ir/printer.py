"""The text format, printing side.

    graph @demo(%x: f32[B,16]) -> (y: f32[B,32]) {
      meta {model = "demo"}
      param @proj.weight : bf16[16,32] trainable
      %0 = linear(%x, @proj.weight) : f32[B,32] loc("proj")
      %1 = silu(%0) : f32[B,32] loc("act")
      return %1
    }

Rules that make the text canonical (golden files are this text):
- graph inputs keep their names; node outputs are numbered %0, %1, ... in
  definition order, so renaming values never changes the text;
- params are declared once, by name, with their type, annotations (sorted
  keys), the `trainable` flag and, on request, a content hash; their data
  lives beside the text (weights.safetensors), never in it;
- every attribute of an op is printed, keys sorted, so the text does not
  depend on schema defaults;
- floats print with Python's shortest round-tripping repr; a scope prints as
  `loc("...")`.
"""

from __future__ import annotations

import enum
import json
import math
import re
from typing import Any

from .graph import Graph, Node, Param, Value
from .registry import OpAttrs
from .types import TensorType
from .weights import content_hash

BARE_VALUE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.]*")
BARE_PARAM = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-/:]*")
BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def quote(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def param_ref(name: str) -> str:
    return "@" + (name if BARE_PARAM.fullmatch(name) else quote(name))


def input_ref(name: str) -> str:
    return "%" + (name if BARE_VALUE.fullmatch(name) and not name.isdigit() else quote(name))


def output_label(name: str) -> str:
    return name if BARE_KEY.fullmatch(name) else quote(name)


def format_value(v: Any) -> str:
    """An attribute or annotation value in the text syntax."""
    if v is None:
        return "none"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, enum.Enum):
        return str(v.value)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(float(v))  # float(): numpy's float64 (a float subclass) reprs as np.float64(...)
    if isinstance(v, str):
        return quote(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(format_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return format_dict(v)
    if isinstance(v, OpAttrs):
        return format_attrs(v)
    raise TypeError(f"cannot print attribute value {v!r} of type {type(v).__name__}")


def format_dict(d: dict[str, Any]) -> str:
    items = (f"{k if BARE_KEY.fullmatch(k) else quote(k)} = {format_value(d[k])}" for k in sorted(d))
    return "{" + ", ".join(items) + "}"


def format_attrs(attrs: OpAttrs) -> str:
    """All fields of an op's attrs, sorted; empty string for an op without attrs."""
    fields = attrs.__dict__
    if not fields:
        return ""
    return format_dict(fields)


def format_param(p: Param, *, with_hash: bool = False) -> str:
    line = f"param {param_ref(p.name)} : {p.type}"
    if p.annotations:
        line += " " + format_dict(p.annotations)
    if p.trainable:
        line += " trainable"
    digest = content_hash(p.read()) if with_hash and p.source is not None else p.digest
    if digest is not None:
        line += f' hash "{digest}"'
    return line


class _Printer:
    def __init__(self, graph: Graph, with_hashes: bool) -> None:
        self.graph = graph
        self.with_hashes = with_hashes
        self.names: dict[Value, str] = {}
        self.type_cache: dict[TensorType, str] = {}
        self.attr_cache: dict[int, str] = {}

    def type_str(self, t: TensorType) -> str:
        s = self.type_cache.get(t)
        if s is None:
            s = self.type_cache[t] = str(t)
        return s

    def ref(self, v: Value | None) -> str:
        if v is None:
            return "none"
        name = self.names.get(v)
        if name is not None:
            return name
        if isinstance(v, Param):
            return param_ref(v.name)
        # A value defined nowhere we know of: print it recognisably; the verifier reports it.
        return f"%<undefined {v.name or id(v)}>"

    def node_line(self, node: Node, counter: int) -> tuple[str, int]:
        outs = []
        for v in node.outputs:
            name = f"%{counter}"
            counter += 1
            self.names[v] = name
            outs.append(name)
        args = ", ".join(self.ref(v) for v in node.inputs)
        attrs = self.attr_cache.get(id(node.attrs))
        if attrs is None:
            attrs = format_attrs(node.attrs)
            self.attr_cache[id(node.attrs)] = attrs
        types = ", ".join(self.type_str(v.type) for v in node.outputs)
        line = f"  {', '.join(outs)} = {node.op}({args})"
        if attrs:
            line += " " + attrs
        line += " : " + types
        if node.scope:
            line += f" loc({quote(node.scope)})"
        return line, counter

    def run(self) -> str:
        g = self.graph
        for v in g.inputs:
            self.names[v] = input_ref(v.name or "")
        ins = ", ".join(f"{self.names[v]}: {self.type_str(v.type)}" for v in g.inputs)
        names = g.output_names
        outs = ", ".join(
            f"{output_label(names[i] if i < len(names) else f'out{i}')}: {self.type_str(v.type)}"
            for i, v in enumerate(g.outputs))
        lines = [f"graph {param_ref(g.name)}({ins}) -> ({outs}) {{"]
        if g.metadata:
            lines.append(f"  meta {format_dict(g.metadata)}")
        for p in g.params.values():
            lines.append("  " + format_param(p, with_hash=self.with_hashes))
        counter = 0
        for node in g:
            line, counter = self.node_line(node, counter)
            lines.append(line)
        lines.append("  return " + ", ".join(self.ref(v) for v in g.outputs))
        lines.append("}")
        return "\n".join(lines) + "\n"


def print_graph(graph: Graph, *, with_hashes: bool = False) -> str:
    """The canonical text of a graph (ends with a newline)."""
    return _Printer(graph, with_hashes).run()
