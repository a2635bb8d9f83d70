"""Imports flow one way (DESIGN.md §1; the table is docs/architecture.md).

Every `import` and `from ... import` in ernie_ir/ — at the top of a module, inside a
function, under `if TYPE_CHECKING:` — and every `importlib.import_module("literal")` must
go from a layer to one that `LAYERS` lets it import. The same imports, taken module to module,
must have no circle: no module reaches itself through the modules it imports. The modules are
read with `ast`; nothing of ernie_ir is imported or executed here.
"""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ernie_ir"
DOC = ROOT / "docs" / "architecture.md"

# Layer (a top-level module or subpackage of ernie_ir) -> the layers it may import. A layer
# always imports itself. Transitively closed on purpose: a layer lists what it may use directly.
LAYERS: dict[str, frozenset[str]] = {
    # types, graph, op registry, text format, verifier, graph folders, the quantization spec
    # (QuantConfig as plain data)
    "ir": frozenset(),
    "ops": frozenset({"ir"}),
    # the artifact format (manifest schema, reading, verifying, writing): lands from another
    # branch as ernie_ir/artifacts/; it reads graphs, so it sits on ir alone
    "artifacts": frozenset({"ir"}),
    "passes": frozenset({"ir", "ops"}),
    "frontends": frozenset({"ir", "ops"}),
    # reference execution: the interpreter, SPMD over rank graphs, the backend-free decoding loop
    "runtime": frozenset({"ir", "ops", "artifacts"}),
    # other tools' file formats, each read and written in one module (onnxruntime-genai's config,
    # FastDeploy's checkpoint, paddleformers' adapter folder)
    "formats": frozenset({"ir", "ops", "artifacts", "passes"}),
    # each executable kind's lowering, writing and running (interpreter, onnx, paddle; fastdeploy
    # only writes), opened through one `open_backend`; target facts reach them as data, never as a
    # target import
    "backends": frozenset({"ir", "ops", "artifacts", "passes", "runtime", "formats"}),
    # training: options, loop, checkpoints, data/vocabulary parallelism, its launcher and rank worker
    "training": frozenset({"ir", "ops", "artifacts", "passes", "runtime", "formats", "backends"}),
    # resolves a MODEL argument (IR file, graph folder, artifact, checkpoint, built-in name)
    "load": frozenset({"ir", "ops", "artifacts", "frontends"}),
    # hardware (capabilities, legalization, packing) and the compile driver, which writes each
    # executable with its backend (training's recipe for a training artifact)
    "targets": frozenset({"ir", "ops", "artifacts", "passes", "runtime", "load", "formats", "backends",
                          "training"}),
    # plans memory from the rank graphs compile would write
    "planning": frozenset({"ir", "ops", "artifacts", "passes", "frontends", "runtime", "formats", "backends",
                           "training", "load", "targets"}),
    # the golden harness, the pytest plugin, tiny models for tests
    "testing": frozenset({"ir", "ops", "artifacts", "passes", "frontends", "runtime", "formats", "backends",
                          "training", "load", "targets"}),
    # text generation: the kv-cache pass's decoder run by runtime, with the frontends' tokenizers
    "generation": frozenset({"ir", "ops", "artifacts", "passes", "frontends", "runtime", "formats",
                             "backends", "load", "targets"}),
    # perplexity and KL over a corpus: models run as generation's decoders (an empty past)
    "evaluation": frozenset({"ir", "ops", "artifacts", "passes", "frontends", "runtime", "formats",
                             "backends", "load", "targets", "generation"}),
    # fine-tuning data and files: SFT text tokenized with the frontends' tokenizers for runtime's
    # training loop, trained LoRA adapters written in paddleformers' format (formats')
    "finetune": frozenset({"ir", "ops", "artifacts", "passes", "frontends", "runtime", "formats", "backends",
                           "training", "load"}),
    "cli": frozenset({"ir", "ops", "artifacts", "passes", "frontends", "runtime", "formats", "backends",
                      "training", "load", "targets", "planning", "testing", "generation", "evaluation",
                      "finetune"}),
}

