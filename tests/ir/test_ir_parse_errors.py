"""Malformed IR text: every error is an IRParseError at the exact line and column.

Each case edits one line of a valid graph. Both parser paths (the fast
regular-expression path for node lines and the general tokenizer) must
report the same position and message.
"""

from __future__ import annotations

import pytest

import ernie_ir  # noqa: F401  (registers the op set)
from ernie_ir.ir import IRParseError
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.verifier import verify_problems

VALID = """\
graph @g(%x: f32[B,4], %xa: f32[B,4]) -> (y: f32[B,4]) {
  meta {model = "m"}
  param @w : f32[4,4] {bits = 8} trainable
  %0 = linear(%x, @w) : f32[B,4] loc("proj")
  %1 = softmax(%0) {axis = -1} : f32[B,4] loc("act")
  %2 = add(%xa, %1) : f32[B,4]
  return %2
}
"""
LINES = VALID.split("\n")


def edit(lineno: int, new: str | None) -> str:
    """VALID with line `lineno` (1-based) replaced, or removed when `new` is None."""
    lines = list(LINES)
    if new is None:
        del lines[lineno - 1]
    else:
        lines[lineno - 1] = new
    return "\n".join(lines)


# (id, text, line, column, message fragment)
CASES = [
    ("missing closing brace", edit(8, None), 8, 1, "missing closing '}' of the graph"),
    ("unknown op with a suggestion",
     edit(5, '  %1 = sofmax(%0) {axis = -1} : f32[B,4] loc("act")'),
     5, 8, "unknown op 'sofmax' (did you mean softmax?)"),
    ("unknown attribute",
     edit(5, '  %1 = softmax(%0) {axis = -1, temp = 2} : f32[B,4] loc("act")'),
     5, 20, "op softmax: attribute temp: Extra inputs are not permitted"),
    ("bad attribute type",
     edit(5, '  %1 = softmax(%0) {axis = "last"} : f32[B,4] loc("act")'),
     5, 20, "op softmax: attribute axis: Input should be a valid integer"),
    ("missing required attribute",
     edit(5, '  %1 = rms_norm(%0, @w) : f32[B,4]'),
     5, 8, "op rms_norm: attribute eps: Field required"),
    ("dtype where an integer belongs",
     edit(5, '  %1 = softmax(%0) {axis = u8} : f32[B,4] loc("act")'),
     5, 20, "op softmax: attribute axis: expected int, got the dtype u8"),
    ("dtype inside an integer list",
     edit(5, '  %1 = reshape(%0) {shape = [0, bf16]} : f32[B,4] loc("act")'),
     5, 20, "op reshape: attribute shape.1: expected int, got the dtype bf16"),
    ("invalid escape in a scope",
     edit(4, '  %0 = linear(%x, @w) : f32[B,4] loc("pr\\qoj")'), 4, 41, "invalid string"),
    ("invalid escape in a param name",
     edit(3, '  param @"w\\x" : f32[4,4]'), 3, 12, "Invalid \\escape"),
    ("invalid escape in metadata", edit(2, '  meta {model = "\\u12"}'), 2, 19, "Invalid \\uXXXX escape"),
    ("unquoted string constant",
     edit(5, '  %1 = softmax(%0) {axis = last} : f32[B,4] loc("act")'),
     5, 28, "unknown constant 'last' (strings need quotes)"),
    ("duplicate attribute key",
     edit(5, '  %1 = softmax(%0) {axis = -1, axis = 0} : f32[B,4] loc("act")'),
     5, 32, "duplicate key 'axis'"),
    ("unknown dtype in a result type",
     edit(4, '  %0 = linear(%x, @w) : f33[B,4] loc("proj")'),
     4, 25, "unknown dtype 'f33' (expected one of: f32, f16, bf16"),
    ("unknown dtype in a param",
     edit(3, "  param @w : f64[4,4] {bits = 8} trainable"), 3, 14, "unknown dtype 'f64'"),
    ("unknown dtype in the header",
     edit(1, "graph @g(%x: q8[B,4], %xa: f32[B,4]) -> (y: f32[B,4]) {"), 1, 14, "unknown dtype 'q8'"),
    ("malformed dim",
     edit(4, '  %0 = linear(%x, @w) : f32[B,-4] loc("proj")'),
     4, 31, "expected a dim (integer or symbol), found '-4'"),
    ("undefined value",
     edit(6, "  %2 = add(%xa, %x9) : f32[B,4]"), 6, 17, "use of undefined value %x9"),
    ("use before definition",
     edit(4, '  %0 = linear(%1, @w) : f32[B,4] loc("proj")'), 4, 15, "use of undefined value %1"),
    ("undeclared param",
     edit(4, '  %0 = linear(%x, @v) : f32[B,4] loc("proj")'),
     4, 19, "use of undeclared param @v (declare it with 'param')"),
    ("undeclared quoted param",
     edit(4, '  %0 = linear(%x, @"a b") : f32[B,4] loc("proj")'),
     4, 19, "use of undeclared param @a b"),
    ("redefined value",
     edit(5, '  %0 = softmax(%0) {axis = -1} : f32[B,4] loc("act")'),
     5, 3, "%0 is defined twice (SSA: one definition per value)"),
    ("redefined graph input",
     edit(1, "graph @g(%x: f32[B,4], %x: f32[B,4]) -> (y: f32[B,4]) {"), 1, 24,
     "input %x is declared twice"),
    ("redeclared param",
     edit(3, "  param @w : f32[4,4] {bits = 8} trainable\n  param @w : f32[4,4]"), 4, 9,
     "param @w is declared twice"),
    ("result type that contradicts the type rule",
     edit(5, '  %1 = softmax(%0) {axis = -1} : f32[B,8] loc("act")'),
     5, 34, "softmax produces f32[B,4], but the text declares f32[B,8]"),
    ("result type without a space after the colon",
     edit(5, '  %1 = softmax(%0) {axis = -1} :f32[B,8] loc("act")'),
     5, 33, "softmax produces f32[B,4], but the text declares f32[B,8]"),
    ("inputs the type rule refuses",
     edit(6, "  %2 = add(%xa, @w) : f32[B,4]"), 6, 23, "add: shapes ['B', 4] and [4, 4] do not broadcast"),
    ("too many results named",
     edit(5, '  %1, %9 = softmax(%0) {axis = -1} : f32[B,4] loc("act")'),
     5, 3, "softmax has 1 results but the line names 2"),
    ("too many result types",
     edit(5, '  %1 = softmax(%0) {axis = -1} : f32[B,4], f32[B,4] loc("act")'),
     5, 34, "softmax produces f32[B,4], but the text declares f32[B,4], f32[B,4]"),
    ("too few inputs",
     edit(4, '  %0 = linear(%x) : f32[B,4] loc("proj")'),
     4, 3, "op linear takes (x, weight, bias?) but got 1 inputs"),
    ("garbage character",
     edit(4, '  %0 = linear(%x, @w) : f32[B,4] $ loc("proj")'), 4, 34, "unexpected character '$'"),
    ("garbage character in the header",
     edit(1, "graph @g(%x: f32[B,4], %xa: f32[B,4]) -> (y: f32[B,4]) { ~"), 1, 58,
     "unexpected character '~'"),
    ("unterminated scope string",
     edit(4, '  %0 = linear(%x, @w) : f32[B,4] loc("proj)'), 4, 38, "unexpected character '\"'"),
    ("text after the closing brace", VALID + "  extra\n", 9, 3, "text after the closing '}'"),
    ("unknown statement", edit(2, "  frob {model = 1}"), 2, 3,
     "expected a statement (%value = op(...), param, meta, return or '}'), found 'frob'"),
    ("return with too many values", edit(7, "  return %2, %0"), 7, 3,
     "return has 2 values but the header declares 1 outputs"),
    ("return with too few values", edit(7, "  return"), 7, 3,
     "return has 0 values but the header declares 1 outputs"),
    ("return of the wrong type",
     edit(7, "  return %2, %0").replace("(y: f32[B,4])", "(y: f32[B,4], z: f16[B,4])"),
     7, 14, "output z is declared f16[B,4] but returns f32[B,4]"),
    ("return of an undefined value", edit(7, "  return %7"), 7, 10, "use of undefined value %7"),
    ("missing return", edit(7, None), 7, 1, "missing 'return' statement"),
    ("header without 'graph'", edit(1, "grph @g(%x: f32[B,4]) -> (y: f32[B,4]) {"), 1, 1,
     "expected 'graph', found 'grph'"),
    ("header without a graph name", edit(1, "graph g(%x: f32[B,4]) -> (y: f32[B,4]) {"), 1, 7,
     "expected a graph name such as @main, found 'g'"),
    ("header without an opening brace", edit(1, "graph @g(%x: f32[B,4], %xa: f32[B,4]) -> (y: f32[B,4])"),
     1, 55, "expected '{', found end of line"),
    ("param with a stray word", edit(3, "  param @w : f32[4,4] frozen"), 3, 23,
     "unexpected 'frozen' in a param declaration"),
    ("empty input", "", 1, 1, "empty input"),
    ("only comments", "// nothing here\n\n", 1, 1, "empty input"),
]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "general"])
@pytest.mark.parametrize(("text", "line", "column", "fragment"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_text_is_reported_at_its_position(text, line, column, fragment, fast):
    with pytest.raises(IRParseError) as info:
        parse_graph(text, source="model.ir", fast=fast)
    err = info.value
    assert (err.line, err.column) == (line, column), str(err)
    assert fragment in str(err)
    assert str(err).startswith(f"model.ir:{line}:{column}: ")


def test_the_valid_text_parses():
    g = parse_graph(VALID)
    assert [n.op for n in g] == ["linear", "softmax", "add"]
    assert g.metadata == {"model": "m"}
    assert g.params["w"].annotations == {"bits": 8} and g.params["w"].trainable


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "general"])
def test_an_undefined_value_that_prefixes_an_earlier_argument_is_located_exactly(fast):
    text = (
        "graph @g(%xab: f32[4]) -> (y: f32[4]) {\n"
        "  %0 = add(%xab, %xa) : f32[4]\n"
        "  return %0\n"
        "}\n"
    )
    with pytest.raises(IRParseError) as info:
        parse_graph(text, fast=fast)
    assert (info.value.line, info.value.column) == (2, 18)


def test_return_of_the_wrong_type_names_both_types():
    text = VALID.replace("-> (y: f32[B,4])", "-> (y: f32[B,8])")
    with pytest.raises(IRParseError, match=r":7:10: output y is declared f32\[B,8\] but returns f32\[B,4\]"):
        parse_graph(text)


def test_comments_and_blank_lines_are_ignored():
    text = VALID.replace("  meta", "  // a comment\n\n  meta").replace(
        ': f32[B,4] loc("proj")', ': f32[B,4] loc("proj")  // trailing')
    g = parse_graph(text)
    assert len(g) == 3 and g.nodes[0].scope == "proj"


def test_without_type_checking_a_contradicted_type_is_left_to_the_verifier():
    text = edit(5, '  %1 = softmax(%0) {axis = -1} : f32[B,8] loc("act")')
    text = text.replace("add(%xa, %1) : f32[B,4]", "add(%xa, %xa) : f32[B,4]")
    g = parse_graph(text, check_types=False)
    assert g.nodes[1].output.type.shape == ("B", 8)
    assert verify_problems(g) == [
        "node #1 softmax at act: outputs are typed f32[B,8] but the op produces f32[B,4]"
    ]
