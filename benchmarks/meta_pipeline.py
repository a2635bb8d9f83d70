"""The 300B model without weights through the whole compile pipeline: time and peak RSS per stage.

`ernie-4.5-300b-a47b@meta` (the full 300B-A47B structure, no weights) through wint8mix + LoRA
(rank 8) + tp=8 split + legalize-cuda, in one run, each case in a fresh process (its peak RSS
is its own):

1. pipeline: `load_input` (building the graph: the peer), then `run_pipeline_ranks(graph,
   PIPELINE)` with an instrument that times each pass and takes its peak RSS (VmHWM, reset
   through /proc/self/clear_refs before each pass, and RssAnon / RssFile sampled every 10 ms).
   The passes after the split run once per rank: their row is the sum over the 8 ranks. Pass
   times include the manager's debug checks (verification and the changed-fingerprint after
   every pass, as `compile` runs them); one more round with debug=False gives the share of those.
2. compile: `compile_model(MODEL, "cuda", quant="wint8mix", lora_rank=8, tp=8, out=tmp)` end to
   end (a graph-only artifact: manifest + per-rank graph.ir), against the issue's goal
   (< 10 s, < 2 GB peak RSS); then `plan_memory` of the artifact written, as a cross-check.
3. plan: `plan_memory(MODEL, "cuda", CompileOptions(quant="wint8mix", lora_rank=8, tp=8))` (the same
   configuration; inference, seq 4096, batch 1).

Times: the first (cold) round / the best of --repeat (default 3) rounds in the case's own
process; peak RSS from the first round. Ratios: stage time / graph build time (same round of
the pipeline process).

    python benchmarks/meta_pipeline.py [--repeat 3] [--json]
    python benchmarks/meta_pipeline.py --quick   # one round per case: < 1 min

Goal: the whole compile in < 10 s and < 2 GB RSS; every stage about a graph build or less.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from split_scale import _status_kb, _table, timed_child

MODEL = "ernie-4.5-300b-a47b@meta"
TARGET, QUANT, LORA_RANK, TP = "cuda", "wint8mix", 8, 8
PIPELINE = (f"quant-annotate{{preset={QUANT}}},weight-only-quant,lora{{rank={LORA_RANK}}},split{{tp={TP}}},"
            f"legalize-{TARGET}")
GOAL_S, GOAL_BYTES = 10.0, 2e9
CASES = ("pipeline", "compile", "plan")
MiB = 1024 * 1024


# -- memory measurement (shared with compile_scale.py) ----------------------------------------------------


class RssSampler:
    """Peaks of VmRSS / RssAnon / RssFile (kB) of a process (`pid`, default this one), sampled
    every `interval` seconds on a thread: VmHWM has no anonymous / file-backed split. `reset()`
    starts new peaks (and returns the old ones); `stop()` returns the last ones."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile")

    def __init__(self, pid: int | str = "self", interval: float = 0.01) -> None:
        self.path = Path(f"/proc/{pid}/status")
        self.interval = interval
        self.peaks = dict.fromkeys(self.FIELDS, 0)
        self.last = dict.fromkeys(self.FIELDS, 0)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        try:
            text = self.path.read_text()
        except OSError:  # the process has exited
            return
        values = {}
        for line in text.splitlines():
            key = line.split(":", 1)[0]
            if key in self.last:
                values[key] = int(line.split()[1])
        with self._lock:
            for key, v in values.items():
                self.last[key] = v
                self.peaks[key] = max(self.peaks[key], v)

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            self.sample()

    def start(self) -> RssSampler:
        self.sample()
        self._thread.start()
        return self

    def reset(self) -> dict[str, int]:
        self.sample()
        with self._lock:
            old, self.peaks = self.peaks, dict(self.last)
        return old

    def stop(self) -> dict[str, int]:
        self._done.set()
        self._thread.join()
        self.sample()
        return dict(self.peaks)


