"""Strategies and the totality property shared by tests/fuzz and benchmarks/fuzz_soak.py.

Every reader of user input (IR text and files, pipeline text and YAML, quant-config YAML,
config.json, safetensors headers, CLI option strings) must be total: for any input it returns,
or raises an `ErnieIRError` whose message is one line; any other exception is a bug. Inputs are
mostly mutations of valid ones (printed @tiny graphs, registry pipelines, built-in configs,
written safetensors files), because random bytes rarely get past the first token.

`check_total(fn, *args)` runs one call under a wall-clock alarm (and, on request, a tracemalloc
peak bound) and returns the seconds it took and whether the input was accepted; a non-project
exception propagates unchanged, so hypothesis shows and shrinks it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import signal
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import ernie_ir  # noqa: F401  (registers the op set)
from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.dtypes import DType
from ernie_ir.ir.graph import Graph, Param
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.weights import ArraySource, write_safetensors

TIME_LIMIT_S = 10.0
"""One call longer than this is a hang (the slowest honest input takes milliseconds)."""
PEAK_LIMIT = 256 << 20
"""Bytes one call may allocate at peak (traced by tracemalloc; numpy's buffers included)."""


class FuzzHang(BaseException):
    """Raised by the alarm; a BaseException so that `except Exception` in the code under test
    cannot swallow it."""


class AbsurdAllocation(AssertionError):
    """A call allocated more than PEAK_LIMIT bytes."""


class NotOneLine(AssertionError):
    """An ErnieIRError whose message spans lines (the CLI promises one line)."""


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def ring(signum: int, frame: Any) -> None:
        raise FuzzHang(f"no result after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def check_total(fn: Callable[..., Any], *args: Any, trace_memory: bool = False) -> tuple[float, bool]:
    """Call fn(*args): returning or a one-line ErnieIRError is fine. Returns the seconds taken
    and whether the input was accepted (False: refused with an ErnieIRError). `trace_memory` bounds
    the peak allocation (for readers that allocate arrays; it slows pure-Python parsing 2x)."""
    started_tracing = trace_memory and not tracemalloc.is_tracing()
    if started_tracing:
        tracemalloc.start()
    elif trace_memory:
        tracemalloc.reset_peak()
    t0 = time.perf_counter()
    accepted = False
    try:
        with _alarm(TIME_LIMIT_S):
            fn(*args)
        accepted = True
    except ErnieIRError as e:
        if "\n" in str(e) or "\r" in str(e):
            raise NotOneLine(f"{type(e).__name__} message is not one line: {str(e)[:300]!r}") from e
    finally:
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1] if trace_memory else 0
        if started_tracing:
            tracemalloc.stop()
    if peak > PEAK_LIMIT:
        raise AbsurdAllocation(f"peak allocation {peak / 2**20:.0f} MiB (limit {PEAK_LIMIT >> 20} MiB)")
    return elapsed, accepted


def fuzz_settings(examples: int) -> settings:
    """CI settings: a fixed seed (derandomize), no example database, no per-example deadline (the
    alarm in check_total is the hang bound; hypothesis's 200 ms one is noise on a shared machine)."""
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)


# -- shared pieces --------------------------------------------------------------------------------

INTERESTING_NUMBERS = [
    "0", "-0", "1", "-1", "2", "3", "7", "00", "007", "0.0", "1.5", "-2.5", "1e-400", "1e308",
    "1e309", "-1e309", "1e99999", "nan", "inf", "-inf", "2147483648", "4294967296",
    "9223372036854775807", "9223372036854775808", "-9223372036854775809", "18446744073709551616",
    "1" + "0" * 30, "1000000000000000000", "9" * 5000, "1e" + "9" * 12, "0x10", "1_000",
]
STRANGE_TEXT = [
    "", " ", "\t", "\r", "\r\n", "\x00", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\ufeff", "é",
    "\u202e", "\U0001d4b3", "\udcff", "\ud800", "中文", "a" * 100_000, "x" * 5000, "[" * 5000,
    "{" * 5000, "(" * 5000, "[" * 3000 + "]" * 3000, "{a=" * 3000 + "1" + "}" * 3000,
    '"\\ud800"', '"\\u12"', '"\\x41"', '"unterminated', "//", "/*", "%", "@", "%%", "@@",
    "->", "=", ":", ",", "*", "**", "...", "-",
]


def _mutate_list(data: st.DataObject, items: list[str], pool: st.SearchStrategy[str],
                 numbers: bool = True) -> list[str]:
    """One token-level mutation: delete, duplicate, swap, replace or insert."""
    if not items:
        return [data.draw(pool)]
    i = data.draw(st.integers(0, len(items) - 1))
    op = data.draw(st.sampled_from(["delete", "duplicate", "swap", "replace", "insert", "number"]))
    out = list(items)
    if op == "delete":
        del out[i]
    elif op == "duplicate":
        out.insert(i, out[i])
    elif op == "swap":
        j = data.draw(st.integers(0, len(items) - 1))
        out[i], out[j] = out[j], out[i]
    elif op == "replace":
        out[i] = data.draw(pool)
    elif op == "insert":
        out.insert(i, data.draw(pool))
    else:
        nums = [k for k, t in enumerate(out) if t[:1].isdigit() or t[:2] in ("-1", "-2", "-9")]
        k = data.draw(st.sampled_from(nums)) if nums and numbers else i
        out[k] = data.draw(st.sampled_from(INTERESTING_NUMBERS))
    return out


_TEXT_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|-?\d[\w.+-]*|[%@]?[A-Za-z_][\w.\-/:]*|\s+|.', re.S)


def _tokens(text: str) -> list[str]:
    """Text split into words, numbers, strings, punctuation and whitespace (joining gives it back)."""
    return _TEXT_TOKEN.findall(text)


