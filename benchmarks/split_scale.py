"""Tensor/expert parallel split at scale: the 300B graph at @meta, and rank shards of a multi-GB checkpoint.

Two measurements, in one run, each case in a fresh process (its peak RSS is its own):

1. `ernie-4.5-300b-a47b@meta` (the full 300B-A47B structure, no weights): the time of
   `load_input` (building the graph), then of `split_graph(graph, mapping_for(graph, tp, ep))`
   for tp=8, for ep=8 and for tp=8 after `run_pipeline(graph, "wint8mix")` (a failure of
   either step is printed as FAILED with its error, not skipped), and the peak RSS (VmHWM
   after the first, cold round). Times: the first round / the best of 5 (or --repeat, at least 3) in
   that process. The peer figure is split time / graph build time (same graph, same process).
2. Generated ERNIE 4.5 dense checkpoints (Paddle layout, bf16, ~1 GB shards with
   model.safetensors.index.json; the large one --gb, default ~2 GB, and one a quarter of it,
   under a temp dir that is deleted after): `compile_model(folder, "ascend", tp=2, out=...)`
   (no quant: loading, splitting and streaming rank{r}/weights.safetensors), timed inside
   its own process, against `cp -r` of the same folder. `cp -r` runs once untimed first so
   that both read the checkpoint from the page cache, and `sync` runs (untimed) before each
   timed copy so neither pays for the other's writeback; best of --repeat pairs. Reported:
   time and peak RSS of each (compile: VmHWM, and RssAnon / RssFile sampled every 10 ms;
   cp: /usr/bin/time), compile / cp, the bytes of the rank weight files against the
   checkpoint's, and how compile's peak RSS over its baseline grows from the small
   checkpoint to the large one. A compile that fails or takes > 10x cp is profiled
   (cProfile, top 15 by cumulative time; --profile always does).

    python benchmarks/split_scale.py [--gb 2] [--hidden 2048] [--repeat 5] [--dir DIR] [--profile] [--json]
    python benchmarks/split_scale.py --quick   # 0.3 GB, hidden 1024, one repeat: < 1 min

Goal: each rank's split costs about one graph build; compile within a few times cp -r;
peak RSS over the baseline about a tensor, not about the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

META_MODEL = "ernie-4.5-300b-a47b@meta"
META_CASES: dict[str, dict[str, Any]] = {
    "tp=8": {"tp": 8, "ep": 1, "quant": None},
    "ep=8": {"tp": 1, "ep": 8, "quant": None},
    "wint8mix, tp=8": {"tp": 8, "ep": 1, "quant": "wint8mix"},
}
TP = 2

# -- checkpoint generation (parent process) ------------------------------------------------------------


def dense_config(gb: float, hidden: int) -> dict[str, Any]:
    """An ERNIE 4.5 dense config of `hidden` width with as many layers as make about `gb` GB in bf16."""
    heads, kv, vocab, inter = hidden // 128, 4, 32000, 3 * hidden
    per_layer = 2 * (hidden * (heads + 2 * kv) * 128 + heads * 128 * hidden + 3 * hidden * inter + 2 * hidden)
    layers = max(1, round((gb * 1e9 - 2 * vocab * hidden) / per_layer))
    return {
        "architectures": ["Ernie4_5_ForCausalLM"], "model_type": "ernie4_5", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": 128, "vocab_size": vocab, "max_position_embeddings": 4096,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True,
        "use_bias": False, "torch_dtype": "bfloat16",
    }


def tensor_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], Any]]:
    """(key, shape, numpy dtype) of every tensor of the dense checkpoint, Paddle layout ([in, out])."""
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, inter, bf = cfg["head_dim"], cfg["intermediate_size"], ml_dtypes.bfloat16
    specs: list[tuple[str, tuple[int, ...], Any]] = [
        ("ernie.embed_tokens.weight", (cfg["vocab_size"], h), bf),
    ]
    for i in range(cfg["num_hidden_layers"]):
        p = f"ernie.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), bf),
            (p + "post_attention_layernorm.weight", (h,), bf),
            (p + "self_attn.qkv_proj.weight", (h, (nh + 2 * nkv) * hd), bf),
            (p + "self_attn.o_proj.weight", (nh * hd, h), bf),
            (p + "mlp.up_gate_proj.weight", (h, 2 * inter), bf),
            (p + "mlp.down_proj.weight", (inter, h), bf),
        ]
    specs.append(("ernie.norm.weight", (h,), bf))
    return specs


def write_checkpoint(folder: Path, cfg: dict[str, Any]) -> None:
    """Sharded safetensors with an index (import_scale's writer); values are a random block repeated."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from import_scale import write_tensors

    write_tensors(folder, cfg, tensor_specs(cfg), scale=0.02)


# -- measurement (child processes) -----------------------------------------------------------------------


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure_meta(case: str, repeat: int) -> dict[str, Any]:
    """Run in a fresh process: build the @meta graph, (quantize,) split. The first round is the cold one
    (its peak RSS is the one reported); the best of `repeat` rounds is reported too."""
    import gc

    import ernie_ir  # noqa: F401  (the baseline includes the op set)
    from ernie_ir.load import load_input
    from ernie_ir.passes import run_pipeline
    from ernie_ir.passes.parallel.split import mapping_for, split_graph

    spec = META_CASES[case]
    baseline_kb = _status_kb("VmRSS")
    row: dict[str, Any] = {"case": case, "error": None}
    times: dict[str, list[float]] = {"build_s": [], "quant_s": [], "split_s": []}
    for _ in range(repeat):
        start = time.perf_counter()
        graph = load_input(META_MODEL)
        times["build_s"].append(time.perf_counter() - start)
        row.update(nodes=len(graph), params=len(graph.params))
        if spec["quant"] is not None:
            start = time.perf_counter()
            try:
                run_pipeline(graph, spec["quant"])
            except Exception as e:
                row["error"] = f"{spec['quant']} on a meta graph: {type(e).__name__}: {e}"
            times["quant_s"].append(time.perf_counter() - start)
        if row["error"] is None:
            start = time.perf_counter()
            try:
                ranks = split_graph(graph, mapping_for(graph, spec["tp"], spec["ep"]))
            except Exception as e:
                row["error"] = f"split: {type(e).__name__}: {e}"
            else:
                times["split_s"].append(time.perf_counter() - start)
                row.update(world=len(ranks), rank_nodes=len(ranks[0]), rank_params=len(ranks[0].params),
                           quantized_params=sum(1 for p in graph.params.values()
                                                if str(p.type.dtype) in ("i8", "i4")))
                del ranks
        if "peak_mb" not in row:
            row["peak_mb"] = _status_kb("VmHWM") / 1024
        del graph
        gc.collect()
        if row["error"] is not None:
            break
    for key, values in times.items():
        if values:
            row[key], row["best_" + key] = values[0], min(values)
    row["baseline_mb"] = baseline_kb / 1024
    return row


def measure_compile(folder: Path, out: Path, profile: Path | None) -> dict[str, Any]:
    """Run in a fresh process: compile_model(folder, "ascend", tp=2) with the imports as the baseline."""
    from ernie_ir.backends.paddle.emit import paddle_available
    from ernie_ir.targets.compile import CompileOptions, compile_model

    paddle_available()  # imports Paddle (if installed) before the baseline, as compile does
    baseline_kb = _status_kb("VmRSS")
    base_anon, base_file = _status_kb("RssAnon"), _status_kb("RssFile")
    peaks = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def sample() -> None:  # VmHWM has no anonymous / file-backed split: sample both every 10 ms
        while not done.wait(0.01):
            for line in Path("/proc/self/status").read_text().splitlines():
                key = line.split(":", 1)[0]
                if key in peaks:
                    peaks[key] = max(peaks[key], int(line.split()[1]))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    if profile is not None:
        import cProfile

        prof = cProfile.Profile()
        report = prof.runcall(compile_model, str(folder), "ascend", tp=TP, out=out)
        prof.dump_stats(str(profile))
    else:
        report = compile_model(str(folder), "ascend", CompileOptions(tp=TP, out=out))
    compile_s = time.perf_counter() - start
    done.set()
    sampler.join()
    return {"compile_s": compile_s, "baseline_mb": baseline_kb / 1024, "peak_mb": _status_kb("VmHWM") / 1024,
            "baseline_anon_mb": base_anon / 1024, "baseline_file_mb": base_file / 1024,
            "peak_anon_mb": peaks["RssAnon"] / 1024, "peak_file_mb": peaks["RssFile"] / 1024,
            "parallel": report.parallel, "warnings": report.warnings}


def timed_child(cmd: list[str], *, gnu_time: bool = False) -> tuple[float, float | None, str]:
    """(wall seconds, peak RSS MB or None, stdout) of a child process. With `gnu_time`, the peak RSS
    is the one process's own, from /usr/bin/time (ru_maxrss via wait4 from this process would count
    this interpreter's pages, which the child holds between fork and exec)."""
    gtime = shutil.which("time") if gnu_time else None
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = Path(tmp) / "maxrss"
        full = [gtime, "-f", "%M", "-o", str(rss_file), *cmd] if gtime else cmd
        start = time.perf_counter()
        proc = subprocess.run(full, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: "
                               f"{proc.stderr.strip()[-3000:]}")
        rss = int(rss_file.read_text().split()[-1]) / 1024 if gtime else None
        return wall, rss, proc.stdout


# -- driver ----------------------------------------------------------------------------------------------


def run_meta(repeat: int) -> list[dict[str, Any]]:
    rows = []
    for case in META_CASES:
        wall, _, out = timed_child([sys.executable, __file__, "--measure-meta", case, str(repeat)])
        rows.append({**json.loads(out), "process_s": wall})
    return rows


def _tree_bytes(folder: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in folder.rglob(pattern) if p.is_file())


def run_checkpoint(root: Path, gb: float, hidden: int, repeat: int, profile: bool) -> dict[str, Any]:
    """Generate one checkpoint, time cp -r and compile (best of `repeat`), delete it."""
    cfg = dense_config(gb, hidden)
    ckpt, copy, art = root / "checkpoint", root / "copy", root / "artifact"
    start = time.perf_counter()
    write_checkpoint(ckpt, cfg)
    row: dict[str, Any] = {
        "layers": cfg["num_hidden_layers"], "hidden": hidden, "write_s": time.perf_counter() - start,
        "ckpt_bytes": _tree_bytes(ckpt, "*.safetensors"), "ckpt_files": len(list(ckpt.glob("*.safetensors"))),
        "largest_tensor_bytes": max(math.prod(s) * np.dtype(d).itemsize for _, s, d in tensor_specs(cfg)),
        "error": None, "slow": False,
    }
    subprocess.run(["cp", "-r", str(ckpt), str(copy)], check=True)  # warm the page cache, untimed
    shutil.rmtree(copy)
    cp_runs: list[tuple[float, float | None]] = []
    compile_runs: list[dict[str, Any]] = []
    for _ in range(repeat):
        os.sync()
        wall, rss, _ = timed_child(["cp", "-r", str(ckpt), str(copy)], gnu_time=True)
        cp_runs.append((wall, rss))
        row["cp_bytes"] = _tree_bytes(copy, "*.safetensors")
        shutil.rmtree(copy)
        os.sync()
        try:
            wall, _, out = timed_child([sys.executable, __file__, "--measure-compile", str(ckpt), str(art)])
        except RuntimeError as e:
            row["error"] = str(e)
            break
        compile_runs.append({**json.loads(out), "process_s": wall})
        row["rank_weight_bytes"] = _tree_bytes(art, "weights.safetensors")
        row["rank_files"] = len(list(art.glob("rank*/weights.safetensors")))
        row["artifact_bytes"] = _tree_bytes(art)
        shutil.rmtree(art)
    row["cp_s"] = min(w for w, _ in cp_runs)
    rss = [r for _, r in cp_runs if r is not None]
    row["cp_peak_mb"] = max(rss) if rss else None
    if compile_runs:
        best = min(compile_runs, key=lambda r: r["compile_s"])
        row.update({k: best[k] for k in ("compile_s", "process_s", "baseline_mb", "baseline_anon_mb",
                                         "baseline_file_mb", "parallel", "warnings")})
        for k in ("peak_mb", "peak_anon_mb", "peak_file_mb"):
            row[k] = max(r[k] for r in compile_runs)
        row["slow"] = row["compile_s"] > 10 * row["cp_s"]
    if profile or row["error"] is not None or row["slow"]:
        stats = root / "compile.prof"
        try:
            timed_child([sys.executable, __file__, "--measure-compile", str(ckpt), str(art),
                         "--profile-to", str(stats)])
            row["profile"], row["hashing"] = profile_top(stats, 15)
        except RuntimeError as e:
            row["profile"], row["hashing"] = f"(profiling failed too: {e})", ""
        shutil.rmtree(art, ignore_errors=True)
    shutil.rmtree(ckpt)
    return row


def profile_top(stats: Path, lines: int) -> tuple[str, str]:
    """The top `lines` by cumulative time, and a line on how much of it is sha256 of whole files."""
    import io
    import pstats

    buf = io.StringIO()
    st = pstats.Stats(str(stats), stream=buf)
    st.sort_stats("cumulative").print_stats(lines)
    text = buf.getvalue()
    total = max(v[3] for v in st.stats.values())  # type: ignore[attr-defined]
    hashing = ""
    for (file, line, func), (_, _, _, cum, callers) in st.stats.items():  # type: ignore[attr-defined]
        if func == "sha256_file":
            by = ", ".join(f"{Path(f).name}:{n} {c[3]:.2f} s" for (f, n, _), c in
                           sorted(callers.items(), key=lambda kv: -kv[1][3]))
            hashing = (f"{Path(file).name}:{line} sha256_file: {cum:.2f} s of {total:.2f} s under the "
                       f"profiler ({cum / total:.0%}), called from {by}")
    return text[text.find("   ncalls"):].rstrip(), hashing


def _table(head: list[str], body: list[list[str]]) -> str:
    lines = [head, *body]
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in lines]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)


