"""What fusion buys: an ERNIE-3.5-SE-shaped model, unfused vs fused, in one run.

The model: ERNIE-3.5-SE's layout (parallel_attn_hatf: layer 0 attention only, the last layer
FFN only, the layers between parallel attention + FFN blocks) at hidden 1024, 16 heads,
intermediate 2752 (the 3B model's 8192 / 3072 ratio), 4 layers, vocab 8192 (--vocab), with
biases, bf16 weights (the published dtype, --dtype). A checkpoint is written the way
PaddleNLP's `save_pretrained(safe_serialization=True)` lays it out (config.json +
model.safetensors, keys and [in, out] shapes as the frontend reads them, seeded random
values) into a temp dir, and imported from there.

Three forms of the same weights:
  unfused   unfuse-parallel-block,unfuse-qkv,unfuse-gate-up: one linear per q/k/v/o/gate/up/down
  imported  as the checkpoint stores it (layers 1..L-2 fused; layer 0's q/k/v and the last
            layer's gate/up separate)
  fused     O2 on the unfused form: every layer fused (parallel blocks, qkv, gate/up)

Measured, all in one run:
  - structure: nodes and all_reduce per layer of the tp=2 rank-0 graph (split{tp=2})
  - onnxruntime: latency of the ONNX executable `compile_model(..., "cuda")` emits (CPU EP,
    the backend's exact settings, --threads), batch 1, --tokens tokens
  - Paddle: latency of the artifact's Paddle Inference model (CPU, as `ernie-ir run --backend
    paddle` loads it)
  Latencies are median and min over --repeat rounds that run the three forms round-robin (the
  order rotating), so that other load on the machine falls on every form alike.
  - exactness: max |logit difference| of each executable against the unfused interpreter run

    python benchmarks/fusion.py [--quick] [--threads 2] [--repeat 20] [--tokens 32] [--vocab 8192]

--quick: hidden 256, 4 heads, intermediate 704, vocab 2048, 5 repeats (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.backends.onnx.session import full_sequence_feeds, session
from ernie_ir.frontends.builtins import builtin_config
from ernie_ir.frontends.loader import load_folder
from ernie_ir.ir import Graph
from ernie_ir.ir.weights import ArraySource, write_safetensors
from ernie_ir.load import load_input
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.parallel.split import mapping_for, split_graph
from ernie_ir.runtime import run_graph
from ernie_ir.targets import CompileOptions, compile_model

UNFUSE = "unfuse-parallel-block,unfuse-qkv,unfuse-gate-up"
FORMS = {"unfused": UNFUSE, "imported": "", "fused": UNFUSE + ",O2"}


def write_checkpoint(folder: Path, config: dict[str, Any], seed: int = 0) -> None:
    """config.json + model.safetensors with every key the frontend reads, random values."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    meta = load_folder(folder, meta=True)  # the keys, shapes and dtypes of this config
    rng = np.random.default_rng(seed)
    tensors = []
    for name, p in meta.params.items():
        shape = tuple(int(d) for d in p.type.shape)
        if name.endswith("norm.weight"):
            values = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            values = rng.standard_normal(shape, dtype=np.float32) * 0.01
        else:
            values = rng.standard_normal(shape, dtype=np.float32) * 0.02
        tensors.append((name, ArraySource(values.astype(p.type.dtype.numpy))))
    write_safetensors(folder / "model.safetensors", tensors)


def layer_of(scope: str) -> str | None:
    return scope.split(".layers.")[1].split(".")[0] if ".layers." in scope else None


def structure(graph: Graph) -> dict[str, Any]:
    """Per layer of the tp=2 rank-0 graph: nodes, and all_reduce (by the layer whose result they
    reduce: the embedding's sits at the first norm that reads it)."""
    rank0 = split_graph(graph, mapping_for(graph, 2))[0]
    nodes: dict[str, int] = {}
    reduces: dict[str, int] = {}
    for n in rank0:
        layer = layer_of(n.scope)
        if layer is not None:
            nodes[layer] = nodes.get(layer, 0) + 1
        if n.op == "all_reduce":
            source = n.inputs[0].producer.scope if n.inputs[0] is not None and n.inputs[0].producer else ""
            src_layer = layer_of(source)
            if src_layer is not None:
                reduces[src_layer] = reduces.get(src_layer, 0) + 1
    linears = sum(1 for n in graph if n.op in ("linear", "weight_only_linear"))
    return {"global_nodes": len(graph), "global_linears": linears, "rank0_nodes": len(rank0),
            "rank0_nodes_per_layer": nodes, "rank0_all_reduce_per_layer": reduces}