@st.composite
def mutated_text(draw: Any, seeds: st.SearchStrategy[str], pool: st.SearchStrategy[str],
                 max_mutations: int = 4) -> str:
    """A seed text with 1..max_mutations token, line or character mutations."""
    text = draw(seeds)
    data = draw(st.data())
    for _ in range(draw(st.integers(1, max_mutations))):
        kind = draw(st.sampled_from(["token", "token", "token", "line", "char", "truncate"]))
        if kind == "token":
            text = "".join(_mutate_list(data, _tokens(text), pool))
        elif kind == "line":
            lines = text.split("\n")
            text = "\n".join(_mutate_list(data, lines, pool, numbers=False))
        elif kind == "char":
            pos = draw(st.integers(0, len(text)))
            text = text[:pos] + draw(st.characters()) + text[pos:]
        else:
            text = text[: draw(st.integers(0, len(text)))]
    return text


# -- IR text ------------------------------------------------------------------------------------

SMALL_IR = """\
graph @g(%x: f32[B,4], %xa: f32[B,4]) -> (y: f32[B,4]) {
  meta {model = "m", nested = {a = [1, 2.5, "s", none, true, bf16]}}
  param @w : f32[4,4] {bits = 8} trainable
  param @"quoted name" : bf16[4] hash "0123456789abcdef"
  %0 = linear(%x, @w) : f32[B,4] loc("proj")
  %1 = softmax(%0) {axis = -1} : f32[B,4] loc("act")
  %2 = add(%xa, %1) : f32[B,4]
  %3 = reshape(%2) {shape = [0, -1]} : f32[B,4]
  return %3
}
"""

_PIPELINES_FOR_SEEDS = [
    ("ernie-4.5-21b-a3b@tiny", "wint8mix"),
    ("gpt-345m@tiny", "split{tp=2,rank=1}"),
    ("ernie-4.5-0.3b@tiny", "lora{rank=2}"),
    ("ernie-3.5-se-3b@tiny", "O2,qat-int8"),
    ("ernie-4.5-300b-a47b@tiny", ""),
]


@functools.cache
def ir_seeds() -> tuple[str, ...]:
    """Printed graphs of every family, some after quantization, LoRA, TP split or fusion."""
    from ernie_ir.load import load_input
    from ernie_ir.passes.infra.manager import run_pipeline

    texts = [SMALL_IR]
    for model, pipeline in _PIPELINES_FOR_SEEDS:
        g = load_input(model)
        if pipeline:
            run_pipeline(g, pipeline)
        texts.append(print_graph(g))
    return tuple(texts)


@functools.cache
def _ir_vocabulary() -> tuple[str, ...]:
    from ernie_ir.ir.registry import all_ops

    ops = sorted(all_ops())
    dtypes = [d.value for d in DType]
    words = ["graph", "param", "meta", "return", "loc", "trainable", "hash", "none", "true", "false",
             "inf", "nan", "-inf", "B", "S", "B*S", "%0", "%1", "%99", "%x", "%input_ids", "@w",
             "@ernie.norm.weight", "{}", "[]", "()", "[B,S]", "f32[B,4]", "i4[3]", "{axis = -1}",
             "{eps = 1e-05}", '"s"', '"loc"']
    return (*ops, *dtypes, *words, *STRANGE_TEXT)


def ir_pool() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(_ir_vocabulary()), st.sampled_from(INTERESTING_NUMBERS),
                     st.text(max_size=8))


_IR_SLOTS = {
    # attribute, meta and annotation values: `key = VALUE`
    "value": (r'(?<= = )(?:"(?:[^"\\\n]|\\.)*"|[^,{}\[\]\s()]+(?![\w(]))', [
        "[" * 3000 + "]" * 3000, "{a = " * 2000 + "1" + "}" * 2000, "9" * 5000, "-" + "9" * 5000,
        "1e99999", "nan", "-inf", "none", "true", "bf16", "i4", '"\\ud800"', '"\\udc00x"', '"\\u0000"',
        '"\\q"', '"' + "a" * 100_000 + '"', "[]", "{}", "[1, [2, [3]]]", "{x = bf16}", "-0", "0.0"]),
    # dims inside a type: `f32[DIM,DIM]`
    "dim": (r"(?<=[\[,])[A-Za-z0-9_*]+(?=[\],])", [
        "0", "1", "9" * 5000, "9" * 30, "9223372036854775808", "B*S*B", "B*", "*", "-1", "1.5", "S",
        "x" * 5000, "é", "B*9"]),
    # quoted strings: scopes, quoted names, string values
    "string": (r'"(?:[^"\\\n]|\\.)*"', [
        '"\\ud800"', '"\\udfff\\ud800"', '"\\ud83d\\ude00"', '"\\u12"', '"\\x41"', '"\\"', '""',
        '"\u2028"', '"\t"', '"' + "é" * 5000 + '"', '"a\\nb"', "'single'"]),
    # keys of attributes, meta and annotations: `{KEY = value}`
    "key": (r"(?<=[{,] )[A-Za-z_]\w*(?= = )|(?<=\{)[A-Za-z_]\w*(?= = )", [
        '"a\\nb"', '"\\ud800"', '""', '"x"', "axis", "eps", "shape", "bits", '"a b"', "true", "none",
        "k" * 5000]),
    # value and param names
    "name": (r"[%@](?:[A-Za-z0-9_][\w.\-/:]*)", [
        "%0", "%99999", "%" + "x" * 100_000, '%"\\ud800"', '%"a b"', "@w", '@""', '@"\\u0000"', "%",
        "@", "%input_ids", "@ernie.norm.weight", "%-1", '@"a\\nb"', '%"a\\nb"']),
}


