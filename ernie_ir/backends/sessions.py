"""Run a compiled artifact through one of the backends its manifest offers.

    logits = run_artifact(Path("art"), np.array([[1, 2, 3]]), "onnxruntime")

Backends: "interpreter" (the lowered rank graphs in the reference
interpreter, every artifact; several ranks run in lockstep as SPMD and rank 0
reports), "onnxruntime" (`inference/onnx/model.onnx`,
cuda inference artifacts, the numerics the manifest records: `onnx_numerics`), "paddle" (one rank: the
Paddle executable; several: one paddle.distributed gloo process per rank,
ernie_ir.backends.paddle.launch, rank 0 reports). Hashes are checked first.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ernie_ir.ir import ErnieIRError

BACKENDS = ("interpreter", "onnxruntime", "paddle")
ONNX_MODEL = Path("inference") / "onnx" / "model.onnx"


def artifact_backends(path: Path) -> list[str]:
    """The backends the artifact's manifest offers (older artifacts: the interpreter only)."""
    from ernie_ir.artifacts import read_manifest

    return list(read_manifest(path).get("backends", ["interpreter"]))


def run_artifact(path: Path, input_ids: np.ndarray, backend: str, *,
                 timeout_s: float | None = None) -> np.ndarray:
    """Logits [B, S, V] of the artifact at `path` for `input_ids` [B, S] on `backend`.

    `timeout_s` bounds a multi-rank paddle run (default ernie_ir.backends.paddle.launch.RUN_TIMEOUT_S).
    """
    from ernie_ir.artifacts import artifact_mapping, load_rank_graphs, require_weights, verify_artifact

    root = Path(path)
    manifest = verify_artifact(root)
    offered = list(manifest.get("backends", ["interpreter"]))
    if backend not in offered:
        raise ErnieIRError(f"artifact {root} does not offer backend {backend!r}; it offers "
                           f"{', '.join(offered)}")
    ids = np.asarray(input_ids)
    if backend == "paddle":
        require_weights(root, manifest)
    if backend == "interpreter":
        from ernie_ir.runtime.spmd import run_pipeline_spmd, run_spmd

        mapping, graphs = load_rank_graphs(root, verify=False)
        name = graphs[-1].output_names[0]
        feed = {graphs[0].inputs[0].name: ids}
        if mapping.pp > 1:
            return run_pipeline_spmd(graphs, mapping.pp, feed)[0][name]
        return run_spmd(graphs, feed)[0][name]  # rank 0 reports
    _check_ids(root, ids)  # the executables would crash (out of range) or silently wrap (negative)
    if backend == "onnxruntime":
        from ernie_ir.backends.onnx.session import run_onnx

        return run_onnx(root / ONNX_MODEL, ids, numerics=manifest.get("onnx_numerics"))
    if backend == "paddle" and artifact_mapping(manifest).rank_graphs > 1:
        from ernie_ir.backends.paddle.launch import RUN_TIMEOUT_S, run_distributed

        if ids.ndim != 2:
            raise ErnieIRError(f"input_ids must be [batch, seq], got shape {list(ids.shape)}")
        return run_distributed(root, ids, artifact_mapping(manifest).rank_graphs,
                               timeout_s=RUN_TIMEOUT_S if timeout_s is None else timeout_s)
    if backend == "paddle":
        from ernie_ir.backends.paddle.session import run_paddle

        return run_paddle(root, ids)
    raise ErnieIRError(f"backend {backend!r} has no runner yet (known: {', '.join(BACKENDS)})")


def _check_ids(root: Path, ids: np.ndarray) -> None:
    """Token ids the rank-0 graph accepts: the interpreter's checks, for the compiled backends."""
    from ernie_ir.backends.paddle.rank_worker import check_token_ids
    from ernie_ir.ir.parser import parse_graph
    from ernie_ir.ops.positions import check_sequence_length

    text_path = root / "rank0" / "graph.ir"
    graph = parse_graph(text_path.read_text(encoding="utf-8"), source=str(text_path))
    if not graph.inputs or ids.size == 0:
        return
    check_token_ids(graph, ids)
    check_sequence_length(graph, int(ids.shape[-1]))
