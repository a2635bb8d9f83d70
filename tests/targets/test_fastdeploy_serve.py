"""serve.sh, the FastDeploy launch line a FastDeploy artifact carries (issue 39 item 5): the
api_server command for the folder, with the artifact's tensor-parallel size and the
--max-model-len / --max-num-seqs `plan` models for it; compile and plan print the same command;
cells FastDeploy cannot load get none. The command is read back as the shell runs it (a stand-in
`python` on PATH prints its arguments), and, in the `fd` reference environment, by FastDeploy's
own api_server argument parser."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from _cli_kit import cli

from ernie_ir.formats.fastdeploy import ServeLimits, llm_call, serve_command
from ernie_ir.planning import plan_memory
from ernie_ir.planning.request import (
    DEFAULT_SEQ_LEN,
    FASTDEPLOY_GPU_MEMORY_UTILIZATION,
    FASTDEPLOY_MAX_NUM_BATCHED_TOKENS,
    FASTDEPLOY_MAX_NUM_SEQS,
)
from ernie_ir.targets import CompileOptions, compile_model, read_manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from fastdeploy_loader import PYTHON, SRC, available

pytestmark = pytest.mark.slow  # the module fixture compiles four tiny artifacts (about 3 s)

DENSE, MOE = "ernie-4.5-0.3b@tiny", "ernie-4.5-21b-a3b@tiny"
MODULE = "fastdeploy.entrypoints.openai.api_server"
FAKE_PYTHON = "#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n"
"""A stand-in `python` that prints the arguments serve.sh gives it, one a line."""


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """(artifact, compile's serve line) for dense wint8 at tp 1 and 2; the MoE weight-only cell
    FastDeploy refuses at tp 2 (a default compile: a warning, no FastDeploy files) and an
    unquantized compile (FastDeploy serves the source itself)."""
    root = tmp_path_factory.mktemp("serve")
    cells = {"tp1": (DENSE, {"quant": "wint8", "tp": 1}), "tp2": (DENSE, {"quant": "wint8", "tp": 2}),
             "refused": (MOE, {"quant": "wint8", "tp": 2}), "bf16": (DENSE, {})}
    out = {}
    for key, (model, kw) in cells.items():
        report = compile_model(model, "cuda", CompileOptions(cuda_arch=70, out=root / key / "art", **kw))
        out[key] = (Path(report.out), report.serve)
    return out


def run_serve_sh(art: Path, tmp: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """The arguments serve.sh passes to python, as the shell expands them."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(FAKE_PYTHON, encoding="utf-8")
    (bin_dir / "python").chmod(0o755)
    run_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **(env or {})}
    run_env.pop("PYTHON", None)
    done = subprocess.run([str(art / "serve.sh"), *args], env=run_env, capture_output=True, text=True,
                          check=True, timeout=30)
    return done.stdout.splitlines()


def flags(argv: list[str]) -> dict[str, str]:
    """--flag value pairs after `-m MODULE` (a later value of a flag wins, as in argparse)."""
    assert argv[:2] == ["-m", MODULE]
    rest = argv[2:]
    assert all(a.startswith("--") for a in rest[::2]), rest
    return dict(zip(rest[::2], rest[1::2], strict=True))


def ports(got: dict[str, str]) -> tuple[str, str, str]:
    return got["--port"], got["--metrics-port"], got["--engine-worker-queue-port"]


@pytest.mark.parametrize("key, tp", [("tp1", 1), ("tp2", 2)])
def test_serve_sh_names_the_artifacts_tp_and_the_planners_limits(arts: dict[str, tuple[Path, str]],
                                                                 tmp_path: Path, key: str, tp: int) -> None:
    art, printed = arts[key]
    got = flags(run_serve_sh(art, tmp_path))
    plan = plan_memory(str(art), None)  # what `plan ART --engine fastdeploy` models, by default
    assert plan.engine == "fastdeploy" and plan.engine_settings is not None and plan.tp == tp
    assert read_manifest(art).mapping.tp == tp
    assert got["--model"] == str(art.resolve())
    assert got["--tensor-parallel-size"] == str(tp)
    assert got["--max-model-len"] == str(plan.engine_settings.max_model_len)
    assert got["--max-num-seqs"] == str(plan.engine_settings.max_num_seqs)
    assert ports(got) == ("8180", "8181", "8182")
    # one rank: FastDeploy's v0 loader (its v1 loader stops on a one-rank pre-quantized folder)
    assert got.get("--load-choices") == ("default" if tp == 1 else None)
    assert "--quantization" not in got  # config.json's quantization_config names it
    # compile printed the same command, parsed back
    words = shlex.split(printed)
    assert words[0] == "python" and flags(words[1:]) == {**got, "--model": str(art)}


def test_ports_and_flags_are_overridable(arts: dict[str, tuple[Path, str]], tmp_path: Path) -> None:
    art, _ = arts["tp2"]
    env = {"PORT": "9000", "METRICS_PORT": "9100", "ENGINE_WORKER_QUEUE_PORT": "9200"}
    got = flags(run_serve_sh(art, tmp_path, "--max-num-seqs", "4", "--port", "9001", env=env))
    assert ports(got) == ("9001", "9100", "9200")  # the argument beats the variable
    assert got["--max-num-seqs"] == "4"