@st.composite
def ir_slot_mutation(draw: Any, seeds: st.SearchStrategy[str]) -> str:
    """A seed graph with 1..3 grammar slots (a value, a dim, a string, a name) replaced by an
    extreme of their kind: deep nesting, 5000 digits, lone surrogates, 100k-character names."""
    text = draw(seeds)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(sorted(_IR_SLOTS)))
        pattern, pool = _IR_SLOTS[kind]
        spots = [m.span() for m in re.finditer(pattern, text)]
        if not spots:
            continue
        a, b = spots[draw(st.integers(0, len(spots) - 1))]
        text = text[:a] + draw(st.sampled_from(pool)) + text[b:]
    return text


def ir_texts() -> st.SearchStrategy[str]:
    """Mutated printed graphs, plus a little pure noise."""
    seeds = st.sampled_from(ir_seeds())
    return st.one_of(mutated_text(seeds, ir_pool()), ir_slot_mutation(seeds), st.text(max_size=200),
                     st.sampled_from(ir_seeds()))


def parse_ir_property(text: str) -> None:
    """parse -> verify -> print -> parse again: text accepted once prints to UTF-8 that parses to
    the same text (the CLI writes it to disk and to stdout)."""
    from ernie_ir.ir.parser import parse_graph
    from ernie_ir.ir.verifier import verify_problems

    graph = parse_graph(text, source="fuzz.ir")
    verify_problems(graph)
    printed = print_graph(graph)
    printed.encode("utf-8")
    again = print_graph(parse_graph(printed, source="printed.ir"))
    assert again == printed, "printing a parsed graph is not a fixed point"


def parse_ir_both_paths(text: str) -> None:
    """The fast and the general parser accept the same texts with the same message."""
    from ernie_ir.ir.parser import parse_graph

    results = []
    for fast in (True, False):
        try:
            results.append(("ok", print_graph(parse_graph(text, fast=fast))))
        except ErnieIRError as e:
            results.append(("error", type(e).__name__))
    assert results[0][0] == results[1][0], f"fast path {results[0]} but general path {results[1]}"


# -- op attributes of the wrong type --------------------------------------------------------------
# Every kind of value the IR text reader makes (int, float with inf and nan, bool, none, string,
# dtype, list, dict), in IR text and as the Python values the parser hands to `make_attrs`.
# Swapped into any attribute of any op, each is validated or refused with one OpError line:
# an op's validator never sees a value of another type (`group_size = bf16` once reached
# `v <= 0` as the string "bf16") and no float attribute is inf or nan (`eps = 1e309`).

ATTR_VALUE_TEXTS = [
    "0", "1", "-1", "2", "64", "128", "-0", "1.5", "0.0", "1e-05", "1e309", "-1e309", "1e-400",
    "nan", "inf", "-inf", "9223372036854775808", "true", "false", "none", '""', '"s"', '"none"',
    '"tanh"', '"half"', '"bf16"', *(d.value for d in DType), "[]", "[1]", "[0, -1]", "[true]",
    "[bf16]", "[1.5]", "[none]", '["a"]', "[[1]]", "[inf]", "{}", "{a = 1}", "{group_size = bf16}",
]
ATTR_VALUES: list[Any] = [
    0, 1, -1, 2, 7, 8, 64, 80, 128, 2**63, -(2**63) - 1, 10**30, 0.0, -0.0, 0.5, 1e-5, 1e4,
    math.inf, -math.inf, math.nan, True, False, None, "", "x", "none", "tanh", "half",
    "interleaved", "bf16", *DType, [], [1], [0, -1], [True], [DType.BF16], [1.5], [None],
    [math.inf], [[1]], ["a"], (1, 2), {}, {"a": 1},
]

_ATTR_SLOT = re.compile(r'(?:(?<=\{)|(?<=, ))([A-Za-z_]\w* = )'  # `key = ` after `{` or `, `
                        r'(\[[^\[\]\n]*\]|"(?:[^"\\\n]|\\.)*"|[^,{}\[\]\s()]+)')  # a flat list or a word


@st.composite
def ir_attr_swaps(draw: Any) -> str:
    """A seed graph with 1..3 op attribute values (on node lines) replaced by a value of any
    other kind, or an attribute added with a real name and such a value."""
    lines = draw(st.sampled_from(ir_seeds())).split("\n")
    nodes = [i for i, line in enumerate(lines) if line.lstrip().startswith("%") and "{" in line]
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.sampled_from(nodes))
        spots = list(_ATTR_SLOT.finditer(lines[i]))
        value = draw(st.sampled_from(ATTR_VALUE_TEXTS))
        if spots and draw(st.integers(0, 4)):
            m = spots[draw(st.integers(0, len(spots) - 1))]
            lines[i] = lines[i][:m.start(2)] + value + lines[i][m.end(2):]
        else:  # an attribute the node does not write (a default), or one the op lacks
            key = draw(st.sampled_from(_attr_names()))
            lines[i] = lines[i].replace("{", f"{{{key} = {value}, ", 1)
    return "\n".join(lines)


@functools.cache
def _attr_fields() -> dict[str, tuple[str, ...]]:
    """Every op that has attributes, with their names."""
    from ernie_ir.ir.registry import all_ops

    return {name: tuple(op.Attrs.model_fields) for name, op in all_ops().items() if op.Attrs.model_fields}


@functools.cache
def _attr_names() -> tuple[str, ...]:
    return tuple(sorted({k for keys in _attr_fields().values() for k in keys}))


@functools.cache
def _seed_attrs() -> tuple[tuple[str, dict[str, Any]], ...]:
    """(op, attribute values) of every distinct node of the seed graphs: valid starting points."""
    from ernie_ir.ir.parser import parse_graph

    found: dict[tuple[str, str], dict[str, Any]] = {}
    for text in ir_seeds():
        for node in parse_graph(text).nodes:
            values = dict(node.attrs.__dict__)
            if values:
                found.setdefault((node.op, repr(values)), values)
    return tuple((op, values) for (op, _), values in sorted(found.items()))


