"""The text format, parsing side: text -> Graph, with errors at line and column.

The format is line oriented: a header line, then one statement per line
(`meta`, `param`, a node, `return`) and a closing `}`. A general tokenizer
parses any statement and pinpoints errors. Node and param lines, which are
nearly all of a large graph, first take a fast path: string splitting and
cached sub-parses (types and attribute texts repeat across layers); a line
the fast path does not take, for example one with a quoted param name, goes
through the general parser. Tests check that both paths build identical graphs.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from .dtypes import DType
from .errors import ErnieIRError, IRParseError
from .graph import Graph, Node, Param, Value
from .registry import OpDef, get_op
from .types import Dim, TensorType

_TOKEN = re.compile(
    r"""
     (?P<ws>[ \t]+)
    |(?P<comment>//.*)
    |(?P<value>%(?:[A-Za-z0-9_][A-Za-z0-9_.]*|"(?:[^"\\]|\\.)*"))
    |(?P<param>@(?:[A-Za-z0-9_][A-Za-z0-9_.\-/:]*|"(?:[^"\\]|\\.)*"))
    |(?P<string>"(?:[^"\\]|\\.)*")
    |(?P<number>-inf\b|-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)
    |(?P<arrow>->)
    |(?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    |(?P<punct>[()\[\]{},:=*])
    """,
    re.VERBOSE,
)
_SURROGATE = re.compile("[\ud800-\udfff]")
_MAX_DEPTH = 64
"""Deepest nesting of [...] and {...} values: deeper is refused, not a RecursionError."""
_MAX_DIGITS = 4300
"""Python's limit for int(str) (sys.get_int_max_str_digits()); longer integers are refused."""
_MAX_DIM = 2**63 - 1
_FINITE_META = ("config",)
"""Metadata whose numbers must be finite: the model's config, which config.json gives (where a
non-finite number is refused too) and which passes and writers read. Other metadata may hold
inf or nan."""


@dataclass(slots=True)
class _Tok:
    kind: str
    text: str
    col: int  # 1-based


class _Line:
    """Recursive-descent reader over the tokens of one line."""

    def __init__(self, text: str, lineno: int, source: str) -> None:
        self.lineno = lineno
        self.source = source
        self.toks: list[_Tok] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                raise self.error_at(pos + 1, f"unexpected character {text[pos]!r}")
            kind = m.lastgroup or ""
            if kind not in ("ws", "comment"):
                self.toks.append(_Tok(kind, m.group(), pos + 1))
            pos = m.end()
        self.i = 0
        self.end_col = len(text) + 1
        self.depth = 0
        self.finite: tuple[str, ...] = ()
        """Top-level keys whose numbers must be finite, as op attributes must be."""
        self.keys: list[str] = []

    def error_at(self, col: int, msg: str) -> IRParseError:
        return IRParseError(msg, self.lineno, col, self.source)

    def error(self, msg: str) -> IRParseError:
        col = self.toks[self.i].col if self.i < len(self.toks) else self.end_col
        return self.error_at(col, msg)

    def peek(self) -> _Tok | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def at(self, text: str) -> bool:
        t = self.peek()
        return t is not None and t.text == text and t.kind in ("punct", "arrow", "ident")

    def take(self) -> _Tok:
        t = self.peek()
        if t is None:
            raise self.error("unexpected end of line")
        self.i += 1
        return t

    def expect(self, text: str) -> _Tok:
        t = self.peek()
        if t is None or t.text != text:
            found = "end of line" if t is None else repr(t.text)
            raise self.error(f"expected {text!r}, found {found}")
        self.i += 1
        return t

    def expect_kind(self, kind: str, what: str) -> _Tok:
        t = self.peek()
        if t is None or t.kind != kind:
            found = "end of line" if t is None else repr(t.text)
            raise self.error(f"expected {what}, found {found}")
        self.i += 1
        return t

    def done(self) -> None:
        if self.i < len(self.toks):
            raise self.error(f"unexpected {self.toks[self.i].text!r} at end of statement")

    # -- grammar pieces ---------------------------------------------------------

    def name_of(self, tok: _Tok) -> str:
        body = tok.text[1:] if tok.kind in ("value", "param") else tok.text
        return self.unquote(tok, body) if body.startswith('"') else body

    def unquote(self, tok: _Tok, text: str | None = None) -> str:
        """The value of a quoted string token (JSON escapes); a bad escape is a parse error."""
        text = tok.text if text is None else text
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            col = tok.col + len(tok.text) - len(text) + e.pos
            raise self.error_at(col, f"invalid string {text}: {e.msg}") from None
        if _SURROGATE.search(value):
            # Python would hold it, but no UTF-8 file or terminal can: printing the graph would fail.
            raise self.error_at(tok.col, f"string {text[:40]} has a lone surrogate escape (\\ud800-"
                                         "\\udfff): write the character itself or a valid pair")
        return value

    def integer(self, tok: _Tok) -> int:
        if len(tok.text.lstrip("-")) > _MAX_DIGITS:
            raise self.error_at(tok.col, f"integer of {len(tok.text.lstrip('-'))} digits (at most "
                                         f"{_MAX_DIGITS}): write a smaller number")
        return int(tok.text)

    def nest(self, tok: _Tok) -> None:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise self.error_at(tok.col, f"values nested deeper than {_MAX_DEPTH} levels of [...] "
                                         "and {...}: flatten the value")

    def tensor_type(self) -> TensorType:
        t = self.expect_kind("ident", "a type such as f32[B,S,1024]")
        try:
            dtype = DType.parse(t.text)
        except ValueError as e:
            raise self.error_at(t.col, str(e)) from None
        self.expect("[")
        dims: list[Dim] = []
        while not self.at("]"):
            if dims:
                self.expect(",")
            dims.append(self.dim())
        self.expect("]")
        return TensorType(dtype, dims)

    def dim(self) -> Dim:
        parts: list[str] = []
        while True:
            t = self.take()
            if (t.kind == "number" and t.text.isdigit()) or t.kind == "ident":
                parts.append(t.text)
            else:
                raise self.error_at(t.col, f"expected a dim (integer or symbol), found {t.text!r}")
            if not self.at("*"):
                break
            self.take()
        if len(parts) == 1 and parts[0].isdigit():
            if len(parts[0]) > 19 or int(parts[0]) > _MAX_DIM:
                raise self.error_at(t.col, f"dim {parts[0][:24]}{'...' if len(parts[0]) > 24 else ''} "
                                           "is larger than 2**63 - 1: no tensor has that many elements")
            return int(parts[0])
        return "*".join(parts)

    def value(self) -> Any:
        t = self.take()
        if t.kind == "number":
            if t.text == "-inf":
                return self.number(t, float("-inf"))
            if any(c in t.text for c in ".eE"):
                return self.number(t, float(t.text))
            return self.integer(t)
        if t.kind == "string":
            return self.unquote(t)
        if t.kind == "ident":
            consts = {"true": True, "false": False, "none": None,
                      "inf": float("inf"), "nan": float("nan")}
            if t.text in consts:
                return self.number(t, consts[t.text])
            try:
                return DType(t.text)
            except ValueError:
                raise self.error_at(t.col, f"unknown constant {t.text!r} (strings need quotes)") from None
        if t.text == "[":
            self.nest(t)
            items = []
            while not self.at("]"):
                if items:
                    self.expect(",")
                items.append(self.value())
            self.expect("]")
            self.depth -= 1
            return items
        if t.text == "{":
            self.i -= 1
            return self.dict_value()
        raise self.error_at(t.col, f"expected a value, found {t.text!r}")

    def number(self, t: _Tok, v: Any) -> Any:
        """`v`, or under a `finite` key an error naming the key when it is inf or nan (1e309
        reads as inf)."""
        if self.keys and self.keys[0] in self.finite and isinstance(v, float) and not math.isfinite(v):
            raise self.error_at(t.col, f"meta {'.'.join(self.keys)}: {t.text} is not a finite number: "
                                       "write a finite value")
        return v

    def dict_value(self) -> dict[str, Any]:
        self.nest(self.expect("{"))
        out: dict[str, Any] = {}
        while not self.at("}"):
            if out:
                self.expect(",")
            k = self.take()
            if k.kind not in ("ident", "string"):
                raise self.error_at(k.col, f"expected a key, found {k.text!r}")
            key = self.unquote(k) if k.kind == "string" else k.text
            if key in out:
                raise self.error_at(k.col, f"duplicate key {key!r}")
            self.expect("=")
            self.keys.append(key)
            out[key] = self.value()
            self.keys.pop()
        self.expect("}")
        self.depth -= 1
        return out


class _NodeLine:
    """The pieces of a printed node line, with the column of each (like a re.Match)."""

    __slots__ = ("_groups", "_starts")

    def __init__(self, groups: tuple[str, str, str, str | None, str, str | None],
                 starts: dict[str, int]) -> None:
        self._groups = groups
        self._starts = starts

    def groups(self) -> tuple[str, str, str, str | None, str, str | None]:
        return self._groups

    def start(self, name: str) -> int:
        return self._starts[name]


def _split_node_line(raw: str) -> _NodeLine | None:
    """Split `%0, %1 = op(args) {attrs} : types loc("scope")` by string search.

    Exact for every line the printer writes: a scope is a JSON string, so an unescaped
    ` loc("` can only be the real one, and types never contain ` : `. Anything unusual
    (quoted names, parentheses in args, odd spacing) returns None: the general parser,
    which reports errors precisely, takes it.
    """
    body = raw.rstrip()
    indent = len(body) - len(body.lstrip())
    loc = None
    if body.endswith('")'):
        k = body.rfind(' loc("')
        if k == -1:
            return None
        loc = body[k + 5:-1]
        body = body[:k]
    k = body.rfind(" : ")
    if k == -1:
        return None
    types = body[k + 3:]
    head = body[:k]
    eq = head.find(" = ")
    paren = head.find("(", eq)
    close = head.find(")", paren)
    if eq == -1 or paren == -1 or close == -1 or '"' in types:
        return None
    outs = head[indent:eq]
    op = head[eq + 3:paren]
    args = head[paren + 1:close]
    tail = head[close + 1:]
    if '"' in args or "(" in args or not op.isidentifier() or not _OUTS_FAST.fullmatch(outs):
        return None
    if loc is not None and not _PLAIN_SCOPE.fullmatch(loc):  # escapes, quotes, control characters
        return None
    attrs = None
    if tail:
        if not (tail.startswith(" {") and tail.endswith("}")):
            return None
        attrs = tail[1:]
    starts = {"outs": indent, "op": eq + 3, "args": paren + 1, "attrs": close + 2, "types": k + 3}
    return _NodeLine((outs, op, args, attrs, types, loc), starts)


_OUTS_FAST = re.compile(r"%[A-Za-z0-9_][A-Za-z0-9_.]*(?:, %[A-Za-z0-9_][A-Za-z0-9_.]*)*")
_PLAIN_SCOPE = re.compile(r'"[^"\\\x00-\x1f]*"')
_PARAM_FAST = re.compile(
    r"\s*param @([A-Za-z0-9_][A-Za-z0-9_.\-/:]*) : ([a-z0-9]+\[[^\]\[]*\])( trainable)?\s*$"
)
_TYPE_FAST = re.compile(r"([a-z0-9]+)\[([^\]]*)\]")


class _GraphParser:
    def __init__(self, text: str, source: str, check_types: bool, fast: bool) -> None:
        self.lines = text.split("\n")
        self.source = source
        self.check_types = check_types
        self.fast = fast
        self.graph: Graph | None = None
        self.env: dict[str, Value] = {}
        self.out_names: list[str] = []
        self.returned = False
        self.out_types: list[TensorType] = []
        self.type_cache: dict[str, list[TensorType]] = {}
        self.opdefs: dict[str, OpDef] = {}
        self.attr_cache: dict[tuple[str, str], Any] = {}
        self.at_line = 1

    def line(self, idx: int) -> _Line:
        return _Line(self.lines[idx], idx + 1, self.source)

    def run(self) -> Graph:
        idx = self._skip(0)
        if idx >= len(self.lines):
            raise IRParseError("empty input: expected 'graph @name(...) -> (...) {'", 1, 1, self.source)
        self.at_line = idx + 1
        self.header(self.line(idx))
        idx += 1
        closed = 0  # line number of the closing brace, once seen
        while idx < len(self.lines):
            self.at_line = idx + 1  # for an error no statement parser raises (RecursionError)
            raw = self.lines[idx]
            stripped = raw.strip()
            if not stripped or stripped.startswith("//"):
                idx += 1
                continue
            if closed:
                raise IRParseError("text after the closing '}'", idx + 1,
                                   len(raw) - len(raw.lstrip()) + 1, self.source)
            col = len(raw) - len(raw.lstrip()) + 1
            if self.returned and stripped != "}":
                raise IRParseError("only '}' may follow 'return'", idx + 1, col, self.source)
            if stripped == "}":
                closed = idx + 1
            elif stripped.startswith("%"):
                self.node(idx)
            elif stripped.startswith("param"):
                if not self.param_fast(idx):
                    self.param(self.line(idx))
            elif stripped.startswith("meta"):
                self.meta(self.line(idx))
            elif stripped.startswith("return"):
                self.ret(self.line(idx))
                self.returned = True
            else:
                raise IRParseError(
                    f"expected a statement (%value = op(...), param, meta, return or '}}'), "
                    f"found {stripped.split()[0]!r}", idx + 1, col, self.source)
            idx += 1
        if not closed:
            raise IRParseError("missing closing '}' of the graph", len(self.lines), 1, self.source)
        assert self.graph is not None
        if not self.graph.outputs and self.out_names:
            raise IRParseError("missing 'return' statement before the closing '}'", closed, 1,
                               self.source)
        return self.graph

    def _skip(self, idx: int) -> int:
        while idx < len(self.lines) and (
            not self.lines[idx].strip() or self.lines[idx].strip().startswith("//")
        ):
            idx += 1
        return idx

    def header(self, ln: _Line) -> None:
        kw = ln.expect_kind("ident", "'graph'")
        if kw.text != "graph":
            raise ln.error_at(kw.col, f"expected 'graph', found {kw.text!r}")
        name = ln.name_of(ln.expect_kind("param", "a graph name such as @main"))
        self.graph = Graph(name)
        ln.expect("(")
        while not ln.at(")"):
            if self.graph.inputs:
                ln.expect(",")
            tok = ln.expect_kind("value", "an input such as %input_ids")
            vname = ln.name_of(tok)
            ln.expect(":")
            if any(v.name == vname for v in self.graph.inputs):
                raise ln.error_at(tok.col, f"input %{vname} is declared twice")
            v = self.graph.add_input(vname, ln.tensor_type())
            self.define(ln, tok, tok.text, v)
        ln.expect(")")
        ln.expect("->")
        ln.expect("(")
        while not ln.at(")"):
            if self.out_names:
                ln.expect(",")
            t = ln.take()
            if t.kind not in ("ident", "string"):
                raise ln.error_at(t.col, f"expected an output name, found {t.text!r}")
            self.out_names.append(ln.unquote(t) if t.kind == "string" else t.text)
            ln.expect(":")
            self.out_types.append(ln.tensor_type())
        ln.expect(")")
        ln.expect("{")
        ln.done()

    def define(self, ln: _Line, tok: _Tok, key: str, v: Value) -> None:
        if key in self.env:
            raise ln.error_at(tok.col, f"{key} is defined twice (SSA: one definition per value)")
        self.env[key] = v

    def meta(self, ln: _Line) -> None:
        ln.expect("meta")
        ln.finite = _FINITE_META
        assert self.graph is not None
        self.graph.metadata.update(ln.dict_value())
        ln.done()

    def param_fast(self, idx: int) -> bool:
        """A plain declaration (no annotations or hash) without tokenizing; False if not plain."""
        m = _PARAM_FAST.match(self.lines[idx]) if self.fast else None
        if m is None or self.graph is None or m.group(1) in self.graph.params:
            return False
        ptype = self.types(m.group(2), idx, m.start(2) + 1)
        if len(ptype) != 1:
            return False
        self.graph.add_param(Param(m.group(1), ptype[0], trainable=m.group(3) is not None))
        return True

    def param(self, ln: _Line) -> None:
        ln.expect("param")
        tok = ln.expect_kind("param", "a param name such as @ernie.norm.weight")
        name = ln.name_of(tok)
        ln.expect(":")
        ptype = ln.tensor_type()
        annotations: dict[str, Any] = {}
        if ln.at("{"):
            annotations = ln.dict_value()
        trainable = False
        digest = None
        while ln.peek() is not None:
            t = ln.take()
            if t.text == "trainable" and not trainable:
                trainable = True
            elif t.text == "hash" and digest is None:
                digest = ln.unquote(ln.expect_kind("string", "a quoted hash"))
            else:
                raise ln.error_at(t.col, f"unexpected {t.text!r} in a param declaration")
        assert self.graph is not None
        if name in self.graph.params:
            raise ln.error_at(tok.col, f"param @{name} is declared twice")
        p = Param(name, ptype, trainable=trainable, annotations=annotations)
        p.digest = digest
        self.graph.add_param(p)

    def ret(self, ln: _Line) -> None:
        kw = ln.expect("return")
        values: list[Value] = []
        cols: list[int] = []
        while ln.peek() is not None:
            if values:
                ln.expect(",")
            tok = ln.take()
            values.append(self.operand(ln, tok))
            cols.append(tok.col)
        assert self.graph is not None
        if len(values) != len(self.out_names):
            raise ln.error_at(kw.col, f"return has {len(values)} values but the header declares "
                                 f"{len(self.out_names)} outputs")
        for i, (v, t) in enumerate(zip(values, self.out_types, strict=True)):
            if v.type != t:
                raise ln.error_at(cols[i], f"output {self.out_names[i]} is declared {t} but returns "
                                           f"{v.type}")
        self.graph.set_outputs(values, self.out_names)

    def operand(self, ln: _Line, tok: _Tok) -> Value:
        assert self.graph is not None
        if tok.kind == "value":
            v = self.env.get(tok.text)
            if v is None and tok.text.startswith('%"'):
                v = self.env.get("%" + ln.name_of(tok))
            if v is None:
                raise ln.error_at(tok.col, f"use of undefined value {tok.text}")
            return v
        if tok.kind == "param":
            name = ln.name_of(tok)
            p = self.graph.params.get(name)
            if p is None:
                raise ln.error_at(tok.col, f"use of undeclared param @{name} (declare it with 'param')")
            return p
        raise ln.error_at(tok.col, f"expected a value (%name) or param (@name), found {tok.text!r}")

    # -- nodes ------------------------------------------------------------------------

    def node(self, idx: int) -> None:
        raw = self.lines[idx]
        m = _split_node_line(raw) if self.fast else None
        if m is None:
            self.node_general(self.line(idx))
            return
        # Fast path: every piece below has a fixed, already-validated shape.
        lineno = idx + 1
        outs_text, opname, args, attrs_text, types_text, loc = m.groups()
        opdef = self.opdefs.get(opname) or self.opdef(opname, lineno, m.start("op") + 1)
        inputs: list[Value | None] = []
        if args:
            env = self.env
            params = self.graph.params if self.graph is not None else {}
            for piece in args.split(","):
                a = piece.strip()
                v = env.get(a)
                if v is not None:
                    inputs.append(v)
                elif a == "none":
                    inputs.append(None)
                elif a.startswith("%"):
                    # Point at this operand: the n-th comma-separated piece of the arguments.
                    col = m.start("args") + 1 + args.index(piece) + len(piece) - len(piece.lstrip())
                    raise IRParseError(f"use of undefined value {a}", lineno, col, self.source)
                elif a.startswith("@") and a[1:] in params:
                    inputs.append(params[a[1:]])
                else:
                    self.node_general(self.line(idx))
                    return
        attrs_text = attrs_text or ""
        attrs = self.attrs(opdef, attrs_text, idx,
                           m.start("attrs") + 1 if attrs_text else m.start("op") + 1, outs_text)
        types = self.type_cache.get(types_text) or self.types(types_text, idx, m.start("types") + 1)
        outs = outs_text.split(", ")
        scope = "" if loc is None else loc[1:-1]  # plain: _split_node_line sent escapes elsewhere
        self.make_node(opdef, inputs, attrs, types, outs, scope, lineno, m.start("outs") + 1,
                       m.start("types") + 1)

    def node_general(self, ln: _Line) -> None:
        outs: list[_Tok] = [ln.expect_kind("value", "a result such as %0")]
        while ln.at(","):
            ln.take()
            outs.append(ln.expect_kind("value", "a result such as %1"))
        ln.expect("=")
        optok = ln.expect_kind("ident", "an op name")
        opdef = self.opdef(optok.text, ln.lineno, optok.col)
        ln.expect("(")
        inputs: list[Value | None] = []
        while not ln.at(")"):
            if inputs:
                ln.expect(",")
            t = ln.take()
            inputs.append(None if t.kind == "ident" and t.text == "none" else self.operand(ln, t))
        ln.expect(")")
        attrs_values: dict[str, Any] = {}
        attr_col = 0
        if ln.at("{"):
            attr_col = ln.peek().col  # type: ignore[union-attr]
            attrs_values = ln.dict_value()
        try:
            attrs = opdef.make_attrs(attrs_values)
        except ErnieIRError as e:
            node = ", ".join(t.text for t in outs)
            raise ln.error_at(attr_col or optok.col, f"node {node}: {e}") from None
        ln.expect(":")
        type_col = ln.peek().col if ln.peek() is not None else ln.end_col
        types = [ln.tensor_type()]
        while ln.at(","):
            ln.take()
            types.append(ln.tensor_type())
        scope = ""
        if ln.at("loc"):
            ln.take()
            ln.expect("(")
            scope = ln.unquote(ln.expect_kind("string", "a quoted scope"))
            ln.expect(")")
        ln.done()
        out_keys = []
        for t in outs:
            out_keys.append(t.text if not t.text.startswith('%"') else "%" + ln.name_of(t))
        self.make_node(opdef, inputs, attrs, types, out_keys, scope, ln.lineno, outs[0].col,
                       type_col)

    def opdef(self, name: str, lineno: int, col: int) -> OpDef:
        try:
            self.opdefs[name] = get_op(name)
            return self.opdefs[name]
        except ErnieIRError as e:
            raise IRParseError(str(e), lineno, col, self.source) from None

    def attrs(self, opdef: OpDef, text: str, idx: int, col: int, node: str) -> Any:
        key = (opdef.name, text)
        hit = self.attr_cache.get(key)
        if hit is not None:
            return hit
        values: dict[str, Any] = {}
        if text:
            ln = _Line(" " * (col - 1) + text, idx + 1, self.source)
            values = ln.dict_value()
            ln.done()
        try:
            attrs = opdef.make_attrs(values)
        except ErnieIRError as e:  # the node named, as its results are written
            raise IRParseError(f"node {node}: {e}", idx + 1, col or 1, self.source) from None
        self.attr_cache[key] = attrs
        return attrs

    def types(self, text: str, idx: int, col: int) -> list[TensorType]:
        hit = self.type_cache.get(text)
        if hit is not None:
            return hit
        ln = _Line(" " * (col - 1) + text, idx + 1, self.source)
        types = [ln.tensor_type()]
        while ln.at(","):
            ln.take()
            types.append(ln.tensor_type())
        ln.done()
        self.type_cache[text] = types
        return types

    def make_node(self, opdef: OpDef, inputs: list[Value | None], attrs: Any,
                  types: list[TensorType], outs: list[str], scope: str, lineno: int,
                  out_col: int, type_col: int) -> None:
        try:
            node = Node(opdef.name, inputs, attrs, scope=scope, output_types=types)
        except ErnieIRError as e:
            raise IRParseError(str(e), lineno, out_col, self.source) from None
        problem, col = "", out_col
        if self.check_types:
            try:
                expected = node.infer_types()
            except ErnieIRError as e:
                problem, col = str(e), type_col
            else:
                if expected != types:
                    want = ", ".join(str(t) for t in expected)
                    got = ", ".join(str(t) for t in types)
                    problem = f"{opdef.name} produces {want}, but the text declares {got}"
                    col = type_col
        if not problem and len(outs) != len(node.outputs):
            problem = f"{opdef.name} has {len(node.outputs)} results but the line names {len(outs)}"
        env = self.env
        if not problem:
            for key in outs:
                if key in env:
                    problem = f"{key} is defined twice (SSA: one definition per value)"
        if problem:
            node.drop_inputs()
            raise IRParseError(problem, lineno, col, self.source)
        for key, v in zip(outs, node.outputs, strict=True):
            env[key] = v
        assert self.graph is not None
        self.graph.append(node)


def parse_graph(text: str, *, source: str = "<ir>", check_types: bool = True,
                fast: bool = True) -> Graph:
    """Parse IR text into a Graph (params come without data; see `load_graph`).

    With `check_types`, each node's declared result types must equal what its
    op's type rule infers; a mismatch is an error at that line. `fast=False`
    forces the general parser for every line (used by tests).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # only through the API: a file read as UTF-8 has none
        line = text.count("\n", 0, e.start) + 1
        col = e.start - (text.rfind("\n", 0, e.start) + 1) + 1
        raise IRParseError(f"lone surrogate U+{ord(text[e.start]):04X}: the text is not valid Unicode "
                           "(IR text is UTF-8)", line, col, source) from None
    try:
        return _GraphParser(text, source, check_types, fast).run()
    except IRParseError as e:
        message = str(e)
        if message.isprintable():
            raise
        # A quoted name or key may hold a newline (`@"a\nb"`): the error stays one line.
        e.args = ("".join(c if c.isprintable() else ascii(c)[1:-1] for c in message),)
        raise e from None