def meta_table(rows: list[dict[str, Any]]) -> str:
    def pair(r: dict[str, Any], key: str) -> str:
        return "-" if r.get(key) is None else f"{r[key]:.3f} / {r['best_' + key]:.3f}"

    body = []
    for r in rows:
        if r["error"] is not None:
            body.append([r["case"], str(r["nodes"]), pair(r, "build_s"), pair(r, "quant_s"), "FAILED", "-",
                         "-", "-", "-", f"{r['peak_mb']:.0f} MB", f"{r['baseline_mb']:.0f} MB"])
            continue
        body.append([
            r["case"], str(r["nodes"]), pair(r, "build_s"), pair(r, "quant_s"), pair(r, "split_s"),
            f"{r['best_split_s'] / r['world']:.3f}", f"{r['world']} x {r['rank_nodes']}",
            f"{r['rank_params']}",
            f"{r['split_s'] / r['build_s']:.2f}x / {r['best_split_s'] / r['best_build_s']:.2f}x",
            f"{r['peak_mb']:.0f} MB", f"{r['baseline_mb']:.0f} MB",
        ])
    return _table(["300B-A47B @meta", "nodes", "build s", "wint8mix s", "split s", "split s/rank",
                   "ranks x nodes", "params/rank", "split / build", "peak RSS", "baseline"], body)


