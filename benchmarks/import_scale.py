"""Checkpoint import at scale: graph build time and peak memory against the bytes on disk.

Generates ERNIE 4.5 MoE checkpoints (Paddle layout, bf16, per-expert tensors,
sharded ~1 GB files with model.safetensors.index.json) that share one
structure (same layers, experts and tensor count) and differ only in their
dims, from a few hundred MB to several GB. For each, a fresh process imports
the interpreter (its RSS is the baseline), then times `load_model(folder)`,
records the peak RSS above the baseline and the bytes the process read while
building, and then times the `safetensors` package opening the same files
(`safe_open` + `keys()`) and our own header reader. All in one run:

    python benchmarks/import_scale.py [--sizes small,medium,large] [--layout paddle|hf] [--dir DIR]

Goal: build time independent of the weight bytes; peak RSS under 300 MB above
the baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

SIZES: dict[str, dict[str, int]] = {
    # same structure (8 layers, 64 experts, MoE from layer 1), growing dims
    "small": {"hidden_size": 512, "moe_intermediate_size": 128, "intermediate_size": 1024},
    "medium": {"hidden_size": 1024, "moe_intermediate_size": 512, "intermediate_size": 2048},
    "large": {"hidden_size": 2048, "moe_intermediate_size": 768, "intermediate_size": 4096},
}
BASE_CONFIG: dict[str, Any] = {
    "architectures": ["Ernie4_5_MoeForCausalLM"], "num_hidden_layers": 8, "num_attention_heads": 16,
    "num_key_value_heads": 2, "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": True, "moe_num_experts": 64, "moe_k": 6, "moe_num_shared_experts": 2,
    "moe_layer_start_index": 1, "moe_use_aux_free": True, "torch_dtype": "bfloat16",
}
SHARD_BYTES = 1 << 30

# -- checkpoint generation (parent process) ------------------------------------------------------------


def tensor_specs(cfg: dict[str, Any], layout: str) -> list[tuple[str, tuple[int, ...], Any]]:
    """(key, shape, numpy dtype) of every tensor of the checkpoint, in the given layout."""
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, e, ie, inter = h // nh, cfg["moe_num_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    bf, f32 = ml_dtypes.bfloat16, np.float32
    pre = "ernie." if layout == "paddle" else "model."
    specs: list[tuple[str, tuple[int, ...], Any]] = [
        (pre + "embed_tokens.weight", (cfg["vocab_size"], h), bf),
    ]

    def linear(name: str, n_in: int, n_out: int) -> None:
        specs.append((name, (n_in, n_out) if layout == "paddle" else (n_out, n_in), bf))

    def swiglu(p: str, width: int) -> None:
        if layout == "paddle":
            linear(p + "up_gate_proj.weight", h, 2 * width)
        else:
            linear(p + "gate_proj.weight", h, width)
            linear(p + "up_proj.weight", h, width)
        linear(p + "down_proj.weight", width, h)

    for i in range(cfg["num_hidden_layers"]):
        p = f"{pre}layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,), bf), (p + "post_attention_layernorm.weight", (h,), bf)]
        if layout == "paddle":
            linear(p + "self_attn.qkv_proj.weight", h, (nh + 2 * nkv) * hd)
        else:
            linear(p + "self_attn.q_proj.weight", h, nh * hd)
            linear(p + "self_attn.k_proj.weight", h, nkv * hd)
            linear(p + "self_attn.v_proj.weight", h, nkv * hd)
        linear(p + "self_attn.o_proj.weight", nh * hd, h)
        if i < cfg["moe_layer_start_index"]:
            swiglu(p + "mlp.", inter)
            continue
        specs.append((p + "mlp.gate.weight", (h, e) if layout == "paddle" else (e, h), f32))
        specs.append((p + "mlp.moe_statics.e_score_correction_bias", (1, e), f32))
        for j in range(e):
            swiglu(f"{p}mlp.experts.{j}.", ie)
        swiglu(p + "mlp.shared_experts.", ie * cfg["moe_num_shared_experts"])
    specs.append((pre + "norm.weight", (h,), bf))
    return specs


def write_checkpoint(folder: Path, cfg: dict[str, Any], layout: str) -> None:
    """Sharded safetensors with an index; values are a random block repeated (content is irrelevant)."""
    write_tensors(folder, cfg, tensor_specs(cfg, layout))


def write_tensors(folder: Path, cfg: dict[str, Any], specs: list[tuple[str, tuple[int, ...], Any]],
                  scale: float = 1.0) -> None:
    """config.json plus `specs` (key, shape, dtype) as shards of SHARD_BYTES with an index; values
    are `scale` times a random block repeated (benchmarks/split_scale.py writes its checkpoints too)."""
    from ernie_ir.ir.weights import ArraySource, write_safetensors

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    block = (scale * np.random.default_rng(0).standard_normal(1 << 16)).astype(np.float32)
    shards: list[list[tuple[str, tuple[int, ...], Any]]] = [[]]
    size = 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * np.dtype(spec[2]).itemsize
        if size and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"

        def tensors(shard=shard):
            for key, shape, dtype in shard:
                yield key, ArraySource(np.resize(block, shape).astype(dtype))

        write_safetensors(folder / name, tensors())
        weight_map.update({key: name for key, _, _ in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


# -- measurement (child process) -------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def measure(folder: Path) -> dict[str, Any]:
    """Run in a fresh process: baseline RSS, build, peak RSS, bytes read, header open times."""
    import ernie_ir.frontends as frontends
    import ernie_ir.runtime.interpreter  # noqa: F401  (the baseline includes the interpreter)
    from ernie_ir.ir.verifier import verify
    from ernie_ir.ir.weights import SafetensorsFile

    baseline_kb = _status_kb("VmRSS")
    read0 = _rchar()
    start = time.perf_counter()
    graph = frontends.load_model(str(folder))
    build_s = time.perf_counter() - start
    read_bytes = _rchar() - read0
    start = time.perf_counter()
    verify(graph)
    verify_s = time.perf_counter() - start
    peak_kb = _status_kb("VmHWM")
    files = sorted(folder.glob("*.safetensors"))

    start = time.perf_counter()
    headers = sum(len(SafetensorsFile(f).entries) for f in files)
    ours_s = time.perf_counter() - start
    from safetensors import safe_open

    start = time.perf_counter()
    keys = 0
    for f in files:
        with safe_open(str(f), framework="numpy") as fh:
            keys += len(list(fh.keys()))
    safetensors_s = time.perf_counter() - start
    assert keys == headers
    return {
        "files": len(files),
        "tensors": keys,
        "disk_bytes": sum(f.stat().st_size for f in files),
        "params": len(graph.params),
        "nodes": len(graph),
        "build_s": build_s,
        "verify_s": verify_s,
        "read_bytes": read_bytes,
        "baseline_mb": baseline_kb / 1024,
        "peak_over_baseline_mb": (peak_kb - baseline_kb) / 1024,
        "safetensors_open_s": safetensors_s,
        "ernie_ir_open_s": ours_s,
    }


# -- driver ----------------------------------------------------------------------------------------------


def run(sizes: list[str], layout: str, root: Path) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        cfg = {**BASE_CONFIG, **SIZES[size]}
        folder = root / f"{size}-{layout}"
        start = time.perf_counter()
        write_checkpoint(folder, cfg, layout)
        written = time.perf_counter() - start
        out = subprocess.run([sys.executable, __file__, "--measure", str(folder)],
                             check=True, capture_output=True, text=True)
        row = {"checkpoint": f"{size} ({layout})", "write_s": written, **json.loads(out.stdout)}
        rows.append(row)
        shutil.rmtree(folder)  # keep at most one checkpoint on disk
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ["checkpoint", "files", "tensors", "GB on disk", "build s", "verify s", "read by build",
            "peak RSS over base", "safetensors open s", "ernie-ir open s"]
    lines = [head]
    for r in rows:
        lines.append([
            r["checkpoint"], str(r["files"]), str(r["tensors"]), f"{r['disk_bytes'] / 1e9:.2f}",
            f"{r['build_s']:.3f}", f"{r['verify_s']:.3f}", f"{r['read_bytes'] / 1e6:.1f} MB",
            f"{r['peak_over_baseline_mb']:.0f} MB", f"{r['safetensors_open_s']:.3f}",
            f"{r['ernie_ir_open_s']:.3f}",
        ])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in lines]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,medium,large")
    parser.add_argument("--layout", choices=("paddle", "hf"), default="paddle")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure)))
        return
    root = Path(tempfile.mkdtemp(prefix="ernie-ir-import-", dir=args.dir))
    try:
        rows = run(args.sizes.split(","), args.layout, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(rows))
    base = rows[0]["build_s"]
    print(f"\nbuild time, largest / smallest checkpoint: {rows[-1]['build_s'] / base:.2f}x for "
          f"{rows[-1]['disk_bytes'] / rows[0]['disk_bytes']:.1f}x the bytes; "
          f"max peak RSS over baseline: {max(r['peak_over_baseline_mb'] for r in rows):.0f} MB "
          f"(goal < 300 MB); baseline RSS {rows[0]['baseline_mb']:.0f} MB")
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
