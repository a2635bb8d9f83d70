"""Runs the bad-input corpus (`_bad_input_cases.CASES`): each case is a clean refusal.

The contract (docs/cli.md, issue 14): exit code 2, exactly one non-empty line on stderr that
starts with `error:` and names the problem (the case's substrings), no traceback, nothing on
stdout, and nothing written: the case's folder holds exactly what its setup put there. Cases
run in this process (`ernie_ir.cli.app.main`) under a watchdog alarm, so a reader that would
block or loop forever fails the case instead of hanging the suite; cases whose input is a
FIFO or a device run in a child process with a timeout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from _bad_input_cases import CASES, ERNIE_CFG, LORA_CFG, Bases, Case

from ernie_ir.cli.app import main

WATCHDOG_S = 20
HAS_PADDLE = importlib.util.find_spec("paddle") is not None


class Hung(BaseException):
    """The watchdog fired: the case did not finish in WATCHDOG_S seconds."""


@contextmanager
def watchdog(seconds: int) -> Iterator[None]:
    def fire(signum: int, frame: object) -> None:
        raise Hung(f"no answer after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _checkpoint(folder: Path, spec: str) -> Path:
    from ernie_ir.frontends import load_model
    from ernie_ir.ir.weights import write_safetensors

    g = load_model(spec)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(g.metadata["config"]))
    write_safetensors(folder / "model.safetensors",
                      [(p.name, p.source) for p in g.params.values() if p.source is not None])
    return folder


def _adapter(folder: Path) -> Path:
    from ernie_ir.ir.weights import write_safetensors

    folder.mkdir(parents=True)
    (folder / "lora_config.json").write_text(json.dumps(LORA_CFG))
    (folder / "config.json").write_text(json.dumps(ERNIE_CFG))
    rng = np.random.default_rng(0)
    hidden, heads, kv, hd, r = 64, 8, 1, 16, LORA_CFG["r"]
    tensors = []
    for layer in range(2):
        key = f"model.layers.{layer}.self_attn.qkv_proj"
        tensors.append((f"{key}.lora_A", rng.standard_normal((hidden, r)).astype(np.float32)))
        tensors.append((f"{key}.lora_B", rng.standard_normal((r, (heads + 2 * kv) * hd)).astype(np.float32)))
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    return folder


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Bases:
    from ernie_ir.frontends import load_model
    from ernie_ir.ir.storage import save_graph
    from ernie_ir.targets import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("bad_input_bases")
    train = None
    if HAS_PADDLE:
        train = root / "train"
        compile_model("gpt-345m@tiny", "cuda", CompileOptions(mode="training", lora_rank=4, out=train))
    art = root / "art"
    compile_model("gpt-345m@tiny", "cuda", CompileOptions(out=art))
    pp = root / "pp"
    compile_model("gpt-345m@tiny", "cuda", CompileOptions(pp=2, out=pp))
    return Bases(ckpt=_checkpoint(root / "ckpt", "ernie-4.5-0.3b@tiny"),
                 gpt_ckpt=_checkpoint(root / "gpt", "gpt-345m@tiny"),
                 graph=save_graph(load_model("gpt-345m@tiny"), root / "graph"),
                 artifact=art, train_artifact=train, adapter=_adapter(root / "adapter"), pp_artifact=pp)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root (FIFOs included) with its size and mtime: what a case may not change.
    Folders count by name only (a temp folder made and removed again changes the parent's mtime)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[Path(dirpath, name).relative_to(root).as_posix() + "/"] = (0, 0)
        for name in filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            out[p.relative_to(root).as_posix()] = (st.st_size, st.st_mtime_ns)
    return out


def _argv(c: Case, tmp: Path) -> list[str]:
    return [a.replace("{t}", str(tmp)) for a in c.argv]


def run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        with watchdog(WATCHDOG_S):
            main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_in_child(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        p = subprocess.run([sys.executable, "-c", "from ernie_ir.cli.app import main; main()", *argv],
                           capture_output=True, text=True, timeout=60, cwd=cwd, env=env)
    except subprocess.TimeoutExpired:
        return -1, "", "hung: no answer after 60 s (a blocking read?)"
    return p.returncode, p.stdout, p.stderr


def check(c: Case, tmp: Path, bases: Bases, capsys: pytest.CaptureFixture[str],
          monkeypatch: pytest.MonkeyPatch) -> str | None:
    """None when the case is refused cleanly, else what went wrong (one line)."""
    work = tmp / "work"
    work.mkdir()
    if c.setup is not None:
        c.setup(work, bases)
    before = snapshot(tmp)
    argv = _argv(c, work)
    monkeypatch.chdir(work)
    try:
        code, out, err = run_in_child(argv, work) if c.subprocess else run_in_process(argv, capsys)
    except Hung as e:
        return f"hung: {e}"
    except BaseException as e:  # a traceback the CLI let through
        return f"raised {type(e).__name__}: {str(e)[:200]}"
    lines = [line for line in err.splitlines() if line.strip()]
    if code != c.code:
        return f"exit {code}, stderr {err[-300:]!r}"
    if "Traceback" in err:
        return "traceback on stderr"
    if len(lines) != 1 or not lines[0].startswith("error: "):
        return f"{len(lines)} stderr lines: {err[:300]!r}"
    if out:
        return f"stdout not empty: {out[:100]!r}"
    missing = [s.replace("{t}", str(work)) for s in c.expect if s.replace("{t}", str(work)) not in lines[0]]
    if missing:
        return f"message lacks {missing}: {lines[0][:300]}"
    after = snapshot(tmp)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)
                     and not k.startswith("work/__pycache__"))
    if changed:
        return f"wrote {changed[:5]}"
    return None


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_cleanly(c: Case, bases: Bases, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if c.needs == "paddle" and not HAS_PADDLE:
        pytest.skip("needs paddle")
    problem = check(c, tmp_path, bases, capsys, monkeypatch)
    assert problem is None, f"{c.id}: {problem}"


def test_the_corpus_is_large_and_covers_every_command() -> None:
    assert len(CASES) >= 300
    assert len({c.id for c in CASES}) == len(CASES)
    commands = {c.argv[0] for c in CASES}
    assert commands >= {"show", "run", "compile", "train", "verify", "passes", "explain", "plan", "golden"}