@st.composite
def swapped_attrs(draw: Any) -> tuple[str, dict[str, Any]]:
    """(op name, attribute values): a seed node's valid attributes, or just the op's name for
    ops no seed uses, with 1..2 attributes set to a value of any kind."""
    fields = _attr_fields()
    if draw(st.booleans()):
        op, values = draw(st.sampled_from(_seed_attrs()))
        values = dict(values)
    else:
        op, values = draw(st.sampled_from(sorted(fields))), {}
    for key in draw(st.lists(st.sampled_from(fields[op]), min_size=1, max_size=2, unique=True)):
        values[key] = draw(st.sampled_from(ATTR_VALUES))
    return op, values


def make_attrs_property(op_name: str, values: dict[str, Any]) -> None:
    """`make_attrs` accepts values of the annotated types only (no bool as a number, no dtype as
    an int) with finite floats (unless the field says `allow_inf_nan=True`), or refuses them with
    one OpError line."""
    from ernie_ir.ir import OpError, get_op

    op = get_op(op_name)
    try:
        attrs = op.make_attrs(values)
    except OpError as e:
        if "\n" in str(e):
            raise NotOneLine(f"message is not one line: {str(e)[:300]!r}") from e
        raise
    for key, value in attrs.__dict__.items():
        given = values.get(key)
        flat = value if isinstance(value, tuple) else (value,)
        takes_inf_nan = any(getattr(m, "allow_inf_nan", False) for m in op.Attrs.model_fields[key].metadata)
        assert takes_inf_nan or not any(isinstance(x, float) and not math.isfinite(x) for x in flat), (
            f"op {op_name}: attribute {key} accepted non-finite {value!r}")
        if isinstance(given, bool):
            assert isinstance(value, bool), f"op {op_name}: attribute {key}: {given} became {value!r}"
        if isinstance(given, DType):
            assert value is given, f"op {op_name}: attribute {key}: dtype {given} became {value!r}"


# -- pipelines ----------------------------------------------------------------------------------

OPTION_VALUES = st.one_of(
    st.sampled_from([0, 1, 2, -1, 8, 10**18, 2**63, 10**400, 0.5, -0.0, 1e308, math.inf, -math.inf,
                     math.nan, True, False, None, "", "x", "bf16", "f32", "int4", "wint8", "split",
                     "replicate", "plain", "per_head", "inference", "fake", ".*qkv.*", "glob:*",
                     "re:(", "a" * 5000, "\u2028", "é", "\ud800", "none", "1e999"]),
    st.lists(st.sampled_from([".*qkv.*", "x", 1, None, [1]]), max_size=3),
    st.dictionaries(st.sampled_from(["a", "b", "ernie.", "name", "rules", "match", "algo"]),
                    st.sampled_from(["x", 1, None, "(", "weight_only_int4", [{"match": "(", "algo": "x"}],
                                     [{"match": ".*", "algo": "weight_only_int8"}], {"a": {"b": 1}}]),
                    max_size=3),
    st.fixed_dictionaries({"name": st.sampled_from(["mine", "", "a\nb"]), "rules": st.lists(
        st.fixed_dictionaries({"match": st.sampled_from([".*q_proj", "(", "glob:*", "re:x{99999999999}"]),
                               "algo": st.sampled_from(["weight_only_int4", "weight_only_int8", "nope",
                                                        "fp8"])}), max_size=2)}),
    st.text(max_size=6), st.integers(),
)


@functools.cache
def _registry() -> tuple[dict[str, list[str]], tuple[str, ...]]:
    from ernie_ir.passes.infra.registry import REGISTRY

    REGISTRY.ensure_loaded()
    passes = {name: list(cls.Options.model_fields) for name, cls in REGISTRY.passes.items()}
    return passes, tuple(REGISTRY.presets)


@st.composite
def pipeline_items(draw: Any) -> list[tuple[str, dict[str, Any]]]:
    """A list of (pass or preset name, options), mostly real names with mostly real options."""
    passes, presets = _registry()
    names = st.sampled_from(sorted(passes) + list(presets) + ["nope", "cse ", "C", "x-y", "a\nb"])
    items = []
    for _ in range(draw(st.integers(1, 5))):
        name = draw(names)
        fields = [*passes.get(name, []), "bogus", "rank", "x\ny"]
        keys = draw(st.lists(st.sampled_from(fields), max_size=3, unique=True))
        items.append((name, {k: draw(OPTION_VALUES) for k in keys}))
    return items


def _text_value(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ",".join(_text_value(x) for x in v) + "]"
    if isinstance(v, dict):  # a mapping option, `{key=value,...}`
        return "{" + ",".join(f"{json.dumps(k) if not k.isidentifier() else k}={_text_value(x)}"
                              for k, x in v.items()) + "}"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, float):
        return repr(v)
    return str(v)


def render_pipeline_text(items: list[tuple[str, dict[str, Any]]]) -> str:
    parts = []
    for name, opts in items:
        body = ",".join(f"{k}={_text_value(v)}" for k, v in opts.items())
        parts.append(name + ("{" + body + "}" if opts else ""))
    return ",".join(parts)


def pipeline_pool() -> st.SearchStrategy[str]:
    passes, presets = _registry()
    return st.one_of(st.sampled_from([*passes, *presets, "{", "}", "=", ",", "[", "]", '"', "\\",
                                      *STRANGE_TEXT]), st.sampled_from(INTERESTING_NUMBERS))


def pipeline_texts() -> st.SearchStrategy[str]:
    rendered = pipeline_items().map(render_pipeline_text)
    return st.one_of(rendered, mutated_text(rendered, pipeline_pool(), max_mutations=3),
                     st.text(max_size=60))


