"""Compile at checkpoint size: `ernie-ir compile --quant wint8mix` of multi-GB bf16 checkpoints against cp -r.

Generates ERNIE 4.5 dense checkpoints (Paddle layout, bf16, ~1 GB shards with
model.safetensors.index.json, as benchmarks/split_scale.py does; default ~1 GB and ~2.5 GB,
under a temp dir that is deleted after) and, for each, in one run:

- `cp -r` of the folder (the peer): run once untimed to warm the page cache, then `sync`
  (untimed) and the best of 3 timed copies (/usr/bin/time %M for its peak RSS);
- in two regimes (--cache): `hot`, the checkpoint in the page cache (the strict peer: cp runs at
  memory speed, so compile's CPU work shows), and `disk` (`... from disk`), the checkpoint's files
  dropped from the page cache before each timed cp and compile (`evict`: sync, then
  posix_fadvise DONTNEED, no privilege needed), as for a checkpoint larger than RAM or read
  for the first time; every run is compared with cp in its own regime;
- `ernie-ir compile DIR --target cuda --quant wint8mix` and `--target ascend --quant wint8mix`,
  each cold (its own empty cache of source digests: the source is hashed) and again with the
  digests the cold run remembered (`... (digests kept)`: an unchanged checkpoint compiled again),
  (single rank, the default executables, which read the rank weights; `--targets cuda+onnx`
  adds `--emit onnx`, `ascend+paddle-inference` `--emit paddle-inference`), the CLI in its
  own process under `/usr/bin/time -f "%e %M"` (peak RSS), with its RssAnon / RssFile sampled
  every 10 ms from /proc/PID/status; `sync` (untimed) before each; best of --repeat (default 2);
- `plan_memory(DIR, target, CompileOptions(quant="wint8mix"))` in its own process: the planner's rank 0
  `by_category["weights"] + ["lora"]` next to the tensor bytes actually written into
  rank0/weights.safetensors (from its header's data offsets, as tests/planning do; the file
  adds its header): they must be equal.

Reported: seconds and compile / cp; peak RSS, over the base (the peak of the same compile of a
one-layer 40 MB checkpoint: the imports and code paths with next to nothing to stream) and per
checkpoint byte; the bytes written per
executable (rank0 weights, inference/onnx, inference/paddle; links are not counted) and their
ratio to the rank weight bytes. --profile: cProfile one more cuda compile of the largest
checkpoint (compile_model in its own process: top 25 by cumulative time).

    python benchmarks/compile_scale.py [--sizes 1,2.5] [--hidden 2048] [--targets cuda,ascend]
                                       [--cache hot,disk] [--repeat 2] [--dir DIR] [--profile]
                                       [--json]
    python benchmarks/compile_scale.py --quick   # 0.15 and 0.4 GB, hidden 1024: < 1 min
    python benchmarks/compile_scale.py --sizes 5,10   # past the dirty-page limit: ~15 min, ~30 GB of disk

Goal (issue 11): RSS bounded by a constant plus the largest tensor (independent of the checkpoint
bytes) and time within 3x of cp -r, on cuda and on ascend.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from meta_pipeline import RssSampler, tree_bytes
from split_scale import (
    _table,
    dense_config,
    profile_top,
    tensor_specs,
    timed_child,
    write_checkpoint,
)

QUANT = "wint8mix"
TARGETS = ("cuda", "ascend")
CP_REPEAT = 3
PROFILE_LINES = 25
GOAL_CP_RATIO = 3.0
WARM = " (digests kept)"
"""Suffix of the runs whose source digests an earlier compile remembered (a cold run clears them)."""
DISK = " from disk"
"""Suffix of the runs (cp's too) that read the checkpoint from the disk: its files are dropped from
the page cache before each (`evict`). The others read it from the page cache."""
CACHES = {"hot": "", "disk": DISK}
EXECUTABLES = {"rank0 weights": "rank0/weights.safetensors", "onnx": "inference/onnx",
               "paddle": "inference/paddle"}

# -- measurement -----------------------------------------------------------------------------------------


def ernie_ir_cli() -> list[str]:
    """The `ernie-ir` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("ernie-ir")
    found = str(script) if script.is_file() else shutil.which("ernie-ir")
    if found is None:
        raise SystemExit("ernie-ir: no console script next to this Python or on PATH (pip install -e .)")
    return [found]


def _child_of(ppid: int) -> int | None:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == ppid:
                return int(d.name)
    return None


def sampled_child(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd` under /usr/bin/time -f "%e %M": wall seconds, peak RSS (MB, the process's own
    VmHWM via wait4), RssAnon / RssFile peaks (MB) sampled every 10 ms, stdout."""
    gtime = shutil.which("time")
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = Path(tmp) / "time"
        full = [gtime, "-f", "%e %M", "-o", str(rss_file), *cmd] if gtime else cmd
        samplers: list[RssSampler] = []
        start = time.perf_counter()
        proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=None if env is None else {**os.environ, **env})

        def watch() -> None:  # time forks the command: sample its child, as soon as it exists
            pid = None
            while pid is None and proc.poll() is None:
                pid = _child_of(proc.pid) if gtime else proc.pid
                if pid is None:
                    time.sleep(0.005)
            if pid is not None:
                samplers.append(RssSampler(pid).start())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        stdout, stderr = proc.communicate()
        wall = time.perf_counter() - start
        watcher.join()
        peaks = samplers[0].stop() if samplers else dict.fromkeys(RssSampler.FIELDS, 0)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {stderr.strip()[-3000:]}")
        if gtime:
            elapsed, max_kb = rss_file.read_text().split()[-2:]
            peak_mb, time_s = int(max_kb) / 1024, float(elapsed)
        else:
            peak_mb, time_s = peaks["VmRSS"] / 1024, wall
    return {"seconds": wall, "time_s": time_s, "peak_mb": peak_mb, "peak_anon_mb": peaks["RssAnon"] / 1024,
            "peak_file_mb": peaks["RssFile"] / 1024, "stdout": stdout, "stderr": stderr}


BASELINE_HIDDEN = 512
"""The base checkpoint: one layer of hidden 512 (about 40 MB, 33 MB of it the embedding)."""


def measure_baseline(root: Path) -> dict[str, Any]:
    """The peak RSS of compiling a one-layer checkpoint (BASELINE_HIDDEN) per target, measured
    as the real runs are (`sampled_child`): the same imports and code paths with next to nothing
    to stream, so that a run's peak over it is what streaming its checkpoint costs."""
    ckpt = root / "base-checkpoint"
    write_checkpoint(ckpt, dense_config(0.0, BASELINE_HIDDEN))
    out = {"bytes": sum(tree_bytes(ckpt).values())}
    for target in TARGETS:
        r = sampled_child(compile_cmd(ckpt, target, root / "baseline"))
        shutil.rmtree(root / "baseline")
        out[target] = {"seconds": r["seconds"], "baseline_mb": r["peak_mb"],
                       "baseline_anon_mb": r["peak_anon_mb"], "baseline_file_mb": r["peak_file_mb"]}
    shutil.rmtree(ckpt)
    return out


def measure_plan(folder: Path, target: str) -> dict[str, Any]:
    """Run in a fresh process: plan_memory of the checkpoint folder (its config.json) for `target`."""
    from ernie_ir.planning import plan_memory
    from ernie_ir.targets import CompileOptions

    start = time.perf_counter()
    plan = plan_memory(str(folder), target, CompileOptions(quant=QUANT))
    r0 = plan.per_rank[0]
    return {"plan_s": time.perf_counter() - start, "devices": plan.devices, "by_category": r0.by_category,
            "weights_by_dtype": r0.weights_by_dtype, "pipeline": plan.pipeline}


def measure_profile(folder: Path, out: Path, stats: Path) -> None:
    """Run in a fresh process: cProfile compile_model(folder, "cuda", quant) (what the CLI calls)."""
    import cProfile

    from ernie_ir.targets.compile import compile_model

    prof = cProfile.Profile()
    prof.runcall(compile_model, str(folder), "cuda", quant=QUANT, out=out)
    prof.dump_stats(str(stats))


def evict(folder: Path) -> None:
    """Drop `folder`'s files from the page cache (after a sync, so that their pages are clean):
    the next read comes from the disk, as it does for a checkpoint larger than RAM. Needs no
    privilege (posix_fadvise DONTNEED on each file), and leaves every other file cached."""
    os.sync()
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def settle(folder: Path, suffix: str) -> None:
    """Before a timed run: sync, and in the disk regime (`suffix` DISK) also `evict` the folder."""
    if suffix == DISK:
        evict(folder)
    else:
        os.sync()


def regime(key: str) -> str:
    """The cp regime ("" or DISK) that a run's key (target + WARM? + DISK?) is compared with."""
    return DISK if key.endswith(DISK) else ""


def base_target(key: str) -> str:
    """`cuda+onnx (digests kept) from disk` -> `cuda+onnx`."""
    return key.removesuffix(DISK).removesuffix(WARM)


def stored_bytes(path: Path) -> tuple[int, int]:
    """(tensor bytes from the header's data offsets, header bytes incl. its length) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values()), 8 + n


# -- driver ----------------------------------------------------------------------------------------------


def compile_cmd(ckpt: Path, target: str, out: Path) -> list[str]:
    """`target` is a target name, or `target+executable` for `--emit executable`."""
    name, _, emit = target.partition("+")
    return [*ernie_ir_cli(), "compile", str(ckpt), "--target", name, "--quant", QUANT, "--out", str(out),
            "--json", *(["--emit", emit] if emit else [])]


def run_checkpoint(root: Path, gb: float, hidden: int, targets: list[str], repeat: int,
                   profile: bool, caches: list[str]) -> dict[str, Any]:
    """Generate one checkpoint, time cp -r and each target's compile, plan, delete it."""
    cfg = dense_config(gb, hidden)
    ckpt, copy, art = root / "checkpoint", root / "copy", root / "artifact"
    start = time.perf_counter()
    write_checkpoint(ckpt, cfg)
    row: dict[str, Any] = {
        "gb": gb, "layers": cfg["num_hidden_layers"], "hidden": hidden,
        "write_s": time.perf_counter() - start,
        "ckpt_bytes": sum(tree_bytes(ckpt).values()),
        "ckpt_files": len(list(ckpt.glob("*.safetensors"))),
        "largest_tensor_bytes": max(math.prod(s) * np.dtype(d).itemsize for _, s, d in tensor_specs(cfg)),
        "targets": {},
    }
    subprocess.run(["cp", "-r", str(ckpt), str(copy)], check=True)  # warm the page cache, untimed
    shutil.rmtree(copy)
    suffixes = [CACHES[c] for c in caches]
    cp_runs: dict[str, list[tuple[float, float | None]]] = {c: [] for c in suffixes}
    keys = [t + w + c for c in suffixes for t in targets for w in ("", WARM)]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    errors: dict[str, str] = {}
    digests = root / "digests"  # the compiles' own cache of source digests (source_digests.py)
    for _ in range(repeat):
        for c in suffixes:
            for _ in range(CP_REPEAT):
                settle(ckpt, c)
                wall, rss, _ = timed_child(["cp", "-r", str(ckpt), str(copy)], gnu_time=True)
                cp_runs[c].append((wall, rss))
                shutil.rmtree(copy)
        for target in keys:
            if target in errors:
                continue
            if not target.removesuffix(DISK).endswith(WARM):
                shutil.rmtree(digests, ignore_errors=True)  # cold: the source is hashed
            settle(ckpt, regime(target))
            try:
                r = sampled_child(compile_cmd(ckpt, base_target(target), art),
                                  env={"ERNIE_IR_CACHE_DIR": str(digests)})
            except RuntimeError as e:
                errors[target] = str(e)
                continue
            files = tree_bytes(art)
            r["files"] = files
            r["artifact_bytes"] = sum(files.values())
            r["exe_bytes"] = {name: sum(b for f, b in files.items() if f == path or f.startswith(path + "/"))
                              for name, path in EXECUTABLES.items()}
            r["exe_files"] = {name: sum(1 for f in files if f == path or f.startswith(path + "/"))
                              for name, path in EXECUTABLES.items()}
            weights = art / EXECUTABLES["rank0 weights"]
            written = stored_bytes(weights) if weights.is_file() else (0, 0)
            r["written_tensor_bytes"], r["header_bytes"] = written
            try:
                r["warnings"] = list(json.loads(r.pop("stdout")).get("warnings", []))
            except json.JSONDecodeError:
                r["warnings"] = []
            r["stderr"] = r["stderr"].strip()[-2000:]
            runs[target].append(r)
            shutil.rmtree(art)
    row["cp_s"] = {c: min(w for w, _ in cp_runs[c]) for c in suffixes}
    rss = [r for c in suffixes for _, r in cp_runs[c] if r is not None]
    row["cp_peak_mb"] = max(rss) if rss else None
    for target in runs:
        if target in errors:
            row["targets"][target] = {"error": errors[target]}
            continue
        best = min(runs[target], key=lambda r: r["seconds"])
        t = {k: v for k, v in best.items() if k not in ("peak_mb", "peak_anon_mb", "peak_file_mb")}
        for k in ("peak_mb", "peak_anon_mb", "peak_file_mb"):
            t[k] = max(r[k] for r in runs[target])
        _, _, out = timed_child([sys.executable, __file__, "--measure-plan", str(ckpt),
                                 base_target(target).partition("+")[0]])
        t["plan"] = json.loads(out)
        cats = t["plan"]["by_category"]
        t["planned_bytes"] = cats["weights"] + cats["lora"]
        t["plan_equal"] = t["planned_bytes"] == t["written_tensor_bytes"]
        row["targets"][target] = t
    if profile and "cuda" in targets and "cuda" not in errors:  # the default executables
        stats = root / "compile.prof"
        try:
            timed_child([sys.executable, __file__, "--measure-profile", str(ckpt), str(art), str(stats)])
            row["profile"], _ = profile_top(stats, PROFILE_LINES)
        except RuntimeError as e:
            row["profile"] = f"(profiling failed: {e})"
        shutil.rmtree(art, ignore_errors=True)
    shutil.rmtree(ckpt)
    return row


def ratio(row: dict[str, Any], key: str) -> float | None:
    """A run's seconds over cp's in the same regime (None when it failed or did not run)."""
    t = row["targets"].get(key, {})
    return t["seconds"] / row["cp_s"][regime(key)] if "seconds" in t else None


def _ratio_text(row: dict[str, Any], key: str) -> str:
    r = ratio(row, key)
    return "FAILED" if r is None else f"{r:.1f}x"


def _gb(b: float) -> str:
    return f"{b / 1e9:.3f}"


def time_table(rows: list[dict[str, Any]], bases: dict[str, dict[str, Any]]) -> str:
    body = []
    for r in rows:
        name, gb = f"{r['ckpt_bytes'] / 1e9:.2f} GB", r["ckpt_bytes"] / 1e9
        cp_rss = "-" if r["cp_peak_mb"] is None else f"{r['cp_peak_mb']:.1f} MB"
        for c, cp_s in r["cp_s"].items():
            body.append([name, f"cp -r (peer){c}", f"{cp_s:.2f}", f"{gb / cp_s:.2f}", "1.00x", cp_rss, "-",
                         "-", "-", "-"])
        for target, t in r["targets"].items():
            label = f"compile {target} {QUANT}"
            if "error" in t:
                body.append([name, label, "FAILED"] + ["-"] * 7)
                continue
            over_cp = t["seconds"] / r["cp_s"][regime(target)]
            base = bases[base_target(target).partition("+")[0]]
            body.append([
                name, label, f"{t['seconds']:.2f}", f"{gb / t['seconds']:.2f}",
                f"{over_cp:.1f}x" + ("" if over_cp <= GOAL_CP_RATIO else " ✗"), f"{t['peak_mb']:.0f} MB",
                f"{t['peak_mb'] - base['baseline_mb']:.0f} MB",
                f"{t['peak_anon_mb'] - base['baseline_anon_mb']:.0f} MB",
                f"{t['peak_file_mb'] - base['baseline_file_mb']:.0f} MB",
                f"{t['peak_mb'] * 2**20 / r['ckpt_bytes']:.2f}x",
            ])
    return _table(["checkpoint", "writer", "seconds", "GB/s", "/ cp", "peak RSS", "over base",
                   "anon over base", "file over base", "RSS / ckpt bytes"], body)


def bytes_table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        name = f"{r['ckpt_bytes'] / 1e9:.2f} GB"
        for target, t in r["targets"].items():
            if "error" in t:
                continue
            w = t["exe_bytes"]["rank0 weights"]
            cells = [name, target]
            for exe in EXECUTABLES:
                b = t["exe_bytes"][exe]
                cells.append("-" if not t["exe_files"][exe] else
                             f"{_gb(b)}" + ("" if exe == "rank0 weights" or not w else f" ({b / w:.2f}x)"))
            total = t["artifact_bytes"]
            cells += [f"{_gb(total)} ({total / w:.2f}x)" if w else _gb(total),
                      f"{w / r['ckpt_bytes']:.3f}x", str(t["planned_bytes"]), str(t["written_tensor_bytes"]),
                      f"{w} (+{t['header_bytes']} header)", "✓" if t["plan_equal"] else "✗"]
            body.append(cells)
    return _table(["checkpoint", "target", "rank0 weights GB", "onnx GB (/ weights)", "paddle GB (/ weights)",
                   "artifact GB (/ weights)", "weights / ckpt", "planned weights B", "written tensors B",
                   "weights file B", "plan = written"], body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,2.5",
                        help="checkpoint sizes in GB, comma-separated (default 1,2.5)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size of the dense checkpoints")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help="compile targets (default cuda,ascend); target+executable adds --emit "
                             "executable, e.g. cuda+onnx")
    parser.add_argument("--repeat", type=int, default=2,
                        help="timed compiles per target and checkpoint (best of; default 2)")
    parser.add_argument("--cache", default="hot,disk",
                        help="where the checkpoint is read from: hot (the page cache), disk (dropped "
                             "from the page cache before each timed run) or both (default hot,disk)")
    parser.add_argument("--quick", action="store_true",
                        help="0.15 and 0.4 GB, hidden 1024, one repeat (< 1 min)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile one more cuda compile of the largest checkpoint")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument("--measure-plan", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--measure-profile", nargs=3, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_plan is not None:
        print(json.dumps(measure_plan(Path(args.measure_plan[0]), args.measure_plan[1])))
        return
    if args.measure_profile is not None:
        measure_profile(*args.measure_profile)
        return
    sizes = [float(s) for s in args.sizes.split(",")]
    if args.quick:
        sizes, args.hidden, args.repeat = [0.15, 0.4], min(args.hidden, 1024), 1
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    caches = [c.strip() for c in args.cache.split(",") if c.strip()]
    if not caches or any(c not in CACHES for c in caches):
        parser.error(f"--cache {args.cache!r}: choose hot, disk or hot,disk")
    root = Path(tempfile.mkdtemp(prefix="ernie-ir-compile-", dir=args.dir))
    try:
        bases = measure_baseline(root)
        rows = [run_checkpoint(root, gb, args.hidden, targets, max(1, args.repeat),
                               args.profile and i == len(sizes) - 1, caches) for i, gb in enumerate(sizes)]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    big = rows[-1]
    print(f"checkpoints: ERNIE 4.5 dense, Paddle layout, bf16, hidden {args.hidden}, "
          + ", ".join(f"{r['layers']} layers = {r['ckpt_files']} file(s) {r['ckpt_bytes'] / 1e9:.3f} GB "
                      f"(generated in {r['write_s']:.1f} s)" for r in rows)
          + f"; largest tensor {big['largest_tensor_bytes'] / 1e6:.0f} MB; --quant {QUANT}, single rank; "
          f"compile: best of {max(1, args.repeat)}, cp: best of {CP_REPEAT * max(1, args.repeat)}")
    print(time_table(rows, bases))
    print(f"(seconds: the CLI process, wall; peak RSS: /usr/bin/time %M; anon / file: RssAnon / RssFile "
          f"peaks sampled every 10 ms; base: the peak of compiling a one-layer checkpoint of "
          f"{bases['bytes'] / 1e6:.0f} MB the same way ("
          + ", ".join(f"{t} {bases[t]['baseline_mb']:.0f} MB, anon {bases[t]['baseline_anon_mb']:.0f}, file "
                      f"{bases[t]['baseline_file_mb']:.0f}" for t in TARGETS) + "); "
          f"✗: over the goal of {GOAL_CP_RATIO:.0f}x cp)\n")
    print(bytes_table(rows))
    print("(planned: plan_memory(DIR, target, quant) rank 0 weights + lora; written: tensor bytes in "
          "rank0/weights.safetensors by its header's data offsets; the file adds its header)")
    for r in rows:
        for target, t in r["targets"].items():
            if "error" in t:
                print(f"compile {target} of {r['ckpt_bytes'] / 1e9:.2f} GB FAILED: {t['error']}")
    warned = set()
    for r in rows:
        for t in r["targets"].values():
            for w in t.get("warnings", []):
                if w not in warned:
                    warned.add(w)
                    print(f"compile warning: {w}")
    if "profile" in big:
        print(f"\ncuda compile profile, {big['ckpt_bytes'] / 1e9:.2f} GB (cumulative, "
              f"top {PROFILE_LINES}):\n"
              f"{big['profile']}")

    parts = []
    small = rows[0]
    suffixes = [CACHES[c] for c in caches]
    for target in targets:
        if any("error" in r["targets"][target + c] for r in (small, big) for c in suffixes):
            parts.append(f"{target} FAILED")
            continue
        times = ", ".join(
            f"{_ratio_text(big, target + c)} cp -r{c} ({_ratio_text(big, target + WARM + c)} with the source "
            f"digests kept; {_ratio_text(small, target + c)} at {small['ckpt_bytes'] / 1e9:.2f} GB)"
            for c in suffixes)
        tb = big["targets"][target + suffixes[0]]
        over = [r["targets"][target + suffixes[0]]["peak_mb"] - bases[target.partition("+")[0]]["baseline_mb"]
                for r in (small, big)]
        parts.append(
            f"{target} at {big['ckpt_bytes'] / 1e9:.2f} GB: {times}; goal {GOAL_CP_RATIO:.0f}x; peak RSS "
            f"{tb['peak_mb'] * 2**20 / big['ckpt_bytes']:.2f}x the checkpoint, over base {over[0]:.0f} -> "
            f"{over[1]:.0f} MB for {big['ckpt_bytes'] / small['ckpt_bytes']:.1f}x the bytes "
            f"({over[1] * 2**20 / big['largest_tensor_bytes']:.1f}x the largest tensor), artifact "
            f"{tb['artifact_bytes'] / tb['exe_bytes']['rank0 weights']:.2f}x the rank weights")
    equal = all(t.get("plan_equal", False) for r in rows for t in r["targets"].values())
    parts.append(f"planned rank weights = written: {'✓' if equal else '✗'}")
    print("\n" + "; ".join(parts))
    if args.json:
        print(json.dumps({"baseline": bases, "checkpoints": rows}, indent=1))


if __name__ == "__main__":
    main()