def reset_hwm() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def tree_bytes(folder: Path) -> dict[str, int]:
    """Bytes of every file under `folder`, by relative path (a link is not a second copy)."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()}


# -- measurement (child processes) -------------------------------------------------------------------------


def _stage_instrument(sampler: RssSampler, hwm: bool):
    from ernie_ir.passes.infra.instruments import PassInstrument

    class StageInstrument(PassInstrument):
        """Seconds and peak RSS of each pass (summed / maxed over the ranks after a split)."""

        def __init__(self) -> None:
            self.rows: dict[int, dict[str, Any]] = {}
            self._t0 = 0.0

        def before_pass(self, index, p, graph) -> None:  # type: ignore[no-untyped-def]
            if hwm:
                reset_hwm()
            sampler.reset()
            self._t0 = time.perf_counter()

        def after_pass(self, index, p, graph, changed, ctx) -> None:  # type: ignore[no-untyped-def]
            seconds = time.perf_counter() - self._t0
            peaks = sampler.reset()
            row = self.rows.setdefault(index, {"stage": p.spec(), "runs": 0, "seconds": 0.0, "peak_kb": 0,
                                               "anon_kb": 0, "file_kb": 0})
            row["runs"] += 1
            row["seconds"] += seconds
            peak = _status_kb("VmHWM") if hwm else peaks["VmRSS"]
            row["peak_kb"] = max(row["peak_kb"], peak)
            row["anon_kb"] = max(row["anon_kb"], peaks["RssAnon"])
            row["file_kb"] = max(row["file_kb"], peaks["RssFile"])
            row["after_kb"] = _status_kb("VmRSS")
            row["nodes"] = len(graph)
            row["params"] = len(graph.params)

    return StageInstrument()


def measure_pipeline(repeat: int) -> dict[str, Any]:
    """Build the @meta graph and run the pipeline `repeat` times (first round cold), then once
    with debug=False."""
    import ernie_ir  # noqa: F401  (the baseline includes the op set)
    from ernie_ir.load import load_input
    from ernie_ir.passes.infra.manager import run_pipeline_ranks

    baseline_kb = _status_kb("VmRSS")
    hwm = reset_hwm()
    sampler = RssSampler().start()
    rounds = []
    for _ in range(repeat):
        gc.collect()
        if hwm:
            reset_hwm()
        sampler.reset()
        start = time.perf_counter()
        graph = load_input(MODEL)
        build = {"stage": "build (load_input, peer)", "runs": 1, "seconds": time.perf_counter() - start}
        peaks = sampler.reset()
        build.update(peak_kb=_status_kb("VmHWM") if hwm else peaks["VmRSS"], anon_kb=peaks["RssAnon"],
                     file_kb=peaks["RssFile"], after_kb=_status_kb("VmRSS"), nodes=len(graph),
                     params=len(graph.params))
        inst = _stage_instrument(sampler, hwm)
        start = time.perf_counter()
        ranked = run_pipeline_ranks(graph, PIPELINE, instruments=[inst])
        total = time.perf_counter() - start
        rounds.append({"stages": [build, *inst.rows.values()], "pipeline_s": total,
                       "ranks": len(ranked.ranks), "warnings": ranked.result.warnings})
        del graph, ranked
    gc.collect()
    graph = load_input(MODEL)
    start = time.perf_counter()
    run_pipeline_ranks(graph, PIPELINE, debug=False)
    nodebug_s = time.perf_counter() - start
    sampler.stop()
    first = rounds[0]
    stages = []
    for i, row in enumerate(first["stages"]):
        times = [r["stages"][i]["seconds"] for r in rounds]
        builds = [r["stages"][0]["seconds"] for r in rounds]
        stages.append({**row, "best_seconds": min(times), "ratio": row["seconds"] / builds[0],
                       "best_ratio": min(times) / min(builds)})
    return {"case": "pipeline", "stages": stages, "pipeline_s": first["pipeline_s"],
            "best_pipeline_s": min(r["pipeline_s"] for r in rounds), "nodebug_pipeline_s": nodebug_s,
            "ranks": first["ranks"], "warnings": first["warnings"], "hwm_reset": hwm,
            "baseline_mb": baseline_kb / 1024}


def measure_compile(repeat: int) -> dict[str, Any]:
    """compile_model end to end into a temp dir, `repeat` times; then plan the artifact."""
    from ernie_ir.planning import plan_memory
    from ernie_ir.targets.compile import CompileOptions, compile_model

    baseline_kb = _status_kb("VmRSS")
    sampler = RssSampler().start()
    root = Path(tempfile.mkdtemp(prefix="ernie-ir-meta-"))
    times, row = [], {}
    try:
        for i in range(repeat):
            out = root / f"artifact{i}"
            start = time.perf_counter()
            report = compile_model(MODEL, TARGET, CompileOptions(quant=QUANT, lora_rank=LORA_RANK, tp=TP,
                                   out=out))
            times.append(time.perf_counter() - start)
            if i == 0:
                peaks = sampler.reset()
                files = tree_bytes(out)
                manifest = json.loads((out / "manifest.json").read_text())
                weight_files = [f for f in files if f.endswith((".safetensors", ".pdiparams", ".data"))]
                row = {"peak_kb": _status_kb("VmHWM"), "anon_kb": peaks["RssAnon"],
                       "file_kb": peaks["RssFile"], "files": len(files),
                       "artifact_bytes": sum(files.values()),
                       "rank_graph_bytes": sum(b for f, b in files.items() if f.startswith("rank")),
                       "weight_files": weight_files,
                       "manifest_weights": manifest.get("weights"), "pipeline": report.pipeline,
                       "parallel": report.parallel, "warnings": report.warnings}
                start = time.perf_counter()
                plan = plan_memory(str(out), TARGET)
                row["artifact_plan_s"] = time.perf_counter() - start
                row["artifact_plan_rank_bytes"] = [r.by_category["weights"] + r.by_category["lora"]
                                                   for r in plan.per_rank]
            shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sampler.stop()
    return {"case": "compile", "seconds": times[0], "best_seconds": min(times), **row,
            "baseline_mb": baseline_kb / 1024}


def measure_plan(repeat: int) -> dict[str, Any]:
    """plan_memory of the same configuration, `repeat` times."""
    from ernie_ir.planning import plan_memory
    from ernie_ir.targets import CompileOptions

    baseline_kb = _status_kb("VmRSS")
    sampler = RssSampler().start()
    times, row = [], {}
    for i in range(repeat):
        start = time.perf_counter()
        plan = plan_memory(MODEL, TARGET, CompileOptions(quant=QUANT, lora_rank=LORA_RANK, tp=TP))
        times.append(time.perf_counter() - start)
        if i == 0:
            peaks = sampler.reset()
            r0 = plan.per_rank[0]
            row = {"peak_kb": _status_kb("VmHWM"), "anon_kb": peaks["RssAnon"], "file_kb": peaks["RssFile"],
                   "fits": plan.fits, "devices": plan.devices, "tp": plan.tp, "ep": plan.ep,
                   "device_memory_bytes": plan.device_memory_bytes, "max_rank_bytes": plan.max_rank_bytes,
                   "headroom_bytes": plan.headroom_bytes, "rank0": r0.by_category,
                   "rank0_total_bytes": r0.total_bytes, "pipeline": plan.pipeline,
                   "rank_bytes": [r.by_category["weights"] + r.by_category["lora"] for r in plan.per_rank]}
    sampler.stop()
    return {"case": "plan", "seconds": times[0], "best_seconds": min(times), **row,
            "baseline_mb": baseline_kb / 1024}


MEASURE = {"pipeline": measure_pipeline, "compile": measure_compile, "plan": measure_plan}


# -- driver ----------------------------------------------------------------------------------------------


def _mb(kb: int) -> str:
    return f"{kb / 1024:.0f} MB"


def stage_table(p: dict[str, Any]) -> str:
    body = [[s["stage"], str(s["runs"]), f"{s['seconds']:.3f} / {s['best_seconds']:.3f}",
             f"{s['ratio']:.2f}x / {s['best_ratio']:.2f}x", _mb(s["peak_kb"]), _mb(s["after_kb"]),
             _mb(s["anon_kb"]), _mb(s["file_kb"]), f"{s['nodes']} / {s['params']}"] for s in p["stages"]]
    passes = sum(s["seconds"] for s in p["stages"][1:])
    build = p["stages"][0]
    body.append(["manager (between passes)", "-", f"{p['pipeline_s'] - passes:.3f}"] + ["-"] * 6)
    body.append(["pipeline total", str(len(p["stages"]) - 1),
                 f"{p['pipeline_s']:.3f} / {p['best_pipeline_s']:.3f}",
                 f"{p['pipeline_s'] / build['seconds']:.2f}x / "
                 f"{p['best_pipeline_s'] / build['best_seconds']:.2f}x",
                 _mb(max(s["peak_kb"] for s in p["stages"])), _mb(p["stages"][-1]["after_kb"]), "-", "-",
                 f"{p['ranks']} ranks"])
    return _table(["300B-A47B @meta stage", "runs", "seconds", "/ build", "peak RSS", "RSS after",
                   "anon peak", "file peak", "nodes / params (rank 0)"], body)


def case_table(rows: dict[str, dict[str, Any]]) -> str:
    build = rows["pipeline"]["stages"][0]
    body = []
    for name, label in (("compile", "compile_model -> graph-only artifact"),
                        ("plan", "plan_memory (same configuration)")):
        r = rows[name]
        if "error" in r:
            body.append([label, "FAILED", "-", "-", "-", "-", "-"])
            continue
        goal = "-"
        if name == "compile":
            ok = r["seconds"] < GOAL_S and r["peak_kb"] * 1024 < GOAL_BYTES
            goal = f"< {GOAL_S:.0f} s, < {GOAL_BYTES / 1e9:.0f} GB: {'✓' if ok else '✗'}"
        body.append([label, f"{r['seconds']:.3f} / {r['best_seconds']:.3f}",
                     f"{r['seconds'] / build['seconds']:.2f}x / "
                     f"{r['best_seconds'] / build['best_seconds']:.2f}x",
                     _mb(r["peak_kb"]), _mb(r["anon_kb"]), _mb(r["file_kb"]), goal])
    return _table(["end to end", "seconds", "/ build", "peak RSS", "anon peak", "file peak", "goal"], body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="rounds per case (best of; default 3)")
    parser.add_argument("--quick", action="store_true", help="one round per case (< 1 min)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(MEASURE[args.measure[0]](int(args.measure[1]))))
        return
    repeat = 1 if args.quick else max(1, args.repeat)
    rows: dict[str, dict[str, Any]] = {}
    for case in CASES:
        try:
            wall, _, out = timed_child([sys.executable, __file__, "--measure", case, str(repeat)])
        except RuntimeError as e:
            if case == "pipeline":
                raise
            rows[case] = {"case": case, "error": str(e)}
            continue
        rows[case] = {**json.loads(out), "process_s": wall}

    p, c, pl = rows["pipeline"], rows["compile"], rows["plan"]
    print(f"{MODEL} -> {PIPELINE}")
    print(stage_table(p))
    print(f"(seconds: first (cold) / best of {repeat} rounds in the case's own process; the rows after the "
          f"split sum the {p['ranks']} ranks; pass times include the debug checks (verify + fingerprint), "
          f"the pipeline with debug=False takes {p['nodebug_pipeline_s']:.3f} s; peak RSS: "
          + ("VmHWM reset before each stage" if p["hwm_reset"] else "VmRSS sampled every 10 ms")
          + f"; anon / file: RssAnon / RssFile peaks sampled every 10 ms; baseline after importing "
          f"ernie_ir: {p['baseline_mb']:.0f} MB)\n")
    print(case_table(rows))
    for name in ("compile", "plan"):
        if "error" in rows[name]:
            print(f"{name} FAILED: {rows[name]['error']}")
    if "error" not in c:
        print(f"artifact: {c['files']} files, {c['artifact_bytes'] / 1e6:.1f} MB "
              f"({c['rank_graph_bytes'] / 1e6:.1f} MB of rank graphs), manifest weights="
              f"{c['manifest_weights']}, weight files: "
              f"{c['weight_files'] or 'none'}; {c['parallel']}")
        for w in c["warnings"]:
            print(f"compile warning: {w}")
    if "error" not in pl:
        cats = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in pl["rank0"].items() if v)
        print(f"plan: rank 0 {pl['rank0_total_bytes'] / 2**30:.2f} GiB ({cats}) of "
              f"{pl['device_memory_bytes'] / 2**30:.0f} GiB: fits={pl['fits']}, headroom "
              f"{pl['headroom_bytes'] / 2**30:.2f} GiB, {pl['devices']} devices "
              f"(tp {pl['tp']}, ep {pl['ep']})")
    same = None
    if "error" not in c and "error" not in pl:
        same = c["artifact_plan_rank_bytes"] == pl["rank_bytes"]
        print(f"plan of the written artifact ({c['artifact_plan_s']:.3f} s) vs plan of the model, weights + "
              f"lora per rank: {'equal ✓' if same else 'DIFFERENT ✗'} "
              f"({c['artifact_plan_rank_bytes'][0]} vs {pl['rank_bytes'][0]} B on rank 0)")

    build = p["stages"][0]
    worst = max(p["stages"][1:], key=lambda s: s["best_ratio"])
    parts = [f"300B @meta build {build['seconds']:.2f} s (best {build['best_seconds']:.2f}); pipeline "
             f"{p['best_pipeline_s']:.2f} s = {p['best_pipeline_s'] / build['best_seconds']:.1f}x build "
             f"(slowest stage {worst['stage']} {worst['best_ratio']:.2f}x over {worst['runs']} run(s)), peak "
             f"{max(s['peak_kb'] for s in p['stages']) / 1024:.0f} MB"]
    if "error" in c:
        parts.append("compile FAILED")
    else:
        ok = c["seconds"] < GOAL_S and c["peak_kb"] * 1024 < GOAL_BYTES
        parts.append(f"compile end to end {c['seconds']:.2f} s (best {c['best_seconds']:.2f}), peak "
                     f"{c['peak_kb'] / 1024:.0f} MB: goal < {GOAL_S:.0f} s, < {GOAL_BYTES / 1e9:.0f} GB "
                     + ("met ✓" if ok else "MISSED ✗"))
    parts.append("plan FAILED" if "error" in pl else
                 f"plan_memory {pl['best_seconds']:.2f} s, peak {pl['peak_kb'] / 1024:.0f} MB"
                 + ("" if same is None else f", artifact plan {'equal' if same else 'DIFFERENT'}"))
    print("\n" + "; ".join(parts))
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