def _yaml_document(items: list[tuple[str, dict[str, Any]]], shape: str) -> str:
    listing: list[Any] = [name if not opts else {name: opts} for name, opts in items]
    doc: Any = {"pipeline": listing} if shape == "key" else listing
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)


YAML_SPECIALS = [
    "", "~", "[]", "{}", "- ", "pipeline:", "pipeline: [cse, {dce: 3}]", "passes: cse",
    "- !!python/object/apply:os.system [echo]", "- !!binary aGVsbG8=", "- 2001-12-14",
    "- {? [a, b] : 1}", "- {cse: [1, 2]}", "- {cse: {}, dce: {}}", "- {1: {rank: 2}}",
    "- {lora: {rank: .nan}}", "- {lora: {rank: 1e999}}", "- {lora: {rank: 0x10}}",
    "- {lora: {targets: !!set {a, b}}}", "- &a [*a]", "- *undefined", "%YAML 9.9\n---\n- cse",
    "---\n- cse\n---\n- dce", "- [" * 3000, "- " + "[" * 3000 + "]" * 3000, "\t- cse",
    "a: &a [1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
    "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\n"
    "pipeline: [{lora: {rank: 2, targets: *e}}]\n",
    "x: &x [1]\ny: &y [*x, *x, *x, *x, *x, *x, *x, *x, *x, *x]\nz: &z [*y, *y, *y, *y, *y, *y, *y, *y]\n"
    "w: &w [*z, *z, *z, *z, *z, *z, *z, *z, *z, *z]\n"
    "pipeline: [{lora-import: {path: x, prefix_map: {a: *w}}}, {split: {tp: *w}}]\n",
]


def pipeline_yamls() -> st.SearchStrategy[str]:
    docs = st.builds(_yaml_document, pipeline_items(), st.sampled_from(["list", "key"]))
    pool = st.one_of(pipeline_pool(), st.sampled_from(YAML_SPECIALS), st.sampled_from(
        ["- ", ": ", "&a ", "*a", "!!str ", "!!int ", "? ", "|", ">", "'", "#", "\n", "  "]))
    return st.one_of(docs, mutated_text(docs, pool, max_mutations=3), st.sampled_from(YAML_SPECIALS),
                     st.text(max_size=60))


def pipeline_text_property(text: str) -> None:
    """Text -> pipeline; an accepted pipeline's canonical text builds the same pipeline."""
    from ernie_ir.passes.infra.pipeline import build_pipeline
    from ernie_ir.passes.infra.pipeline_syntax import parse_pipeline_text

    p = build_pipeline(parse_pipeline_text(text))
    again = build_pipeline(parse_pipeline_text(str(p)))
    assert str(again) == str(p), f"{str(p)!r} reparses as {str(again)!r}"


def pipeline_yaml_property(text: str) -> None:
    from ernie_ir.passes.infra.pipeline import build_pipeline
    from ernie_ir.passes.infra.pipeline_syntax import parse_pipeline_text, parse_pipeline_yaml

    p = build_pipeline(parse_pipeline_yaml(text, "fuzz.yaml"))
    assert str(build_pipeline(parse_pipeline_text(str(p)))) == str(p)


# -- config.json --------------------------------------------------------------------------------

JSON_VALUES = st.one_of(
    st.sampled_from([0, 1, -1, 2, 3, 7, 64, 2**31, 2**63, 10**30, 10**400, 0.5, 1e-320, 1e308,
                     math.nan, math.inf, -math.inf, -0.0, True, False, None, "", "silu", "gelu",
                     "softmax", "default", "linear", "bf16", "float16", "x" * 1000, "\ud800", "é",
                     "a\nb", ["a\nb"], [], [1], ["Ernie4_5_ForCausalLM"], {}, {"rope_type": "yarn"},
                     {"rope_theta": 10.0}, {"rope_type": "default", "rope_theta": -1},
                     [[[[[[[[[[[[1]]]]]]]]]]]]]),
    st.integers(), st.floats(), st.text(max_size=5),
)


@functools.cache
def config_seeds() -> tuple[dict[str, Any], ...]:
    from ernie_ir.frontends.builtins import builtin_config, builtin_models

    return tuple(builtin_config(n, v) for n in builtin_models() for v in ("meta", "tiny"))


@st.composite
def config_dicts(draw: Any) -> dict[str, Any]:
    """A built-in config with a few keys set to odd values, removed or added."""
    cfg = dict(draw(st.sampled_from(config_seeds())))
    keys = [*sorted(cfg), "head_dim", "num_key_value_heads", "rope_parameters", "rope_scaling",
            "moe_layer_end_index", "hidden_activation", "architectures", "__proto__"]
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(keys))
        if draw(st.integers(0, 4)) == 0:
            cfg.pop(key, None)
        else:
            cfg[key] = draw(JSON_VALUES)
    return cfg


def _json_text(cfg: dict[str, Any]) -> str:
    return json.dumps(cfg, default=str)


def config_texts() -> st.SearchStrategy[bytes]:
    """config.json file contents: mutated dumps, deep nesting, bad encodings, noise."""
    dumped = config_dicts().map(_json_text)
    pool = st.one_of(st.sampled_from(['"', "{", "}", "[", "]", ",", ":", "NaN", "Infinity", "-Infinity",
                                      "null", "true", "1" * 5000, "[" * 100_000, "{\"a\":" * 50_000]),
                     st.sampled_from(INTERESTING_NUMBERS), st.sampled_from(STRANGE_TEXT))
    texts = st.one_of(dumped, mutated_text(dumped, pool, max_mutations=3))

    def encode(args: tuple[str, str]) -> bytes:
        text, enc = args
        if enc == "utf-8-sig":
            return text.encode("utf-8-sig", "surrogatepass")
        if enc == "utf-16":
            return text.encode("utf-16", "surrogatepass")
        return text.encode("utf-8", "surrogatepass")

    encoded = st.tuples(texts, st.sampled_from(["utf-8"] * 6 + ["utf-8-sig", "utf-16"])).map(encode)
    return st.one_of(encoded, st.binary(max_size=64),
                     st.sampled_from([b"", b"[" * 100_000, b"1" * 5000, b"\xff\xfe", b"null",
                                      b'{"architectures": "GPTForCausalLM"}']))


