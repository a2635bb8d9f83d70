"""Real `ernie-ir compile` processes killed (by their own PID) during the write phase, and
several compiles into one --out at once (issue 14 item 1; docs/targets.md section 4).

Each kill stops a compile at a named point of the write phase (the test-only hook
`ERNIE_IR_TEST_PAUSE_AT`, ernie_ir.artifacts.publish) once the disk shows it is there, with
SIGKILL or SIGTERM; then `--out` must hold the old artifact or the complete new one (verify
passes), and the next compile into the same --out must leave no stale bytes. Bounded: tiny
models, at most 4 processes at once, every wait has a timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ernie_ir.artifacts import ArtifactError, verify_artifact
from ernie_ir.targets import CompileOptions, compile_model

MODEL = "ernie-4.5-0.3b@tiny"
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ERNIE_IR_TEST_PAUSE_S": "30", **extra}
    env.pop("ERNIE_IR_TEST_PAUSE_AT", None)
    env.update(extra)
    return env


def _start(out: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-c", "from ernie_ir.cli.app import main; main()", "compile", MODEL,
           "--target", "kunlun", "--out", str(out), *args]
    return subprocess.Popen(cmd, cwd=out.parent, env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _temps(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.name.startswith(".") and ".tmp-" in p.name)


def _stale_bytes(parent: Path) -> tuple[int, list[str]]:
    """Bytes under every hidden entry of `parent` (temp folders, .old, locks) and their names."""
    hidden = [p for p in parent.iterdir() if p.name.startswith(".")]
    size = 0
    for p in hidden:
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
        size += sum(f.stat().st_size for f in files)
    return size, sorted(p.name for p in hidden)


def _reached(stage: str, parent: Path, out: Path, old_pipeline: str) -> bool:
    """Whether the disk shows the compile paused at `stage`."""
    temps = _temps(parent)
    if stage == "temp":
        return bool(temps)
    if stage == "weights":
        return any((t / "rank0" / "weights.safetensors").is_file() for t in temps)
    if stage == "manifest":
        return any((t / "manifest.json").is_file() for t in temps)
    if stage == "swap":  # the new artifact is at --out, the old one under the temp name
        try:
            return verify_artifact(out).pipeline != old_pipeline and bool(temps)
        except Exception:
            return False
    raise AssertionError(stage)


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


KILLS = [("temp", signal.SIGKILL), ("weights", signal.SIGTERM), ("weights", signal.SIGKILL),
         ("manifest", signal.SIGKILL), ("swap", signal.SIGKILL), ("swap", signal.SIGTERM)]


@pytest.mark.slow
@pytest.mark.parametrize("stage,sig", KILLS, ids=[f"{s}-{g.name}" for s, g in KILLS])
def test_killed_compile_leaves_old_or_new_and_the_next_compile_cleans_up(tmp_path: Path, stage: str,
                                                                        sig: signal.Signals) -> None:
    out = tmp_path / "art"
    compile_model(MODEL, "kunlun", CompileOptions(out=out))
    old = verify_artifact(out)
    proc = _start(out, "--force", "--quant", "wint8", ERNIE_IR_TEST_PAUSE_AT=stage)
    deadline = time.monotonic() + TIMEOUT_S
    while not _reached(stage, tmp_path, out, old.pipeline):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"the compile never reached {stage}"
        time.sleep(0.02)
    os.kill(proc.pid, sig)
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == (143 if sig == signal.SIGTERM else -signal.SIGKILL), stderr
    now = verify_artifact(out)  # --out holds a complete artifact: the old one, or the new one
    new = "quant-annotate{preset=wint8},weight-only-quant,legalize-kunlun"
    assert now == old if stage != "swap" else now.pipeline == new, now.pipeline
    if sig == signal.SIGTERM:  # cleaned up like Ctrl-C, by the process itself
        assert _stale_bytes(tmp_path) == (0, [])
    compile_model(MODEL, "kunlun", CompileOptions(out=out, force=True))  # the next compile: removes the rest
    verify_artifact(out)
    assert _stale_bytes(tmp_path) == (0, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.2])
def test_sigkill_at_an_arbitrary_instant_of_the_write_phase(tmp_path: Path, delay_s: float) -> None:
    """No hook: killed `delay_s` after its temp folder appeared, wherever the compile is then."""
    out = tmp_path / "art"
    compile_model(MODEL, "kunlun", CompileOptions(out=out))
    old = verify_artifact(out)
    proc = _start(out, "--force", "--quant", "wint8")
    deadline = time.monotonic() + TIMEOUT_S
    while not _temps(tmp_path) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(delay_s)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=TIMEOUT_S)
    now = verify_artifact(out)
    assert now == old or now.pipeline == "quant-annotate{preset=wint8},weight-only-quant,legalize-kunlun"
    compile_model(MODEL, "kunlun", CompileOptions(out=out, force=True))
    assert _stale_bytes(tmp_path) == (0, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_stranded_old_artifact_is_put_back_by_the_next_compile(tmp_path: Path) -> None:
    """A --force swap killed between its two renames (where renameat2 cannot exchange) leaves
    `.NAME.old-PID` and no NAME: the next compile puts the old artifact back, then refuses to
    replace it without --force."""
    out = tmp_path / "art"
    compile_model(MODEL, "kunlun", CompileOptions(out=out))
    old = verify_artifact(out)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=TIMEOUT_S)
    out.rename(tmp_path / f".art.old-{dead.pid}")
    with pytest.raises(ArtifactError, match=r"art already exists: pass --force"):
        compile_model(MODEL, "kunlun", CompileOptions(out=out))
    assert verify_artifact(out) == old
    assert _stale_bytes(tmp_path) == (0, [])
    # Both there (killed after the swap, before removing the old one): the old copy goes.
    (tmp_path / f".art.old-{dead.pid}").mkdir()
    (tmp_path / f".art.old-{dead.pid}" / "x.bin").write_bytes(b"old" * 100)
    compile_model(MODEL, "kunlun", CompileOptions(out=out, force=True))
    assert _stale_bytes(tmp_path) == (0, [])


@pytest.mark.slow
def test_a_folder_that_appears_while_compiling_is_never_touched(tmp_path: Path) -> None:
    out = tmp_path / "art"
    proc = _start(out, ERNIE_IR_TEST_PAUSE_AT="manifest", ERNIE_IR_TEST_PAUSE_S="1.5")
    deadline = time.monotonic() + TIMEOUT_S
    while not _reached("manifest", tmp_path, out, ""):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    out.mkdir()
    (out / "mine.txt").write_text("precious")
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 2
    line = _one_error_line(stderr)
    assert "appeared while compiling" in line and "left untouched and the new artifact removed" in line
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    assert (out / "mine.txt").read_text() == "precious"
    assert _stale_bytes(tmp_path) == (0, [])


@pytest.mark.slow
def test_concurrent_compiles_into_one_out_one_wins_the_others_get_one_line(tmp_path: Path) -> None:
    """4 compiles at once (the first to lock holds it for 1 s): exactly one succeeds; the
    others exit 2 with one line (the lock and its holder's PID, or --out already exists)."""
    out = tmp_path / "art"
    procs = [_start(out, ERNIE_IR_TEST_PAUSE_AT="temp", ERNIE_IR_TEST_PAUSE_S="1") for _ in range(4)]
    results = [(p.pid, p.wait(timeout=TIMEOUT_S), p.communicate()[1]) for p in procs]
    assert sorted(rc for _, rc, _ in results) == [0, 2, 2, 2], results
    # A loser names the compile holding the lock when it checked: compile locks once to fail
    # fast at start-up and again to publish, so that holder need not be the one that won.
    holders = {f"art is being written by PID {pid} (lock {tmp_path / '.art.lock'})": pid
               for pid, _, _ in results}
    for pid, rc, stderr in results:
        if rc == 2:
            line = _one_error_line(stderr)
            named = [holder for text, holder in holders.items() if text in line]
            assert (named and named[0] != pid) or "art already exists" in line, line
    verify_artifact(out)
    assert _stale_bytes(tmp_path) == (0, [])


@pytest.mark.slow
def test_concurrent_forced_compiles_never_interleave(tmp_path: Path) -> None:
    """3 --force compiles at once over an existing artifact: each either replaced it whole or
    was refused with one line naming the lock; the result verifies and nothing is left over."""
    out = tmp_path / "art"
    compile_model(MODEL, "kunlun", CompileOptions(out=out))
    quants = ["wint8", "wint4", "wint8"]
    procs = [_start(out, "--force", "--quant", q, ERNIE_IR_TEST_PAUSE_AT="weights",
                    ERNIE_IR_TEST_PAUSE_S="1") for q in quants]
    results = [(p.wait(timeout=TIMEOUT_S), p.communicate()[1]) for p in procs]
    assert any(rc == 0 for rc, _ in results), results
    for rc, stderr in results:
        assert rc in (0, 2), stderr
        if rc == 2:
            assert "is being written by PID" in _one_error_line(stderr)
    assert "weight-only-quant" in verify_artifact(out).pipeline
    assert _stale_bytes(tmp_path) == (0, [])
