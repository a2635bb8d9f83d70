"""Fuzz op attributes with values of every other type: each is validated or refused in one line.

An op's attribute schema must type-check a value before any validator compares it, for every
op, and no float attribute may be inf or nan (issue 24: `group_size = bf16` ended in a
TypeError from `v <= 0`; `eps = 1e309` overflowed to inf and ran). Values are swapped in two
places: in printed graphs (what `ernie-ir show FILE.ir` parses) and straight into `make_attrs`
(every op of the registry, also those no seed graph uses).
"""

from __future__ import annotations

import math

import pytest
from _fuzz_strategies import (
    ATTR_VALUES,
    SMALL_IR,
    check_total,
    fuzz_settings,
    ir_attr_swaps,
    make_attrs_property,
    parse_ir_property,
    swapped_attrs,
)
from hypothesis import example, given

from ernie_ir.ir import DType, IRParseError, get_op
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.registry import all_ops

WOL = """graph @g(%x: f32[2,4]) -> (y: f32[2,8]) {
  param @w : i8[4,8]
  param @s : f32[8]
  %0 = weight_only_linear(%x, @w, @s) {group_size = -1} : f32[2,8]
  return %0
}
"""
DTYPE_GROUP_SIZE = WOL.replace("group_size = -1", "group_size = bf16")
OVERFLOWING_EPS = SMALL_IR.replace("%1 = softmax(%0) {axis = -1}", "%1 = rms_norm(%0, @w) {eps = 1e309}")


@pytest.mark.slow
@fuzz_settings(200)
@given(ir_attr_swaps())
@example(DTYPE_GROUP_SIZE)
@example(OVERFLOWING_EPS)
def test_swapped_attribute_values_in_ir_text_are_total(text: str) -> None:
    check_total(parse_ir_property, text)


@pytest.mark.slow
@fuzz_settings(600)
@given(swapped_attrs())
@example(("weight_only_linear", {"group_size": DType.BF16}))
@example(("weight_only_linear", {"group_size": [DType.I8]}))
@example(("packed_weight", {"arch": DType.BF16}))
@example(("rms_norm", {"eps": math.inf}))
@example(("fake_quant", {"round_type": True}))
def test_swapped_attribute_values_are_typed_or_refused(case: tuple[str, dict]) -> None:
    op, values = case
    check_total(make_attrs_property, op, values)


@pytest.mark.parametrize("op", sorted(n for n, o in all_ops().items() if o.Attrs.model_fields))
def test_every_attribute_of_every_op_refuses_every_other_kind_in_one_line(op: str) -> None:
    """The exhaustive version of the property: each field of each op times each kind of value."""
    opdef = get_op(op)
    for key in opdef.Attrs.model_fields:
        for value in ATTR_VALUES:
            check_total(make_attrs_property, op, {key: value})


@pytest.mark.parametrize(("text", "line", "words"), [
    (DTYPE_GROUP_SIZE, 4, "attribute group_size: expected int, got the dtype bf16"),
    (OVERFLOWING_EPS, 6, "attribute eps: inf is not a finite number"),
    (WOL.replace("group_size = -1", "group_size = true"), 4, "attribute group_size: expected int, got true"),
])
def test_regressions_are_refused_at_their_line(text: str, line: int, words: str) -> None:
    for fast in (True, False):
        with pytest.raises(IRParseError, match=words) as info:
            parse_graph(text, fast=fast)
        assert info.value.line == line