def config_property(data: dict[str, Any]) -> None:
    """parse -> metadata JSON -> a meta graph when the model is small enough to build quickly."""
    from ernie_ir.frontends.config import parse_config

    cfg = parse_config(data, "fuzz/config.json")
    json.dumps(cfg.to_json())
    build_meta_graph(cfg)


def build_meta_graph(cfg: Any) -> None:
    """Build the weightless graph of an accepted config if it has few layers (a big layer count
    is a bounded-resource question, tested elsewhere, not a reader crash)."""
    from ernie_ir.frontends.loader import build_graph
    from ernie_ir.frontends.params import MetaWeights

    if getattr(cfg, "num_hidden_layers", 0) > 6 or getattr(cfg, "moe_num_experts", 0) > 4096:
        return
    build_graph(cfg, MetaWeights(), name="fuzz")


def config_file_property(folder: Path, raw: bytes) -> None:
    from ernie_ir.frontends.config import read_config

    (folder / "config.json").write_bytes(raw)
    cfg = read_config(folder)
    json.dumps(cfg.to_json())
    build_meta_graph(cfg)


# -- safetensors --------------------------------------------------------------------------------


def _seed_tensors() -> list[tuple[str, np.ndarray | ArraySource]]:
    import ml_dtypes

    return [
        ("w", np.arange(6, dtype=np.float32).reshape(2, 3)),
        ("b", np.ones(4, dtype=ml_dtypes.bfloat16)),
        ("q4", np.array([1, -2, 3], dtype=ml_dtypes.int4)),
        ("q4e", np.arange(-4, 4, dtype=np.int8).astype(ml_dtypes.int4).reshape(2, 4)),
        ("empty", np.zeros((0, 3), dtype=np.uint8)),
        ("mask", np.array([True, False])),
        ("f8", np.ones(2, dtype=ml_dtypes.float8_e4m3fn)),
        ("ids", np.array([7], dtype=np.int64)),
    ]


@functools.cache
def safetensors_seed(tmp: str) -> bytes:
    path = Path(tmp) / "seed.safetensors"
    write_safetensors(path, _seed_tensors(), metadata={"format": "np"})
    return path.read_bytes()


def split_safetensors(raw: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


HEADER_VALUES = st.one_of(
    st.sampled_from([0, 1, -1, 3, 8, 2**31, 2**63, 2**64, 10**18, 10**30, 10**400, 1.0, math.nan,
                     True, None, "", "F32", "BF16", "U8", "I4", "F64", "f32", "F8_E4M3", "BOOL",
                     [], [0], [1], [2, 3], [-1], [10**18], [10**18, 10**18], [0, 10**30],
                     [10**30, 0], [2**63, 0], [1.5], [True], [[1]], ["2"], [0, 0], [0, 24], [24, 0],
                     [0, 2**64], [-8, 0], {}, {"a": 1}, "[]", '["w"]', '{"w": [6]}', '{"q4": [10**18]}',
                     '{"q4": [3, 0]}', '{"q4": [-3]}', '{"b": []}', '{"w": [true]}', "{bad json",
                     '{"q4e": [2, 4], "w": [2, 3]}', '{"empty": [0, 6]}', '{"nope": [2]}']),
    st.integers(), st.lists(st.integers(-2, 2**40), max_size=4),
)


@st.composite
def safetensors_files(draw: Any, seed: bytes) -> bytes:
    """A valid file with mutated header entries, then possibly a mutated encoding of the header,
    length prefix or data section."""
    header, data = split_safetensors(seed)
    names = [k for k in header if k != "__metadata__"]
    for _ in range(draw(st.integers(0, 4))):
        what = draw(st.sampled_from(["field", "field", "field", "drop", "add", "meta", "int4meta",
                                     "entry"]))
        name = draw(st.sampled_from(names))
        if what == "field" and isinstance(header.get(name), dict):
            header[name][draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = \
                draw(HEADER_VALUES)
        elif what == "drop":
            header.pop(draw(st.sampled_from([*names, "__metadata__"])), None)
        elif what == "add":
            entry = header.get(name)
            header[draw(st.sampled_from(["new", "w2", "", "__metadata__", "\u2028"]))] = (
                dict(entry) if isinstance(entry, dict)
                else {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]})
        elif what == "meta":
            header["__metadata__"] = draw(HEADER_VALUES)
        elif what == "int4meta":
            meta = header.get("__metadata__")
            if not isinstance(meta, dict):
                meta = header["__metadata__"] = {}
            meta["ernie_ir.int4"] = draw(HEADER_VALUES)
        else:
            header[name] = draw(HEADER_VALUES)
    raw = json.dumps(header, allow_nan=True).encode("utf-8", "surrogatepass")
    for _ in range(draw(st.integers(0, 2))):
        mode = draw(st.sampled_from(["dup", "byte", "nest", "pad", "digits"]))
        if mode == "dup" and names:  # a duplicate key: json keeps the last
            k = draw(st.sampled_from(names))
            raw = raw[:1] + json.dumps(k).encode() + b': {"dtype": "F32", "shape": [1], ' \
                b'"data_offsets": [0, 4]}, ' + raw[1:]
        elif mode == "byte" and raw:
            i = draw(st.integers(0, len(raw) - 1))
            raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + 1:]
        elif mode == "nest":
            raw = b'{"x": ' + b"[" * 50_000 + b"]" * 50_000 + b", " + raw[1:]
        elif mode == "pad":
            raw += draw(st.sampled_from([b" " * 7, b"\x00" * 8, b"\n", b"\xff"]))
        else:
            raw = raw.replace(b"[0, ", b"[" + b"9" * 5000 + b", ", 1)
    n = len(raw)
    prefix = draw(st.sampled_from(["true"] * 6 + ["zero", "short", "long", "huge", "max", "size"]))
    length = {"true": n, "zero": 0, "short": max(n - 1, 0), "long": n + 1, "huge": 10**12,
              "max": 2**64 - 1, "size": n + len(data)}[prefix]
    body = struct.pack("<Q", length) + raw + data
    cut = draw(st.sampled_from(["none"] * 6 + ["data", "header", "prefix", "extend"]))
    if cut == "data":
        body = body[: 8 + n + draw(st.integers(0, max(len(data) - 1, 0)))]
    elif cut == "header":
        body = body[: draw(st.integers(8, 8 + n))]
    elif cut == "prefix":
        body = body[: draw(st.integers(0, 7))]
    elif cut == "extend":
        body += b"\x00" * draw(st.sampled_from([1, 7, 4096]))
    return body