# Modules kept at an old path after a move so that code written against the docs keeps importing:
# each imports its new home and nothing else, and defines nothing of its own (checked below).
MOVED = {"ernie_ir.runtime.onnx_backend": "ernie_ir.backends.onnx.session"}

# The package itself (ernie_ir/__init__.py): it registers the op set once the IR core is
# imported, and offers `__version__`, the one name any layer may take from it.
ROOT_IMPORTS = frozenset({"ir", "ops"})
ROOT_EXPORTS = frozenset({"__version__"})

@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported module, dotted (a name imported from a package resolves to its module)
    names: tuple[str, ...]  # for `from package import a, b`: the names that are not modules
    where: str  # path:line

    def layers(self) -> tuple[str, str]:
        return layer_of(self.source), layer_of(self.target)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""  # "" = the package itself


def module_name(path: Path, package: Path) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(dotted: str, package: Path) -> bool:
    base = package.parent.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _literal_import_module(node: ast.Call) -> str | None:
    """The module of `importlib.import_module("x")` / `import_module("x")` / `__import__("x")`."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def imports_of(path: Path, package: Path) -> list[Edge]:
    """Every import of ernie_ir modules in one file, wherever it sits in the file."""
    source = module_name(path, package)
    here = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
    top = package.name
    edges: list[Edge] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        where = f"{path.relative_to(package.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            edges += [Edge(source, a.name, (), where) for a in node.names
                      if a.name == top or a.name.startswith(top + ".")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module != top and not module.startswith(top + "."):
                continue
            plain = []
            for a in node.names:
                sub = f"{module}.{a.name}"
                if is_module(sub, package):
                    edges.append(Edge(source, sub, (), where))
                else:
                    plain.append(a.name)
            if plain:
                edges.append(Edge(source, module, tuple(plain), where))
        elif isinstance(node, ast.Call):
            module = _literal_import_module(node)
            if module and (module == top or module.startswith(top + ".")):
                edges.append(Edge(source, module, (), where))
    return edges


def all_imports(package: Path) -> list[Edge]:
    return [e for path in sorted(package.rglob("*.py")) for e in imports_of(path, package)]


def violation(edge: Edge, layers: dict[str, frozenset[str]]) -> str | None:
    """Why `edge` goes against the layer order, or None when it does not."""
    src, dst = edge.layers()
    if src == dst:
        return None
    if src == "":
        return None if dst in ROOT_IMPORTS else f"the package itself may import only {sorted(ROOT_IMPORTS)}"
    if dst == "":  # a bare `import ernie_ir` binds the package, which holds nothing else
        if set(edge.names) <= ROOT_EXPORTS:
            return None
        return f"take only {sorted(ROOT_EXPORTS)} from the package itself"
    if src not in layers:
        return f"{src!r} has no layer in LAYERS: give it one (and a row in docs/architecture.md)"
    if dst not in layers[src]:
        allowed = ", ".join(sorted(layers[src])) or "nothing of ours"
        return f"{src} may import {allowed}; not {dst}"
    return None


def violations(edges: list[Edge], layers: dict[str, frozenset[str]],
               pending: frozenset[tuple[str, str]] = frozenset()) -> list[str]:
    out = []
    for e in edges:
        why = violation(e, layers)
        if why is not None and (e.source, e.target) not in pending:
            out.append(f"{e.where}: {e.source} imports {e.target}: {why}")
    return out


def import_cycles(edges: list[Edge]) -> list[str]:
    """Every import circle among `edges`, one line each: the modules of one strongly connected
    component (a set of modules each of which reaches every other one through imports), then
    one circle through them with the line of each import. Sorted; empty when there is none.

    An import inside a function counts as much as one at the top: the circle is in the design
    either way, and only waits for the call to close it.
    """
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for e in edges:
        if e.source != e.target:
            graph.setdefault(e.source, set()).add(e.target)
            graph.setdefault(e.target, set())
            where.setdefault((e.source, e.target), e.where)
    # Tarjan's algorithm, iteratively (an import chain may be deeper than the recursion limit).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            nxt = next(todo, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    out = []
    for component in components:
        members = set(component)
        start = component[0]
        # the shortest circle from `start` back to itself, inside the component (breadth first)
        parent: dict[str, str] = {}
        queue = [start]
        while start not in parent:
            node = queue.pop(0)
            for nxt in sorted(graph[node] & members):
                if nxt not in parent:
                    parent[nxt] = node
                    queue.append(nxt)
        circle = [start]
        while len(circle) == 1 or circle[-1] != start:
            circle.append(parent[circle[-1]])
        circle.reverse()
        steps = ", ".join(f"{a} -> {b} ({where[(a, b)]})" for a, b in itertools.pairwise(circle))
        out.append(f"import circle among {', '.join(component)}: {steps}")
    return sorted(out)


# -- the rules on ernie_ir/ -----------------------------------------------------------------------


def test_every_import_goes_down_the_layer_order() -> None:
    edges = [e for e in all_imports(PACKAGE) if MOVED.get(e.source) != e.target]
    assert violations(edges, LAYERS) == []


def test_a_moved_module_only_points_to_its_new_home() -> None:
    edges = all_imports(PACKAGE)
    for old, new in MOVED.items():
        assert {e.target for e in edges if e.source == old} == {new}
        tree = ast.parse((PACKAGE.parent / (old.replace(".", "/") + ".py")).read_text(encoding="utf-8"))
        defined = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
        assert defined == [], f"{old} defines {[n.name for n in defined]}: it only re-exports {new}"


def test_every_top_level_module_has_a_layer() -> None:
    tops = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    tops |= {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert sorted(tops - set(LAYERS)) == []


def test_nothing_imports_cli_and_only_cli_imports_testing_and_planning() -> None:
    assert all("cli" not in allowed for layer, allowed in LAYERS.items() if layer != "cli")
    assert [layer for layer, allowed in LAYERS.items() if "testing" in allowed] == ["cli"]
    assert [layer for layer, allowed in LAYERS.items() if "planning" in allowed] == ["cli"]


def test_passes_never_know_a_file_format() -> None:
    """DESIGN: passes never know a checkpoint format. They import neither `frontends` nor
    `formats`; `lora-import` reads its adapter through the reader its caller gives it."""
    assert not {"formats", "frontends"} & LAYERS["passes"]
    found = [e.where for e in all_imports(PACKAGE) if e.layers()[0] == "passes"
             and e.layers()[1] in ("formats", "frontends")]
    assert found == []


def test_the_layer_table_has_no_cycle() -> None:
    done: set[str] = set()

    def visit(layer: str, path: tuple[str, ...]) -> None:
        assert layer not in path, f"cycle: {' -> '.join((*path, layer))}"
        if layer in done:
            return
        for dep in LAYERS[layer]:
            visit(dep, (*path, layer))
        done.add(layer)

    for layer in LAYERS:
        visit(layer, ())


def test_no_package_has_an_import_circle() -> None:
    """No module of ernie_ir reaches itself through its imports, top-level or inside functions
    (no exceptions): a piece two modules share goes into a module that imports neither."""
    assert import_cycles(all_imports(PACKAGE)) == []


def test_the_documented_table_is_this_table() -> None:
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = re.fullmatch(r"\|\s*`(\w+)`\s*\|\s*(.*?)\s*\|.*\|", line.strip())
        if m:
            rows[m.group(1)] = frozenset(re.findall(r"`(\w+)`", m.group(2)))
    assert rows == LAYERS


def test_module_level_class_names_are_unique() -> None:
    """One name, one concept: two unrelated public classes named `Target` were one too many."""
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                seen.setdefault(node.name, []).append(module_name(path, PACKAGE))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}


# -- the checker itself, on a made-up package ------------------------------------------------------


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    pkg = tmp_path / "ernie_ir"
    files = {
        "__init__.py": "from . import ir\n",
        "ir/__init__.py": "from .graph import Graph\n",
        "ir/graph.py": "class Graph: ...\n",
        "passes/__init__.py": "",
        "passes/fp8.py": ("from ernie_ir.ir import Graph\nfrom ..ir import graph\n"
                          "def calibrate():\n    from ernie_ir.runtime.interpreter import Interpreter\n"),
        "passes/typed.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from ernie_ir.frontends import load_model\n"),
        "passes/dynamic.py": "import importlib\nimportlib.import_module('ernie_ir.targets')\n",
        "runtime/__init__.py": "from ernie_ir import __version__\n",
        "runtime/interpreter.py": "from ernie_ir import ops\nclass Interpreter: ...\n",
        "ops/__init__.py": "",
        "targets/__init__.py": "", "frontends/__init__.py": "",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_the_checker_finds_imports_anywhere_in_a_module(fake: Path) -> None:
    found = violations(all_imports(fake), LAYERS)
    assert found == [
        "ernie_ir/passes/dynamic.py:2: ernie_ir.passes.dynamic imports ernie_ir.targets: "
        "passes may import ir, ops; not targets",
        "ernie_ir/passes/fp8.py:4: ernie_ir.passes.fp8 imports ernie_ir.runtime.interpreter: "
        "passes may import ir, ops; not runtime",
        "ernie_ir/passes/typed.py:3: ernie_ir.passes.typed imports ernie_ir.frontends: "
        "passes may import ir, ops; not frontends",
    ]


def test_the_checker_resolves_relative_and_package_imports(fake: Path) -> None:
    edges = {(e.source, e.target, e.names) for e in all_imports(fake)}
    assert ("ernie_ir.passes.fp8", "ernie_ir.ir.graph", ()) in edges  # from ..ir import graph
    assert ("ernie_ir.runtime.interpreter", "ernie_ir.ops", ()) in edges  # from ernie_ir import ops
    assert ("ernie_ir.runtime", "ernie_ir", ("__version__",)) in edges
    assert ("ernie_ir", "ernie_ir.ir", ()) in edges


def test_the_checker_refuses_more_than_version_from_the_package(fake: Path) -> None:
    (fake / "ir" / "bad.py").write_text("from ernie_ir import __version__, something\n")
    assert [v for v in violations(all_imports(fake), LAYERS) if "bad.py" in v] == [
        "ernie_ir/ir/bad.py:1: ernie_ir.ir.bad imports ernie_ir: take only ['__version__'] from the "
        "package itself"]


def test_the_checker_names_a_layer_missing_from_the_table(fake: Path) -> None:
    (fake / "extras.py").write_text("from ernie_ir.ir import Graph\n")
    assert any("'extras' has no layer in LAYERS" in v for v in violations(all_imports(fake), LAYERS))


def test_the_checker_finds_import_circles_through_function_imports(fake: Path) -> None:
    assert import_cycles(all_imports(fake)) == []
    (fake / "passes" / "a.py").write_text("from . import b\n")
    (fake / "passes" / "b.py").write_text("def f():\n    from ernie_ir.passes.c import g\n")
    (fake / "passes" / "c.py").write_text("from ernie_ir.passes import a\ndef g(): ...\n")
    (fake / "passes" / "d.py").write_text("from . import a\n")  # reaches the circle, is not in it
    assert import_cycles(all_imports(fake)) == [
        "import circle among ernie_ir.passes.a, ernie_ir.passes.b, ernie_ir.passes.c: "
        "ernie_ir.passes.a -> ernie_ir.passes.b (ernie_ir/passes/a.py:1), "
        "ernie_ir.passes.b -> ernie_ir.passes.c (ernie_ir/passes/b.py:2), "
        "ernie_ir.passes.c -> ernie_ir.passes.a (ernie_ir/passes/c.py:1)"]