def onnx_runner(artifact: Path, ids: np.ndarray, threads: int) -> Any:
    sess = session(artifact / "inference" / "onnx" / "model.onnx", threads=threads)
    feed = full_sequence_feeds(sess, ids)  # the artifact's model is a KV-cache decoder: an empty past
    return lambda: sess.run(["logits"], feed)[0]


def paddle_runner(artifact: Path, ids: np.ndarray, threads: int) -> Any:
    from paddle import inference

    config = inference.Config(str(artifact / "inference" / "paddle" / "model.json"),
                              str(artifact / "inference" / "paddle" / "model.pdiparams"))
    config.disable_gpu()
    config.disable_glog_info()
    config.disable_mkldnn()  # as ernie_ir.backends.paddle.session runs it
    config.set_cpu_math_library_num_threads(threads)
    predictor = inference.create_predictor(config)
    handle = predictor.get_input_handle(predictor.get_input_names()[0])
    output = predictor.get_output_handle(predictor.get_output_names()[0])

    def run() -> np.ndarray:
        handle.reshape(list(ids.shape))
        handle.copy_from_cpu(ids)
        predictor.run()
        return np.asarray(output.copy_to_cpu())

    return run


def interleaved(runners: dict[str, Any], repeat: int) -> dict[str, dict[str, float]]:
    """Median and min ms per runner, timed round-robin (rotating the order each round) so that
    load from other processes on the machine falls on every form alike."""
    names = list(runners)
    for _ in range(3):
        for n in names:
            runners[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeat):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            runners[n]()
            times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: {"median_ms": statistics.median(t), "min_ms": min(t)} for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    dims = ({"hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 704, "vocab_size": 2048}
            if args.quick else
            {"hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 2752, "vocab_size": 8192})
    if args.vocab:
        dims["vocab_size"] = args.vocab
    repeat = 5 if args.quick else args.repeat
    config = {**builtin_config("ernie-3.5-se-3b", "meta"), **dims, "num_hidden_layers": 4,
              "torch_dtype": args.dtype}
    ids = np.random.default_rng(1).integers(0, dims["vocab_size"], (1, args.tokens)).astype(np.int64)
    report: dict[str, Any] = {"model": {**dims, "num_hidden_layers": 4, "dtype": args.dtype},
                              "batch": 1, "tokens": args.tokens, "threads": args.threads, "repeat": repeat,
                              "forms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ernie-3.5-se"
        write_checkpoint(ckpt, config)
        reference = load_input(str(ckpt))
        run_pipeline(reference, UNFUSE)
        ref = run_graph(reference, {"input_ids": ids})["logits"]
        onnx, paddle = {}, {}
        for form, pipeline in FORMS.items():
            graph = load_input(str(ckpt))
            if pipeline:
                run_pipeline(graph, pipeline)
            row: dict[str, Any] = structure(graph)
            t0 = time.perf_counter()
            artifact = Path(tmp) / f"artifact-{form}"
            compile_model(str(ckpt), "cuda", CompileOptions(pipeline=pipeline or None, out=artifact,
                          emit="onnx,paddle-inference"))
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            onnx[form] = onnx_runner(artifact, ids, args.threads)
            paddle[form] = paddle_runner(artifact, ids, args.threads)
            row["onnx_max_abs_diff_vs_unfused_interpreter"] = float(np.abs(onnx[form]() - ref).max())
            row["paddle_max_abs_diff_vs_unfused_interpreter"] = float(np.abs(paddle[form]() - ref).max())
            report["forms"][form] = row
        for backend, runners in (("onnxruntime", onnx), ("paddle", paddle)):
            for form, t in interleaved(runners, repeat).items():
                report["forms"][form][backend] = t
        for form, row in report["forms"].items():
            ort, pd = row["onnxruntime"], row["paddle"]
            print(f"{form:9s} nodes {row['global_nodes']:4d} (linears {row['global_linears']:2d}), tp=2 "
                  f"rank 0: {row['rank0_nodes']} nodes, all_reduce/layer "
                  f"{row['rank0_all_reduce_per_layer']}; "
                  f"onnxruntime {ort['median_ms']:7.2f} ms (min {ort['min_ms']:.2f}), "
                  f"paddle {pd['median_ms']:7.2f} ms (min {pd['min_ms']:.2f})", flush=True)
    forms = report["forms"]
    report["fused_over_unfused"] = {
        **{f"{b}_median": forms["fused"][b]["median_ms"] / forms["unfused"][b]["median_ms"]
           for b in ("onnxruntime", "paddle")},
        **{k: forms["fused"][k] / forms["unfused"][k]
           for k in ("global_nodes", "global_linears", "rank0_nodes")}}
    report["logit_scale"] = float(np.abs(ref).max())
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