def safetensors_property(path: Path, raw: bytes) -> None:
    """Open, then read every tensor: each has its declared shape and a bounded size."""
    from ernie_ir.ir.weights import SafetensorsFile, content_hash

    path.write_bytes(raw)
    f = SafetensorsFile(path)
    for key in f:
        src = f.source(key)
        arr = src.read()
        assert tuple(arr.shape) == src.shape, (key, arr.shape, src.shape)
        assert arr.dtype == src.dtype.numpy, (key, arr.dtype, src.dtype)
        content_hash(arr)
    f._mmap = None  # unmap before the next example rewrites the file


def seed_graph() -> Graph:
    """A graph whose params are exactly the seed file's tensors (for load_graph)."""
    g = Graph("fuzz")
    for name, t in _seed_tensors():
        src = ArraySource(np.asarray(t))
        p = Param(name, _type_of(src))
        p.source = src
        g.add_param(p)
    return g


def _type_of(src: ArraySource) -> Any:
    from ernie_ir.ir.types import TensorType

    return TensorType(src.dtype, list(src.shape))


def graph_folder_property(folder: Path, ir_text: str, raw: bytes) -> None:
    """load_graph of graph.ir + a mutated weights.safetensors (hashes checked)."""
    from ernie_ir.ir.storage import load_graph

    (folder / "graph.ir").write_text(ir_text, encoding="utf-8")
    (folder / "weights.safetensors").write_bytes(raw)
    g = load_graph(folder)
    for p in g.params.values():
        if p.source is not None:
            p.read()


# -- CLI option strings -------------------------------------------------------------------------

MEMORY_TEXTS = st.one_of(
    st.builds(lambda n, e, u, s: f"{s}{n}{e}{u}{s}",
              st.sampled_from(["80", "0", "1", "0.5", ".5", "1.", "00", "1" * 400, "9" * 5000, "1e",
                               "-1", "+1", "nan", "inf", "1_0", "８０"]),
              st.sampled_from(["", "e3", "e-3", "e309", "E-400", "e+10", "e" + "9" * 12, "e" + "9" * 5000,
                               "e-" + "9" * 12]),
              st.sampled_from(["", "G", "GB", "GiB", "gib", "T", "P", "K", "KB", "B", "XB", "Gi", "iB",
                               " GiB", "GiBB", "E", "EiB", "\u212a"]),
              st.sampled_from(["", " ", "\t", "\n", "\u2028"])),
    st.text(max_size=12),
)

TOKEN_TEXTS = st.one_of(
    st.lists(st.sampled_from([*INTERESTING_NUMBERS, "", " ", "a", "1.0", "-5", "١", "²", "1_2"]),
             min_size=0, max_size=6).map(",".join),
    st.text(max_size=20),
)


QUANT_TEXTS = st.one_of(
    st.sampled_from(["wint8", "wint4", "wint8mix", "WINT8", " wint8 ", "none", "", "fp8", "qat-int8",
                     "wint8mix-erniekit", "int8", "w8a8", "wint8,cse", "wint8{x=1}", "O2", "\u2028"]),
    st.text(max_size=12),
)
PATTERN_TEXTS = st.one_of(
    st.sampled_from(["glob:*", "glob:[", "glob:[!]", "re:(", "re:.*qkv.*", ".*", "(" * 5000,
                     "(" * 5000 + ")" * 5000, "(a*)*b", "(?P<x>", "\\", "[z-a]", "x{99999999999}",
                     "re:(?i)QKV", "glob:" + "*" * 5000]),
    st.text(max_size=12),
)


def memory_property(text: str) -> None:
    from ernie_ir.planning.units import parse_memory

    n = parse_memory(text)
    assert isinstance(n, int) and n >= 1, n


def tokens_property(text: str) -> None:
    from ernie_ir.cli.run_cmds import _parse_tokens

    ids = _parse_tokens(text)
    assert ids.dtype == np.int64 and ids.ndim == 2 and ids.size >= 1


def quant_property(text: str) -> None:
    from ernie_ir.passes.infra.pipeline import build_pipeline
    from ernie_ir.passes.infra.pipeline_syntax import parse_pipeline_text
    from ernie_ir.passes.quant.cli_flags import quant_pipeline

    build_pipeline(parse_pipeline_text(",".join(quant_pipeline(text, None))))


def pattern_property(text: str) -> None:
    from ernie_ir.passes.quant.config import match_path

    match_path(text, "ernie.layers.0.self_attn.qkv_proj")


def _npy_seed() -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.array([[1, 2, 3]], dtype=np.int64))
    return buf.getvalue()