def ckpt_table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        gb = r["ckpt_bytes"] / 1e9
        name = f"{gb:.2f} GB"
        cp_rss = "-" if r["cp_peak_mb"] is None else f"{r['cp_peak_mb']:.1f} MB"
        body.append([name, "cp -r (peer)", f"{r['cp_s']:.2f}", f"{gb / r['cp_s']:.2f}", cp_rss, "-", "-", "-",
                     f"{r['cp_bytes'] / 1e9:.3f}", "1.00x"])
        if "compile_s" not in r:
            body.append([name, f"compile tp={TP}", "FAILED"] + ["-"] * 7)
            continue
        body.append([
            name, f"compile ascend tp={TP}", f"{r['compile_s']:.2f}", f"{gb / r['compile_s']:.2f}",
            f"{r['peak_mb']:.0f} MB", f"{r['peak_mb'] - r['baseline_mb']:.0f} MB",
            f"{r['peak_anon_mb'] - r['baseline_anon_mb']:.0f} MB",
            f"{r['peak_file_mb'] - r['baseline_file_mb']:.0f} MB", f"{r['rank_weight_bytes'] / 1e9:.3f}",
            f"{r['compile_s'] / r['cp_s']:.2f}x" + (" SLOW" if r["slow"] else ""),
        ])
    return _table(["checkpoint", "writer", "seconds", "GB/s", "peak RSS", "over base", "anon over base",
                   "file over base", "GB written", "time / cp"], body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0,
                        help="size of the large checkpoint in GB (default 2; a quarter-size one runs too)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size of the dense checkpoints")
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed cp / compile pairs per checkpoint (best of; default 5)")
    parser.add_argument("--quick", action="store_true", help="0.3 GB, hidden 1024, one repeat (< 1 min)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile one more compile of the large checkpoint (always done when it "
                             "fails or takes > 10x cp)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument("--measure-meta", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--measure-compile", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_meta is not None:
        print(json.dumps(measure_meta(args.measure_meta[0], int(args.measure_meta[1]))))
        return
    if args.measure_compile is not None:
        print(json.dumps(measure_compile(*args.measure_compile, args.profile_to)))
        return
    if args.quick:
        args.gb, args.hidden, args.repeat = min(args.gb, 0.3), min(args.hidden, 1024), 1
    meta = run_meta(max(3, args.repeat))
    root = Path(tempfile.mkdtemp(prefix="ernie-ir-split-", dir=args.dir))
    try:  # a quarter-size checkpoint too: peak RSS against the bytes
        ckpts = [run_checkpoint(root, gb, args.hidden, args.repeat, args.profile and gb == args.gb)
                 for gb in (args.gb / 4, args.gb)]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(meta_table(meta))
    print(f"(seconds: first (cold) / best of {max(3, args.repeat)} rounds in the case's own process; "
          "peak RSS: VmHWM after the first round; baseline: after importing ernie_ir)")
    for r in meta:
        if r["error"] is not None:
            print(f"{r['case']}: FAILED: {r['error']}")
    wq = next(r for r in meta if META_CASES[r["case"]]["quant"] is not None)
    if wq["error"] is None:
        print(f"wint8mix on the @meta graph works: {wq['quantized_params']} params quantized in "
              f"{wq['quant_s']:.3f} s")
    big = ckpts[-1]
    print(f"\ncheckpoints: ERNIE 4.5 dense, Paddle layout, bf16, hidden {big['hidden']}, "
          + ", ".join(f"{r['layers']} layers = {r['ckpt_files']} file(s) {r['ckpt_bytes'] / 1e9:.3f} GB "
                      f"(generated in {r['write_s']:.1f} s)" for r in ckpts)
          + f"; largest tensor {big['largest_tensor_bytes'] / 1e6:.0f} MB; best of {args.repeat}")
    print(ckpt_table(ckpts))
    print("(peak RSS: VmHWM of the compile process, baseline = interpreter + ernie_ir + Paddle imports; "
          "anon/file: RssAnon/RssFile peaks sampled every 10 ms; cp: /usr/bin/time %M)")
    for r in ckpts:
        if r["error"] is not None:
            print(f"compile of {r['ckpt_bytes'] / 1e9:.2f} GB FAILED: {r['error']}")
        elif r["slow"]:
            print(f"compile of {r['ckpt_bytes'] / 1e9:.2f} GB is SLOW: {r['compile_s'] / r['cp_s']:.1f}x "
                  "cp -r (> 10x)")
    for w in big.get("warnings", []):
        print(f"compile warning: {w}")
    if "profile" in big:
        print(f"\ncompile profile, {big['ckpt_bytes'] / 1e9:.2f} GB (cumulative, top 15):\n{big['profile']}")
        if big["hashing"]:
            print(big["hashing"])

    ok = [r for r in meta if r["error"] is None]
    parts = ["split / build (300B @meta, cold (best)): "
             + ", ".join(f"{r['case']} {r['split_s'] / r['build_s']:.2f}x "
                         f"({r['best_split_s'] / r['best_build_s']:.2f}x)" for r in ok)]
    parts += [f"{r['case']} FAILED" for r in meta if r["error"] is not None]
    if all("compile_s" in r for r in ckpts):
        small = ckpts[0]
        over = [r["peak_mb"] - r["baseline_mb"] for r in ckpts]
        anon = [r["peak_anon_mb"] - r["baseline_anon_mb"] for r in ckpts]
        parts.append(
            f"compile tp={TP} / cp -r: {big['compile_s'] / big['cp_s']:.2f}x at "
            f"{big['ckpt_bytes'] / 1e9:.2f} GB ({small['compile_s'] / small['cp_s']:.2f}x at "
            f"{small['ckpt_bytes'] / 1e9:.2f} GB); wrote {big['rank_weight_bytes'] / big['ckpt_bytes']:.3f}x "
            f"the checkpoint bytes; peak RSS over baseline {over[0]:.0f} -> {over[1]:.0f} MB for "
            f"{big['ckpt_bytes'] / small['ckpt_bytes']:.1f}x the bytes "
            f"({over[1] * 2**20 / big['ckpt_bytes']:.2f}x the checkpoint; anonymous {anon[0]:.0f} -> "
            f"{anon[1]:.0f} MB = "
            f"{anon[1] * 2**20 / big['largest_tensor_bytes']:.2f}x the largest tensor)")
    else:
        parts.append("compile FAILED")
    print("\n" + "; ".join(parts))
    if args.json:
        print(json.dumps({"meta": meta, "checkpoints": ckpts}, indent=1))


if __name__ == "__main__":
    main()
