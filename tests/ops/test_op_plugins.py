"""Third-party ops through the `ernie_ir.ops` entry-point group, end to end.

A tiny package is built and pip-installed (`--target`, no network) during the
test: it adds the op `swiglu` (type rule, numpy kernel, ONNX and Paddle
lowerings) through `ernie_ir.ops` and the rule `fuse-swiglu`
(silu(gate) * up -> swiglu(gate, up)) through `ernie_ir.passes`. `ernie-ir`
then runs in a subprocess with the package on PYTHONPATH, as for a user who
pip-installed it: an `.ir` file using the op parses and runs, the rule
rewrites a built-in model, and the model compiles to every target; the ONNX
model runs in a bare `onnxruntime.InferenceSession`, the Paddle inference model
through Paddle Inference, both compared with the interpreter. A second package
is broken (its module raises ImportError): the built-in ops never notice, and
asking for its op names it in one line.

The packages are built by `ernie_ir.testing.plugins.install_plugin` (a
stdlib-only PEP 517 backend: no network, no wheel-capable setuptools).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ernie_ir
from ernie_ir.testing.plugins import install_plugin

pytestmark = pytest.mark.slow

ROOT = Path(ernie_ir.__file__).resolve().parents[1]  # the ernie_ir the subprocesses must import
ERNIE_IR = str(Path(sys.executable).parent / "ernie-ir")

SWIGLU = '''\
"""A third-party op and the rule that makes it: swiglu(gate, up) = silu(gate) * up."""
from ernie_ir.ir import Input, OpDef, OpError, register_op
from ernie_ir.passes import RewriteRule, rewrite_pass


@register_op
class Swiglu(OpDef):
    """y = gate / (1 + exp(-gate)) * up   (silu(gate) * up, in float32)"""

    name = "swiglu"
    inputs = (Input("gate"), Input("up"))

    def infer(self, types, attrs):
        gate, up = types
        if gate is None or up is None:
            raise OpError("swiglu: gate and up are required")
        if gate != up or not gate.dtype.is_float:
            raise OpError(f"swiglu: gate and up must be equal float types, got {gate} and {up}")
        return [gate]

    def kernel(self, args, attrs):
        import numpy as np

        gate, up = args
        with np.errstate(over="ignore"):
            return [gate / (np.float32(1) + np.exp(-gate)) * up]

    def lower_onnx(self, node, onnx):
        gate, up = (onnx.name(v) for v in node.inputs)
        return [onnx.op("Mul", [onnx.op("Mul", [gate, onnx.op("Sigmoid", [gate])]), up])]

    def lower_paddle(self, layer, node, args):
        return [layer.F.silu(args[0]) * args[1]]


class FuseSwiglu(RewriteRule):
    """silu(gate) * up  ->  swiglu(gate, up)"""

    name = "fuse-swiglu"

    def pattern(self, op, gate, up):
        return op.mul(op.silu(gate, _single_use=True), up)

    def rewrite(self, op, gate, up):
        return op.swiglu(gate, up)


FuseSwigluPass = rewrite_pass("fuse-swiglu", "Fuse silu(gate) * up into the plugin op swiglu.",
                              [FuseSwiglu()])
'''

BROKEN = '''\
raise ImportError("this op plugin needs torch_npu")
'''

SWIGLU_IR = """\
graph @g(%gate: f32[B,4], %up: f32[B,4]) -> (y: f32[B,4]) {
  %0 = swiglu(%gate, %up) : f32[B,4]
  return %0
}
"""

BUILTIN_IR = """\
graph @g(%x: f32[B,4]) -> (y: f32[B,4]) {
  %0 = silu(%x) : f32[B,4]
  return %0
}
"""

UNFUSED_IR = """\
graph @g(%gate: f32[B,4], %up: f32[B,4]) -> (y: f32[B,4]) {
  %0 = silu(%gate) : f32[B,4]
  %1 = mul(%0, %up) : f32[B,4]
  return %1
}
"""

MODEL = "ernie-4.5-0.3b@tiny"
IDS = np.random.default_rng(3).integers(0, 1024, size=(2, 6)).astype(np.int64)


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("op-plugins")
    for name, text in (("swiglu.ir", SWIGLU_IR), ("builtin.ir", BUILTIN_IR), ("unfused.ir", UNFUSED_IR)):
        (root / name).write_text(text)
    np.save(root / "ids.npy", IDS)
    good = install_plugin(root, "ernie-ir-swiglu", {"ernie_ir_swiglu": SWIGLU},
                          {"ernie_ir.ops": {"swiglu": "ernie_ir_swiglu"},
                           "ernie_ir.passes": {"fuse-swiglu": "ernie_ir_swiglu:FuseSwigluPass"}})
    broken = install_plugin(root, "ernie-ir-brokenop", {"ernie_ir_brokenop": BROKEN},
                            {"ernie_ir.ops": {"npu-ops": "ernie_ir_brokenop"}})
    return {"root": root, "good": good, "broken": broken}


def tool(sites: dict[str, Path], *argv: str, plugins: tuple[str, ...], program: str = ERNIE_IR,
         timeout: int = 300) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([*(str(sites[p]) for p in plugins), str(ROOT)])
    env = {k: v for k, v in os.environ.items() if k != "ERNIE_IR_UPDATE_GOLDENS"}
    env.update(PYTHONPATH=path, COLUMNS="240", NO_COLOR="1")
    return subprocess.run([program, *argv], env=env, cwd=sites["root"], capture_output=True, text=True,
                          timeout=timeout)


def python(sites: dict[str, Path], code: str, plugins: tuple[str, ...]) -> str:
    run = tool(sites, "-c", code, plugins=plugins, program=sys.executable)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    return lines[0]


# -- an .ir file using the plugin op: parse, run, rewrite ------------------------------------------


def test_pip_installed_the_op_plugin_with_both_entry_point_groups(sites: dict[str, Path]):
    info = sites["good"] / "ernie_ir_swiglu-0.0.1.dist-info" / "entry_points.txt"
    assert info.read_text() == ('[ernie_ir.ops]\nswiglu = ernie_ir_swiglu\n'
                                '[ernie_ir.passes]\nfuse-swiglu = ernie_ir_swiglu:FuseSwigluPass\n')


def test_an_ir_file_with_the_plugin_op_parses_and_prints_back(sites: dict[str, Path]):
    run = tool(sites, "show", "swiglu.ir", plugins=("good",))
    assert (run.returncode, run.stderr) == (0, "")
    assert run.stdout == SWIGLU_IR


def test_the_plugin_op_runs_builds_and_rewrites_in_the_library(sites: dict[str, Path]):
    out = python(sites, """