@st.composite
def npy_files(draw: Any) -> bytes:
    """`--tokens FILE.npy` contents: a valid [1, 3] int64 file with its header fields mutated
    (shape up to 10**9 rows, dtypes, the version), truncated or empty."""
    raw = _npy_seed()
    shape = draw(st.sampled_from(["(1, 3)", "(3,)", "(0, 3)", "()", "(1000000000, 3)", "(10**18,)",
                                  "(-1, 3)", "(1, 3, 1)", "(2, 3)", "(1, 100000000)",
                                  "(1000000000000, 1000000000000)", "(4611686018427387904, 4)"]))
    descr = draw(st.sampled_from(["'<i8'", "'<i4'", "'|u1'", "'<f4'", "'|O'", "'<U3'", "'>i8'",
                                  "'|b1'", "'V8'"]))
    (hlen,) = struct.unpack("<H", raw[8:10])
    header = raw[10:10 + hlen].decode("latin1").rstrip().replace("(1, 3)", shape).replace("'<i8'", descr)
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    version = draw(st.sampled_from([b"\x01\x00"] * 5 + [b"\x02\x00", b"\x09\x00"]))
    body = raw[:6] + version + struct.pack("<H", len(header)) + header.encode("latin1")
    if version == b"\x02\x00":  # version 2 has a 4-byte header length
        body = raw[:6] + version + struct.pack("<I", len(header) - 2) + header[:-3].encode("latin1") + b" \n"
    out = body + raw[10 + hlen:]
    cut = draw(st.sampled_from(["none"] * 4 + ["empty", "magic", "header", "data", "extend"]))
    if cut == "empty":
        return b""
    if cut == "magic":
        return out[:draw(st.integers(0, 9))]
    if cut == "header":
        return out[:draw(st.integers(10, len(body)))]
    if cut == "data":
        return out[:draw(st.integers(len(body), len(out)))]
    if cut == "extend":
        return out + b"\0" * draw(st.sampled_from([1, 8, 4096]))
    return out


def npy_tokens_property(path: Path, raw: bytes) -> None:
    from ernie_ir.cli.run_cmds import _parse_tokens

    path.write_bytes(raw)
    ids = _parse_tokens(str(path))
    assert ids.dtype == np.int64 and ids.ndim == 2 and ids.size >= 1


@st.composite
def ir_files(draw: Any) -> bytes:
    """`.ir` file contents: mutated graphs encoded as UTF-8 (with a BOM, or UTF-16), with a few
    bytes flipped, or noise."""
    text = draw(ir_texts())
    raw = text.encode(draw(st.sampled_from(["utf-8"] * 6 + ["utf-8-sig", "utf-16"])), "surrogatepass")
    for _ in range(draw(st.integers(0, 2))):
        if raw:
            i = draw(st.integers(0, len(raw) - 1))
            raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + 1:]
    return raw


def ir_file_property(path: Path, raw: bytes) -> None:
    """What `ernie-ir show FILE.ir` does before printing: read, decode, parse."""
    from ernie_ir.load import load_input

    path.write_bytes(raw)
    load_input(str(path))


# -- quant configs (--quant-config FILE.yaml) ------------------------------------------------------


@functools.cache
def quant_config_seeds() -> tuple[dict[str, Any], ...]:
    from ernie_ir.passes.quant.config import QuantConfig

    ours = [QuantConfig.preset(n).to_dict() for n in ("wint8", "wint4", "wint8mix", "qat-int8", "fp8")]
    return (*ours, {"preset": "wint8mix", "rules": [{"match": ".*o_proj", "algo": "none"}]},
            {"compute_type": "wint8"}, {"quantization": "mix_quant", "dense_quant_type": "wint8",
                                        "moe_quant_type": "wint4"},
            {"Quantization": {"enable": True, "weight_quantize_type": "abs_max",
                              "activation_quantize_type": "moving_average_abs_max", "weight_bits": 8,
                              "activation_bits": 8}})


@st.composite
def quant_config_dicts(draw: Any) -> dict[str, Any]:
    """A quant config of every accepted form with a few keys (top level or in a rule) mutated."""
    cfg = json.loads(json.dumps(draw(st.sampled_from(quant_config_seeds()))))
    for _ in range(draw(st.integers(1, 3))):
        target = cfg
        rules = cfg.get("rules")
        if isinstance(rules, list) and rules and isinstance(rules[0], dict) and draw(st.booleans()):
            target = rules[draw(st.integers(0, len(rules) - 1))]
        keys = [*target, "rules", "ignore", "skip_tensor_map", "name", "match", "algo", "bits",
                "group_size", "preset", "compute_type", "moe_quant_type"]
        key = draw(st.sampled_from(keys))
        if draw(st.integers(0, 4)) == 0:
            target.pop(key, None)
        else:
            target[key] = draw(st.one_of(JSON_VALUES, OPTION_VALUES,
                                         st.sampled_from(["(", "glob:[", "re:x{99999999999}", "(" * 3000])))
    return cfg


def quant_config_texts() -> st.SearchStrategy[str]:
    docs = quant_config_dicts().map(lambda d: yaml.safe_dump(d, allow_unicode=True))
    pool = st.one_of(pipeline_pool(), st.sampled_from(YAML_SPECIALS))
    return st.one_of(docs, mutated_text(docs, pool, max_mutations=2), st.sampled_from(YAML_SPECIALS))


def quant_config_property(path: Path, text: str) -> None:
    """`--quant-config FILE.yaml`: read, then its rules decide on real parameter paths."""
    from ernie_ir.passes.quant.config import QuantConfig, match_path

    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    cfg = QuantConfig.from_yaml(path)
    for rule in cfg.rules:
        match_path(rule.match, "ernie.layers.0.self_attn.qkv_proj")