@pytest.mark.parametrize("key", ["tp1", "tp2"])
def test_the_manifest_lists_serve_sh_with_its_sha256(arts: dict[str, tuple[Path, str]], key: str) -> None:
    art, _ = arts[key]
    files = json.loads((art / "manifest.json").read_text(encoding="utf-8"))["files"]
    assert files["serve.sh"] == hashlib.sha256((art / "serve.sh").read_bytes()).hexdigest()
    assert os.access(art / "serve.sh", os.X_OK)


@pytest.mark.parametrize("key", ["refused", "bf16"])
def test_cells_fastdeploy_refuses_get_no_serve_sh(arts: dict[str, tuple[Path, str]], key: str) -> None:
    art, printed = arts[key]
    assert printed == "" and not (art / "serve.sh").exists()
    assert "serve.sh" not in json.loads((art / "manifest.json").read_text(encoding="utf-8"))["files"]


def test_the_limits_are_the_planners_defaults() -> None:
    assert ServeLimits() == ServeLimits(DEFAULT_SEQ_LEN, FASTDEPLOY_MAX_NUM_SEQS,
                                        FASTDEPLOY_GPU_MEMORY_UTILIZATION, FASTDEPLOY_MAX_NUM_BATCHED_TOKENS)


def test_compile_and_plan_print_the_command(arts: dict[str, tuple[Path, str]], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    art, printed = arts["tp2"]
    code, out, _ = cli(capsys, "plan", str(art), width=400)
    assert code == 0 and f"serve with FastDeploy: {printed}" in out.splitlines()
    code, out, _ = cli(capsys, "plan", str(art), "--max-model-len", "2048", "--max-num-seqs", "4", width=400)
    line = next(x for x in out.splitlines() if x.startswith("serve with FastDeploy: "))
    got = flags(shlex.split(line.split(": ", 1)[1])[1:])
    limits = ("--max-model-len", "--max-num-seqs", "--tensor-parallel-size")
    assert [got[f] for f in limits] == ["2048", "4", "2"]
    # a source model: the command for the folder compile would write, or why there is none
    code, out, _ = cli(capsys, "plan", DENSE, "--target", "cuda", "--quant", "wint8", "--tp", "2", width=400)
    assert code == 0 and (f"serve with FastDeploy (compile with --emit fastdeploy --tp 2 --out ART): "
                          f"{serve_command('ART', 2)}") in out.splitlines()
    code, out, _ = cli(capsys, "plan", MOE, "--target", "cuda", "--quant", "wint8", "--tp", "2", width=400)
    assert code == 0 and "serve with FastDeploy: no folder FastDeploy loads from this compile: weight-only " \
        "MoE experts at --tp 2" in out
    code, out, _ = cli(capsys, "compile", DENSE, "--target", "cuda", "--quant", "wint8", "--tp", "2",
                       "--cuda-arch", "70", "--out", str(tmp_path / "c"), width=400)
    assert code == 0 and f"serve with FastDeploy ({tmp_path / 'c' / 'serve.sh'} runs it): " \
        f"{serve_command(str(tmp_path / 'c'), 2)}" in out


PARSE = """
import json, os, sys, types, importlib.util
pkg = types.ModuleType("fastdeploy")  # its __init__ starts the engine's imports: only the parser's
pkg.__path__ = [os.path.join(sys.argv[1], "fastdeploy")]
sys.modules["fastdeploy"] = pkg
for name in ("aiozmq", "zmq"):  # the server's messaging libraries, imported beside its parser
    if importlib.util.find_spec(name) is None:
        stub = types.ModuleType(name)
        stub.__getattr__ = lambda attr: type(attr, (), {})
        sys.modules[name] = stub
from dataclasses import fields
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.openai.utils import make_arg_parser
from fastdeploy.utils import FlexibleArgumentParser
out = []
for argv in json.loads(sys.argv[2]):
    a = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    keys = ("model", "tensor_parallel_size", "max_model_len", "max_num_seqs", "port", "metrics_port",
            "engine_worker_queue_port", "load_choices")
    out.append({k: getattr(a, k) for k in keys})
out.append(sorted(f.name for f in fields(EngineArgs)))
print(json.dumps(out))
"""


@pytest.mark.reference
@pytest.mark.slow
def test_fastdeploys_own_parser_reads_serve_sh(arts: dict[str, tuple[Path, str]], tmp_path: Path) -> None:
    """FastDeploy's api_server argument parser (`make_arg_parser`, with `EngineArgs.add_cli_args`)
    reads serve.sh's arguments to the values we meant; the `fastdeploy.LLM` keywords are
    EngineArgs fields. About 12 s: the import of FastDeploy's argument modules."""
    why = available()
    if why:
        pytest.skip(why)
    argvs = [run_serve_sh(arts[key][0], tmp_path)[2:] for key in ("tp1", "tp2")]
    done = subprocess.run([str(PYTHON), "-c", PARSE, str(SRC), json.dumps(argvs)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    *parsed, engine_fields = json.loads(done.stdout.strip().splitlines()[-1])
    for (key, tp), got in zip((("tp1", 1), ("tp2", 2)), parsed, strict=True):
        assert got == {"model": str(arts[key][0].resolve()), "tensor_parallel_size": tp,
                       "max_model_len": 4096, "max_num_seqs": 8, "port": 8180, "metrics_port": 8181,
                       "engine_worker_queue_port": ["8182"],
                       "load_choices": "default" if tp == 1 else "default_v1"}
    for tp in (1, 2):
        call = llm_call("F", tp)
        keywords = [kw.split("=")[0] for kw in call[len("LLM("):-1].split(", ")]
        assert keywords and set(keywords) <= set(engine_fields), call