import json
import numpy as np
from ernie_ir.ir import GraphBuilder, f32, get_op, tensor
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.registry import op_origin
from ernie_ir.passes import run_pipeline
from ernie_ir.ir.printer import print_graph
from ernie_ir.runtime import run_graph

rng = np.random.default_rng(0)
feeds = {"gate": rng.standard_normal((3, 4)).astype(np.float32) * 4,
         "up": rng.standard_normal((3, 4)).astype(np.float32)}
text = open("swiglu.ir").read()
y = run_graph(parse_graph(text), feeds)["y"]
b = GraphBuilder("built")
g, u = b.input("gate", tensor(f32, "B", 4)), b.input("up", tensor(f32, "B", 4))
b.output(b.swiglu(g, u), name="y")
unfused = parse_graph(open("unfused.ir").read())
ref = run_graph(unfused, feeds)["y"]
run_pipeline(unfused, "fuse-swiglu")
print(json.dumps({
    "y": y.tolist(), "built": run_graph(b.graph, feeds)["y"].tolist(), "ref": ref.tolist(),
    "fused_text": print_graph(unfused), "fused": run_graph(unfused, feeds)["y"].tolist(),
    "origin": op_origin("swiglu"), "doc": get_op("swiglu").doc,
    "numpy": (feeds["gate"] / (1 + np.exp(-feeds["gate"])) * feeds["up"]).tolist()}))
