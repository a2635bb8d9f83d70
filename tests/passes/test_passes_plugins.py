"""Third-party passes through the `ernie_ir.passes` entry-point group.

Two tiny packages are built and installed with pip into folders of their own
during the test: a working plugin (a Pass class and a function that adds a
preset) and a broken one (its module raises ImportError). `ernie-ir` then runs
in a subprocess with those folders on PYTHONPATH, as it would for a user who
pip-installed them.

The packages are built by `ernie_ir.testing.plugins.install_plugin` (a
stdlib-only PEP 517 backend, so neither the network nor a wheel-capable
setuptools is needed; the entry points are declared in `pyproject.toml`
exactly as a real package declares them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from _passes_testkit import ERNIE_IR, one_error_line, run_tool

from ernie_ir.passes import Pass, PassContext, PipelineError
from ernie_ir.passes.infra import registry as registry_module
from ernie_ir.passes.infra.registry import PassRegistry
from ernie_ir.testing.plugins import install_plugin

GOOD_MODULE = '''\
"""A third-party pass: renames the graph."""
from ernie_ir.passes import Pass, PassOptions


class RenameOptions(PassOptions):
    name: str = "plugged"


class RenameGraph(Pass):
    name = "rename-graph"
    description = "Rename the graph (a plugin pass)."
    Options = RenameOptions

    def run(self, graph, ctx):
        if graph.name == self.options.name:
            return False
        graph.name = self.options.name
        return True


def register(registry):
    registry.add_preset("plugin-cleanup", "canonicalize,rename-graph{name=cleaned}",
                        "A preset from a plugin.")
'''

BROKEN_MODULE = '''\
raise ImportError("this plugin needs torch_npu")
'''

MODEL = """\
graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {
  %0 = reshape(%x) {shape = [0, 2, 2]} : f32[B,2,2]
  %1 = reshape(%0) {shape = [0, 4]} : f32[B,4]
  %2 = silu(%1) : f32[B,4]
  return %2
}
"""


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plugins")
    (root / "model.ir").write_text(MODEL)
    good = install_plugin(root, "ernie-ir-testplugin", {"ernie_ir_testplugin": GOOD_MODULE},
                          {"ernie_ir.passes": {"rename-graph": "ernie_ir_testplugin:RenameGraph",
                                               "presets": "ernie_ir_testplugin:register"}})
    broken = install_plugin(root, "ernie-ir-brokenplugin", {"ernie_ir_brokenplugin": BROKEN_MODULE},
                            {"ernie_ir.passes": {"broken": "ernie_ir_brokenplugin:BrokenPass"}})
    return {"root": root, "good": good, "broken": broken}


def ernie_ir(sites: dict[str, Path], *argv: str, plugins: tuple[str, ...]):
    # The checkout under test stays importable (a worktree on PYTHONPATH, not the venv's copy).
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = os.pathsep.join([*(str(sites[p]) for p in plugins), *inherited])
    return run_tool(ERNIE_IR, *argv, env={"PYTHONPATH": path}, cwd=sites["root"])


@pytest.mark.slow
def test_pip_installed_the_plugins_as_distributions(sites: dict[str, Path]):
    info = sites["good"] / "ernie_ir_testplugin-0.0.1.dist-info" / "entry_points.txt"
    assert info.read_text() == ('[ernie_ir.passes]\nrename-graph = ernie_ir_testplugin:RenameGraph\n'
                                'presets = ernie_ir_testplugin:register\n')


@pytest.mark.slow
def test_a_plugin_pass_is_listed_with_its_description_options_and_origin(sites: dict[str, Path]):
    run = ernie_ir(sites, "passes", plugins=("good",))
    assert (run.returncode, run.stderr) == (0, "")
    lines = run.stdout.splitlines()
    i = lines.index("rename-graph{name=plugged}")  # the pass with its options' defaults
    assert lines[i + 1] == "    Rename the graph (a plugin pass)."
    assert "    origin: plugin rename-graph (ernie_ir_testplugin:RenameGraph)" in lines[i + 2:i + 4]
    assert "plugin-cleanup = canonicalize,rename-graph{name=cleaned}" in lines
    for builtin in ("dce", "cse", "canonicalize", "fuse-linear-bias", "O1 = canonicalize,cse,dce"):
        assert builtin in lines


@pytest.mark.slow
def test_a_plugin_pass_and_preset_run_in_pipelines(sites: dict[str, Path]):
    run = ernie_ir(sites, "show", "model.ir", "--pipeline", "plugin-cleanup,dce", plugins=("good",))
    assert (run.returncode, run.stderr) == (0, "")
    assert run.stdout == ("graph @cleaned(%x: f32[B,4]) -> (y: f32[B,4]) {\n"
                          "  %0 = silu(%x) : f32[B,4]\n"
                          "  return %0\n"
                          "}\n")


@pytest.mark.slow
def test_a_broken_plugin_never_breaks_the_built_in_passes(sites: dict[str, Path]):
    run = ernie_ir(sites, "show", "model.ir", "--pipeline", "dce,rename-graph",
                   plugins=("good", "broken"))
    assert (run.returncode, run.stderr) == (0, "")
    assert run.stdout.startswith("graph @plugged(")


@pytest.mark.slow
def test_ernie_ir_passes_lists_what_loaded_and_names_the_broken_plugin(sites: dict[str, Path]):
    run = ernie_ir(sites, "passes", plugins=("good", "broken"))
    assert run.returncode == 2
    for listed in ("dce", "cse", "canonicalize", "rename-graph{name=plugged}"):
        assert listed in run.stdout.splitlines()
    assert one_error_line(run.stderr) == (
        "error: plugin 'broken' (ernie_ir_brokenplugin:BrokenPass) failed to load: "
        "ImportError: this plugin needs torch_npu")


@pytest.mark.slow
def test_asking_for_an_unknown_pass_mentions_the_broken_plugin(sites: dict[str, Path]):
    run = ernie_ir(sites, "show", "model.ir", "--pipeline", "dce,brokenpass",
                   plugins=("good", "broken"))
    assert run.returncode == 2 and run.stdout == ""
    assert one_error_line(run.stderr) == (
        "error: position 2: unknown pass 'brokenpass'; `ernie-ir passes` lists them; plugin "
        "'broken' (ernie_ir_brokenplugin:BrokenPass) failed to load: ImportError: this plugin "
        "needs torch_npu")


# -- the registry's plugin loading, in process ----------------------------------------------------


class FakeEntryPoint:
    def __init__(self, name: str, value: str, obj: object) -> None:
        self.name, self.value, self.obj = name, value, obj

    def load(self) -> object:
        if isinstance(self.obj, Exception):
            raise self.obj
        return self.obj


class PluginPass(Pass):
    name = "t-plugin-pass"
    description = "A plugin pass."

    def run(self, graph, ctx: PassContext) -> bool:
        return False


class ClashingPass(PluginPass):
    name = "t-plugin-pass"


def plugin_module() -> ModuleType:
    mod = ModuleType("t_plugin_module")

    class First(PluginPass):
        name = "t-first"

    class Second(PluginPass):
        name = "t-second"

    for cls in (First, Second):
        cls.__module__ = mod.__name__
    mod.First, mod.Second, mod.Imported = First, Second, PluginPass  # type: ignore[attr-defined]
    return mod


def test_entry_points_may_name_a_class_a_module_or_a_function(monkeypatch: pytest.MonkeyPatch):
    registry = PassRegistry()
    eps = [
        FakeEntryPoint("cls", "pkg:PluginPass", PluginPass),
        FakeEntryPoint("mod", "pkg.passes", plugin_module()),
        FakeEntryPoint("fn", "pkg:register", lambda reg: reg.add_preset("t-p", "t-first", "p")),
    ]
    monkeypatch.setattr(registry_module, "entry_points", lambda group: eps)
    registry.load_plugins()
    assert registry.broken == []
    # A module registers the passes it defines, not the ones it imports.
    assert sorted(registry.passes) == ["t-first", "t-plugin-pass", "t-second"]
    assert registry.origins["t-first"] == "plugin mod (pkg.passes)"
    assert registry.presets["t-p"].pipeline == "t-first"
    registry.load_plugins()  # loads once
    assert len(registry.passes) == 3


def test_plugin_failures_are_recorded_with_their_reason(monkeypatch: pytest.MonkeyPatch):
    registry = PassRegistry()
    eps = [
        FakeEntryPoint("ok", "pkg:PluginPass", PluginPass),
        FakeEntryPoint("clash", "other:ClashingPass", ClashingPass),
        FakeEntryPoint("gone", "gone:Pass", ModuleNotFoundError("No module named 'gone'")),
        FakeEntryPoint("odd", "pkg:VALUE", 42),
    ]
    monkeypatch.setattr(registry_module, "entry_points", lambda group: eps)
    registry.load_plugins()
    assert list(registry.passes) == ["t-plugin-pass"]
    assert [(b.name, b.error) for b in registry.broken] == [
        ("clash", "PipelineError: pass name 't-plugin-pass' is registered twice (plugin ok "
                  "(pkg:PluginPass) and plugin clash (other:ClashingPass))"),
        ("gone", "ModuleNotFoundError: No module named 'gone'"),
        ("odd", "TypeError: entry point gives int, not a Pass, module or function"),
    ]
    with pytest.raises(PipelineError) as e:
        registry.get("t-plugin-pas")
    assert str(e.value).startswith("unknown pass 't-plugin-pas' (did you mean t-plugin-pass?); "
                                   "`ernie-ir passes` lists them; plugin 'clash' (other:ClashingPass) "
                                   "failed to load: PipelineError: ")



def test_the_built_in_loader_runs_once_on_the_first_lookup_before_the_plugins(
        monkeypatch: pytest.MonkeyPatch):
    registry = PassRegistry()
    calls = []

    def built_ins() -> None:
        calls.append("built-in")
        registry.add(PluginPass)

    registry.add_loader(built_ins)
    monkeypatch.setattr(registry_module, "entry_points",
                        lambda group: [FakeEntryPoint("clash", "other:ClashingPass", ClashingPass)])
    assert calls == []  # adding a loader runs nothing
    assert registry.get("t-plugin-pass") is PluginPass
    registry.ensure_loaded()
    assert calls == ["built-in"]
    assert registry.origins["t-plugin-pass"] == "built-in"
    assert [b.name for b in registry.broken] == ["clash"]  # a plugin cannot take a built-in's name
    registry.add_loader(lambda: calls.append("late"))  # after the first lookup: runs at once
    assert calls == ["built-in", "late"]


@pytest.mark.slow
def test_importing_ernie_ir_passes_imports_no_pass_until_a_lookup():
    probe = ("import sys, ernie_ir.passes as p\n"
             "def passes(): return sorted(m for m in sys.modules if m.startswith('ernie_ir.passes.')\n"
             "                            and not m.startswith('ernie_ir.passes.infra'))\n"
             "print(passes()); p.get_pass('dce'); print(len(passes()))\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          timeout=120)
    before, after = proc.stdout.splitlines()
    assert before == "[]"
    assert int(after) >= 20  # builtin, the family packages and their modules
