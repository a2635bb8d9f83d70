"""The op registry in process: entry-point forms, failures undone, lazy loading, pattern arity."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import ernie_ir
from ernie_ir.ir import GraphBuilder, Input, OpDef, OpError, TensorType, f32, get_op, register_op, tensor
from ernie_ir.ir import registry as registry_module
from ernie_ir.ir.registry import REGISTRY, OpRegistry, op_origin
from ernie_ir.passes import RewriteRule, RuleSet

ROOT = Path(ernie_ir.__file__).resolve().parents[1]


class FakeEntryPoint:
    def __init__(self, name: str, value: str, obj: object) -> None:
        self.name, self.value, self.obj = name, value, obj

    def load(self) -> object:
        if isinstance(self.obj, Exception):
            raise self.obj
        return self.obj


class _Same(OpDef):
    """y = x"""

    inputs = (Input("x"),)

    def infer(self, types: Sequence[TensorType | None], attrs: object) -> list[TensorType]:
        assert types[0] is not None
        return [types[0]]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: object) -> list[np.ndarray]:
        assert args[0] is not None
        return [args[0]]


class Relu6(_Same):
    name = "t_relu6"


class Clash(_Same):
    name = "t_builtin"


class Builtin(_Same):
    name = "t_builtin"


def plugin_module(*extra: type[OpDef]) -> ModuleType:
    mod = ModuleType("t_op_plugin")

    class First(_Same):
        name = "t_first"

    class Second(_Same):
        name = "t_second"

    for cls in (First, Second, *extra):
        cls.__module__ = mod.__name__
        setattr(mod, cls.__name__, cls)
    mod.Imported = Relu6  # type: ignore[attr-defined]  (imported, not defined there: not registered)
    mod.Base = _Same  # type: ignore[attr-defined]  (no name: not an op)
    return mod


def fresh(monkeypatch: pytest.MonkeyPatch, eps: list[FakeEntryPoint]) -> OpRegistry:
    registry = OpRegistry()
    registry.add_loader(lambda: registry.add(Builtin, "built-in"))
    monkeypatch.setattr(registry_module, "entry_points", lambda group: eps)
    return registry


def test_entry_points_may_name_an_op_class_a_module_or_a_function(monkeypatch: pytest.MonkeyPatch):
    registry = fresh(monkeypatch, [
        FakeEntryPoint("cls", "pkg:Relu6", Relu6),
        FakeEntryPoint("mod", "pkg.ops", plugin_module()),
        FakeEntryPoint("fn", "pkg:register", lambda reg: reg.add(type("Fn", (_Same,), {"name": "t_fn"}))),
    ])
    assert registry.ops == {}  # nothing loads before the first lookup
    assert isinstance(registry.get("t_relu6"), Relu6)
    assert registry.broken == []
    assert sorted(registry.ops) == ["t_builtin", "t_first", "t_fn", "t_relu6", "t_second"]
    assert registry.origins["t_builtin"] == "built-in"
    assert registry.origins["t_relu6"] == "plugin cls (pkg:Relu6)"
    assert registry.origins["t_first"] == "plugin mod (pkg.ops)"
    assert registry.origins["t_fn"] == "plugin fn (pkg:register)"
    registry.ensure_loaded()  # loads once
    assert len(registry.ops) == 5


def test_a_failing_plugin_is_recorded_undone_and_named_by_lookups(monkeypatch: pytest.MonkeyPatch):
    registry = fresh(monkeypatch, [
        FakeEntryPoint("ok", "pkg:Relu6", Relu6),
        # registers t_first and t_second, then clashes with a built-in: all three undone
        FakeEntryPoint("clash", "other.ops", plugin_module(Clash)),
        FakeEntryPoint("gone", "gone:Op", ModuleNotFoundError("No module named 'gone'")),
        FakeEntryPoint("odd", "pkg:VALUE", 42),
    ])
    assert isinstance(registry.get("t_builtin"), Builtin)  # the built-in op set is whole
    assert sorted(registry.ops) == ["t_builtin", "t_relu6"]
    assert [(b.name, b.error) for b in registry.broken] == [
        ("clash", "OpError: op name 't_builtin' is registered twice (built-in, Builtin, and plugin clash "
                  "(other.ops), Clash)"),
        ("gone", "ModuleNotFoundError: No module named 'gone'"),
        ("odd", "TypeError: entry point gives int, not an OpDef, module or function"),
    ]
    with pytest.raises(OpError) as e:
        registry.get("t_first")
    assert str(e.value).startswith(
        "unknown op 't_first'; op plugin 'clash' (other.ops) failed to load: OpError: op name ")
    assert "; op plugin 'gone' (gone:Op) failed to load: ModuleNotFoundError: " in str(e.value)


@pytest.mark.slow
def test_import_ernie_ir_and_version_load_no_op_module():
    code = ("import sys\nfrom ernie_ir.cli.app import main\ntry:\n    main(['--version'])\n"
            "except SystemExit:\n    pass\n"
            "before = sorted(m for m in sys.modules if m.startswith('ernie_ir.ops.'))\n"
            "from ernie_ir.ir import all_ops, get_op\nget_op('silu')\n"
            "after = sorted(m for m in sys.modules if m.startswith('ernie_ir.ops.'))\n"
            "print(before, len(after) > 20, len(all_ops()) > 30)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "[] True True"
    assert run.stdout.startswith("ernie-ir ")


def test_ernie_ir_ops_submodules_stay_reachable_as_attributes():
    import ernie_ir.ops

    assert ernie_ir.ops.activations.Silu.name == "silu"
    with pytest.raises(AttributeError):
        ernie_ir.ops.no_such_module  # noqa: B018


# -- an op's pattern arity and its own lowerings -----------------------------------------------------


class TopTwo(OpDef):
    """(hi, lo) = (max(a, b), min(a, b)) elementwise"""

    name = "t_top_two"
    inputs = (Input("a"), Input("b"))
    num_outputs = 2

    def infer(self, types: Sequence[TensorType | None], attrs: object) -> list[TensorType]:
        assert types[0] is not None
        return [types[0], types[0]]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: object) -> list[np.ndarray]:
        return [np.maximum(args[0], args[1]), np.minimum(args[0], args[1])]


@pytest.fixture
def top_two() -> Iterator[None]:
    register_op(TopTwo)
    try:
        yield
    finally:
        REGISTRY.remove(TopTwo.name)


class SumOfTopTwo(RewriteRule):
    """hi + lo -> a + b   (the pattern binds both results of one two-result op, no `_outputs=`)"""

    name = "t-sum-of-top-two"

    def pattern(self, op, a, b):
        hi, lo = op.t_top_two(a, b)
        return op.add(hi, lo)

    def rewrite(self, op, a, b):
        return op.add(a, b)


def test_num_outputs_gives_a_pattern_its_results(top_two: None):
    b = GraphBuilder("g")
    x, y = b.input("x", tensor(f32, 4)), b.input("y", tensor(f32, 4))
    hi, lo = b.t_top_two(x, y)
    b.output(b.add(hi, lo), name="z")
    assert op_origin("t_top_two") == f"module {__name__}"
    assert RuleSet([SumOfTopTwo()]).apply(b.graph) == 1
    assert [n.op for n in b.graph] == ["add"]
    assert get_op("moe_gate").num_outputs == 2  # a built-in with two results


def test_an_op_carries_its_own_lowerings():
    silu = get_op("silu")
    assert silu.lowering("onnx") is not None and silu.lowering("paddle") is not None
    assert get_op("linear").lowering("onnx") is None  # the emitter's table lowers it
    assert get_op("fp8_linear").lacks("onnx") == "opset 21 MatMul takes no float8 inputs; Paddle runs it"
    assert get_op("linear").lacks("paddle") is None
    with pytest.raises(ValueError, match="unknown lowering kind 'tvm'"):
        silu.lowering("tvm")


def test_an_op_name_must_be_an_identifier():
    registry = OpRegistry()
    with pytest.raises(OpError, match=r"^op name 'my-op' is not an identifier \(IR text and GraphBuilder"):
        registry.add(type("Dashed", (_Same,), {"name": "my-op"}))
    assert registry.ops == {}