""", plugins=("good",))
    res = json.loads(out)
    np.testing.assert_allclose(res["y"], res["numpy"], rtol=1e-6)
    assert res["built"] == res["y"]
    # the rule rewrote silu * mul into the plugin op, with the same float32 values
    assert "swiglu(%gate, %up)" in res["fused_text"] and "silu" not in res["fused_text"]
    assert res["fused"] == res["ref"] == res["y"]
    assert res["origin"] == "plugin swiglu (ernie_ir_swiglu)"
    assert res["doc"] == "y = gate / (1 + exp(-gate)) * up   (silu(gate) * up, in float32)"


def test_the_plugin_rule_rewrites_from_the_cli(sites: dict[str, Path]):
    run = tool(sites, "show", "unfused.ir", "--pipeline", "fuse-swiglu", plugins=("good",))
    assert (run.returncode, run.stderr) == (0, "")
    assert run.stdout == SWIGLU_IR


# -- compile to every target, run each executable -----------------------------------------------


def _logits(sites: dict[str, Path], art: Path, backend: str) -> np.ndarray:
    dest = art.parent / f"{art.name}-{backend}.npy"
    run = tool(sites, "run", str(art), "--tokens", "ids.npy", "--backend", backend,
               "--save-logits", str(dest), plugins=("good",))
    assert run.returncode == 0, run.stdout + run.stderr
    return np.load(dest)


@pytest.mark.parametrize(("target", "quant"), [("cuda", "wint8"), ("ascend", None), ("kunlun", None)])
def test_a_model_using_the_plugin_op_compiles_to_every_target_and_runs(
        sites: dict[str, Path], target: str, quant: str | None):
    pytest.importorskip("paddle")
    import onnxruntime as ort

    from ernie_ir.backends.onnx.session import full_sequence_feeds

    art = sites["root"] / f"art-{target}"
    # every executable: ONNX where the lowered ops have ONNX forms (kunlun's int8 has none)
    argv = ["compile", MODEL, "--target", target, "--pipeline", "fuse-swiglu", "--out", str(art),
            "--json", "--emit", "onnx,paddle-inference" if target == "cuda" else "paddle-inference"]
    run = tool(sites, *argv, *(["--quant", quant] if quant else []), plugins=("good",))
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert not [w for w in report["warnings"] if "executable" in w]
    manifest = json.loads((art / "manifest.json").read_text())
    want = {"interpreter", "paddle"} | ({"onnxruntime"} if target == "cuda" else set())
    assert want <= set(manifest["backends"])
    graph_text = (art / "rank0" / "graph.ir").read_text()
    assert graph_text.count("= swiglu(") == 2 and "silu(" not in graph_text  # both layers fused

    ref = _logits(sites, art, "interpreter")
    assert ref.shape == (2, 6, 1024) and np.isfinite(ref).all()
    tol = {"rtol": 1e-5, "atol": 1e-4 + 2e-6 * float(np.abs(ref).max())}
    np.testing.assert_allclose(_logits(sites, art, "paddle"), ref, **tol)
    if target == "cuda":
        onnx_file = art / "inference" / "onnx" / "model.onnx"
        session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
        logits = session.run(None, full_sequence_feeds(session, IDS))[0]  # the decoder, empty past
        np.testing.assert_allclose(logits, ref, **tol)
    else:  # the unfused source model: fusing changed no float32 value
        source = tool(sites, "run", MODEL, "--tokens", "ids.npy", "--save-logits",
                      str(art.parent / f"src-{target}.npy"), plugins=("good",))
        assert source.returncode == 0, source.stderr
        np.testing.assert_array_equal(np.load(art.parent / f"src-{target}.npy"), ref)


# -- a broken op plugin -------------------------------------------------------------------------


def test_a_broken_op_plugin_never_breaks_the_built_in_ops(sites: dict[str, Path]):
    run = tool(sites, "show", "builtin.ir", plugins=("broken",))
    assert (run.returncode, run.stderr) == (0, "")
    assert run.stdout == BUILTIN_IR
    both = tool(sites, "show", "swiglu.ir", plugins=("good", "broken"))
    assert (both.returncode, both.stderr, both.stdout) == (0, "", SWIGLU_IR)


def test_asking_for_an_op_the_broken_plugin_was_to_give_names_it_in_one_line(sites: dict[str, Path]):
    run = tool(sites, "show", "swiglu.ir", plugins=("broken",))
    assert run.returncode == 2 and run.stdout == ""
    assert one_error_line(run.stderr) == (
        "error: swiglu.ir:2:8: unknown op 'swiglu' (did you mean silu, gelu?); op plugin 'npu-ops' "
        "(ernie_ir_brokenop) failed to load: ImportError: this op plugin needs torch_npu")


def test_ernie_ir_ops_lists_the_plugin_op_and_names_the_broken_plugin(sites: dict[str, Path]):
    run = tool(sites, "ops", plugins=("good", "broken"))
    assert run.returncode == 2
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in run.stdout.splitlines() if line.startswith("│") and line.split("│")[1].strip()}
    assert rows["swiglu"] == ["gate, up", "", "op", "op", "plugin swiglu (ernie_ir_swiglu)"]
    assert rows["silu"] == ["x", "", "op", "op", "built-in"]
    assert rows["linear"] == ["x, weight, bias?", "", "emitter", "emitter", "built-in"]
    assert one_error_line(run.stderr) == (
        "error: op plugin 'npu-ops' (ernie_ir_brokenop) failed to load: ImportError: this op plugin "
        "needs torch_npu")
    assert tool(sites, "ops", plugins=("good",)).returncode == 0
