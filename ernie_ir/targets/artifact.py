"""The compiled artifact (DESIGN.md section 6): writing, verifying and loading it.

    manifest.json          format version, ernie-ir version, source model + sha256, resolved
                           pipeline, target, mode, parallel layout, kernel plan summary, and the
                           sha256 of every other file
    graph.ir               the global IR: the final graph of a one-rank artifact; for several
                           ranks, the unsplit graph the split cut them from
    rank{r}/graph.ir       per-rank IR (one rank: rank0 only), legalized for the target
    rank{r}/weights.safetensors   each rank's weights, streamed from the lazy (memory-mapped)
                           sources one tensor at a time
    inference/launch.sh    launch recipe (paddle.distributed.launch with the target's flag and env;
                           several ranks: one rank worker per device)
    inference/launch.json  the same recipe as data, with the collective backend

Writing is atomic: everything goes into a hidden temp folder next to the
destination, which is renamed into place at the end; any failure or
interruption removes the temp folder. An existing destination is replaced
only with `force`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.mapping import Mapping
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.storage import GRAPH_FILE, WEIGHTS_FILE, load_graph, sha256_file, write_graph_files
from ernie_ir.ir.weights import SafetensorsFile

from .capabilities import Target

FORMAT = "ernie-ir-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FORMATS = ("fastdeploy",)
"""Emitters that write a format another program loads (the manifest's "formats"), not a backend
`ernie-ir run --backend` offers ("backends")."""


class ArtifactError(ErnieIRError):
    """An artifact folder that is missing, incomplete, tampered with, or in the way."""


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


WORKER_LOOKUP = "python -c 'import ernie_ir.runtime.paddle_dist as w; print(w.__file__)'"
"""Prints the path of the rank worker (ernie_ir/runtime/paddle_dist.py), which the launcher runs."""


def launch_recipe(target: Target, mode: str, tp: int = 1) -> dict[str, Any]:
    """How the artifact is started on its devices (`tp`: the number of processes, one per rank).

    The launcher starts the rank worker once per device (one rank too): each process checks and
    loads its `rank{r}/`, builds its Paddle Layer for the device (the device's weight-only
    kernels where the kernel plan names them) and runs it; collectives run on the target's
    backend (nccl, xccl, bkcl). On a CPU, `ernie-ir run|train <artifact> --backend paddle`
    starts the same worker over gloo itself.
    """
    devices = ",".join(str(i) for i in range(tp))
    env = {target.visible_devices_env: devices, **target.extra_env}
    command = "train" if mode == "training" else "run"
    kind = target.paddle_device.split(":")[0]
    extra = " --save" if mode == "training" else ""
    cpu = ("ernie-ir train <artifact> --steps N" if mode == "training" else
           "ernie-ir run <artifact> --tokens 1,2,3 --backend paddle")
    return {
        "target": target.name,
        "launcher": "python -m paddle.distributed.launch",
        "flag": target.launch_flag,
        "devices": devices,
        "nproc": tp,
        "collective_backend": target.collective_backend,
        "env": env,
        "paddle_device": target.paddle_device,
        "inference_config": target.inference_config,
        "entry": f"<worker> {command} <artifact> --device {kind}{extra}",
        "worker": WORKER_LOOKUP,
        "note": (f"{tp} process(es), one per rank: each checks and loads rank{{r}}/, builds its Paddle "
                 "Layer for the device (collectives are paddle.distributed calls) and rank 0 reports"),
        "cpu": {"collective_backend": "gloo", "command": cpu,
                "note": "one gloo process per rank on this machine's CPU"},
        "mode": mode,
    }


def launch_script(recipe: dict[str, Any]) -> str:
    lines = ["#!/bin/sh",
             f"# ernie-ir launch recipe: target {recipe['target']}, {recipe['nproc']} process(es), "
             f"collective backend {recipe['collective_backend']}",
             'ARTIFACT="$(cd "$(dirname "$0")/.." && pwd)"']
    for k, v in recipe["env"].items():
        lines.append(f'export {k}="${{{k}:-{v}}}"')
    vis = next(iter(recipe["env"]))
    command = "train" if recipe.get("mode") == "training" else "run"
    # The rank worker, not `ernie-ir run`: that would run the CPU interpreter (every rank of it
    # in each process, for several ranks).
    kind = recipe["paddle_device"].split(":")[0]
    extra = " --save" if command == "train" else ""
    lines.append("# on a CPU instead: " + recipe["cpu"]["command"].replace("<artifact>", '"$ARTIFACT"'))
    lines.append(f'WORKER="$({recipe["worker"]})" || exit 1')
    lines.append(f'exec {recipe["launcher"]} --nproc_per_node {recipe["nproc"]} {recipe["flag"]} '
                 f'"${{{vis}}}" "$WORKER" {command} "$ARTIFACT" --device {kind}{extra} "$@"')
    return "\n".join(lines) + "\n"


def check_out(out: str | os.PathLike[str], force: bool) -> Path:
    """The artifact destination, or ArtifactError if it may not be written (before any work)."""
    dest = Path(out)
    if dest.exists() and not force:
        raise ArtifactError(f"{dest} already exists: pass --force (force=True) to replace it")
    if dest.exists() and not dest.is_dir():
        raise ArtifactError(f"{dest} is a file, not an artifact folder: choose another --out "
                            "(--force replaces only folders)")
    real, cwd = dest.resolve(), Path.cwd().resolve()
    if real == cwd or real in cwd.parents or not dest.name or dest.name == "..":
        raise ArtifactError(f"--out {out} is the current folder or one above it: name a new folder "
                            "for the artifact, e.g. --out artifacts/model")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / MANIFEST).is_file():
        # --force replaces an artifact, never an arbitrary folder that happens to be named.
        raise ArtifactError(f"{dest} is a folder with files but no {MANIFEST}, so not an ernie-ir "
                            "artifact: --force only replaces artifacts; choose another --out")
    for parent in real.parents:
        if (parent / MANIFEST).is_file():
            try:
                read_manifest(parent)
            except ArtifactError:
                continue  # someone else's manifest.json
            raise ArtifactError(f"--out {out} is inside the artifact {parent} (it would add files to "
                                "it and break its hashes): choose a folder outside it")
    return dest


def write_artifact(graph: Graph, out: str | os.PathLike[str], *, target: Target, mode: str,
                   pipeline: str, source: dict[str, Any] | Callable[[], dict[str, Any]],
                   force: bool = False,
                   extra: dict[str, Any] | None = None,
                   emitters: dict[str, Callable[[Graph, Path], Any]] | None = None,
                   progress: Callable[[str, int, int], None] | None = None,
                   ranks: Sequence[Graph] | None = None, mapping: Mapping | None = None) -> Path:
    """Write the artifact folder atomically and return its path.

    `source`: the manifest's source entry, or a function giving it (called when the manifest is
    written, last: e.g. a hash of the source computed meanwhile).
    `ranks`: the rank graphs (default: `[graph]`, one rank) under `mapping` (default: one rank);
    `graph` is written as the global `graph.ir`, each rank's graph and weights into `rank{r}/`.

    `emitters`: backend name -> fn(graph, executable folder) that writes that backend's files
    (e.g. "onnxruntime" -> `inference/onnx/`); the manifest's "backends" lists "interpreter"
    and these names (those in FORMATS, e.g. "fastdeploy", go to "formats" instead), and every
    file they write is hashed like the others.
    `progress(stage, done, total)` reports weights written and executables emitted.
    """
    from ernie_ir import __version__

    dest = check_out(out, force)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the artifact gets the user's umask
    except OSError as e:
        raise ArtifactError(f"cannot write the artifact {out}: {e.strerror or e} "
                            f"({e.filename or dest.parent}): choose a writable --out") from None
    old: Path | None = None
    try:
        rank_graphs = list(ranks) if ranks else [graph]
        layout = mapping if mapping is not None else Mapping.create()
        if len(rank_graphs) != layout.world_size:
            raise ArtifactError(f"{len(rank_graphs)} rank graphs for a world of {layout.world_size}")
        (tmp / "graph.ir").write_text(print_graph(graph), encoding="utf-8")
        total = sum(1 for g in rank_graphs for p in g.params.values() if p.source is not None)
        written = 0
        known: dict[str, str] = {}  # sha256 of the files hashed as they were written
        has_weights = all(p.source is not None for g in rank_graphs for p in g.params.values())
        for r, rank_graph in enumerate(rank_graphs):
            (tmp / f"rank{r}").mkdir()
            base = written

            def on_tensor(_name: str, done: int, _total: int, base: int = base) -> None:
                if progress is not None:
                    progress("weights", base + done, total)

            if has_weights:
                digests = write_graph_files(rank_graph, tmp / f"rank{r}", on_tensor=on_tensor)
                _read_back(rank_graph, tmp / f"rank{r}" / WEIGHTS_FILE)
            else:  # a meta graph: the IR is the artifact (for planning and review), no weights file
                text = print_graph(rank_graph).encode("utf-8")
                (tmp / f"rank{r}" / GRAPH_FILE).write_bytes(text)
                digests = {GRAPH_FILE: hashlib.sha256(text).hexdigest()}
            for name, digest in digests.items():
                known[f"rank{r}/{name}"] = digest
            written += sum(1 for p in rank_graph.params.values() if p.source is not None)
        exe = tmp / mode
        exe.mkdir()
        recipe = launch_recipe(target, mode, layout.world_size)
        (exe / "launch.json").write_text(json.dumps(recipe, indent=2) + "\n", encoding="utf-8")
        (exe / "launch.sh").write_text(launch_script(recipe), encoding="utf-8")
        (exe / "launch.sh").chmod(0o755)
        for i, (backend, emit) in enumerate((emitters or {}).items(), 1):
            emit(graph, exe)
            if progress is not None:
                progress(f"executable {backend}", i, len(emitters or {}))
        plan = graph.metadata.get("kernel_plan", {})
        kernels: dict[str, int] = {}
        for entry in plan.get("kernels", []):
            kernels[entry["kernel"]] = kernels.get(entry["kernel"], 0) + 1
        files = {name: known.get(name) or sha256_file(tmp / name) for name in _files(tmp)}
        rank_names = (GRAPH_FILE, WEIGHTS_FILE) if has_weights else (GRAPH_FILE,)
        rank_files = {f"rank{r}": {name: files[f"rank{r}/{name}"] for name in rank_names}
                      for r in range(layout.world_size)}
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "ernie_ir_version": __version__,
            "source": source() if callable(source) else source,
            "pipeline": pipeline,
            "target": target.name,
            **({"cuda_arch": plan["cuda_arch"]} if "cuda_arch" in plan else {}),
            "mode": mode,
            "weights": has_weights,
            "parallel": {"tp": layout.tp, "ep": layout.ep, "world_size": layout.world_size,
                         "ranks": [f"rank{r}" for r in range(layout.world_size)],
                         "mapping": layout.model_dump(mode="json")},
            "kernel_plan": {"kernels": dict(sorted(kernels.items())), "fallbacks": plan.get("fallbacks", [])},
            **(extra or {}),
            "backends": ["interpreter", *(b for b in emitters or {} if b not in FORMATS)],
            **({"formats": formats} if (formats := [b for b in emitters or {} if b in FORMATS]) else {}),
            "rank_files": rank_files,
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
        os.replace(tmp, dest)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not dest.exists():
            os.replace(old, dest)  # put the previous artifact back
        if isinstance(e, OSError):  # disk full, permissions: a user error, not a crash
            raise ArtifactError(f"cannot write the artifact {out}: {e.strerror or e}: free space or "
                                "choose a writable --out (nothing was written)") from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def _read_back(graph: Graph, weights: Path) -> None:
    """Point every param at its bytes in the rank file just written: the executables emitted
    next read them from there (memory-mapped) instead of quantizing and packing them again."""
    written = SafetensorsFile(weights)
    for p in graph.params.values():
        if p.source is not None and p.name in written:
            p.source = written.source(p.name)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    root = Path(path)
    mf = root / MANIFEST
    if not root.is_dir() or not mf.is_file():
        raise ArtifactError(f"{root} is not an ernie-ir artifact (no {MANIFEST})")
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ArtifactError(f"{mf} is not valid JSON: the artifact is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{mf} is not an ernie-ir artifact manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{mf}: format version {manifest.get('format_version')} is not supported "
                            f"(this ernie-ir reads version {FORMAT_VERSION}); recompile the model")
    if not isinstance(manifest.get("files"), dict):
        raise ArtifactError(f"{mf} lists no files: the artifact is corrupt")
    for name, digest in manifest["files"].items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or "\\" in name:
            raise ArtifactError(f"{mf} lists {name!r}, which is outside the artifact folder: "
                                "the manifest is corrupt or tampered with; recompile the model")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ArtifactError(f"{mf}: the sha256 of {name} is not a 64-digit hex string: "
                                "the manifest is corrupt or tampered with; recompile the model")
    return manifest


def verify_artifact(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Re-check every file's sha256 against the manifest; returns the manifest.

    Raises ArtifactError naming the first file that is missing, changed or unlisted.
    """
    root = Path(path)
    manifest = read_manifest(root)
    listed: dict[str, str] = manifest["files"]
    inside = root.resolve()
    for name, digest in listed.items():
        f = root / name
        if not f.is_file():
            raise ArtifactError(f"artifact {root}: {name} is missing (listed in {MANIFEST})")
        if inside not in f.resolve().parents:  # e.g. a link swapped for one that leaves the folder
            raise ArtifactError(f"artifact {root}: {name} resolves outside the artifact "
                                f"({f.resolve()}): the artifact was tampered with; recompile it")
        actual = sha256_file(f)
        if actual != digest:
            raise ArtifactError(f"artifact {root}: {name} was modified (sha256 {actual[:16]}..., "
                                f"manifest says {digest[:16]}...); recompile or restore it")
    extra = [n for n in _files(root) if n != MANIFEST and n not in listed]
    if extra:
        raise ArtifactError(f"artifact {root}: {extra[0]} is not listed in {MANIFEST} (an added file)")
    return manifest


def require_weights(root: Path, manifest: dict[str, Any]) -> None:
    """Refuse to run a graph-only artifact (compiled from a model without weights)."""
    if manifest.get("weights") is False:
        raise ArtifactError(f"{root} is a graph-only artifact (compiled from a model without weights, "
                            "e.g. NAME@meta): it holds no weights to run; `ernie-ir show` and "
                            "`ernie-ir plan` read it; compile a checkpoint folder or NAME@tiny to run")


def artifact_mapping(manifest: dict[str, Any]) -> Mapping:
    """The parallel layout an artifact's manifest records (one rank for older artifacts)."""
    data = (manifest.get("parallel") or {}).get("mapping") if isinstance(manifest.get("parallel"),
                                                                       dict) else None
    if data is None:
        return Mapping.create()
    try:
        return Mapping.model_validate(data)
    except ValueError:
        raise ArtifactError("manifest.json: parallel.mapping is not a valid layout: the manifest is "
                            "corrupt or tampered with; recompile the model") from None


def load_rank_graphs(path: str | os.PathLike[str], *, verify: bool = True) -> tuple[Mapping, list[Graph]]:
    """Every rank graph of an artifact (rank order), weights memory-mapped, with its Mapping."""
    root = Path(path)
    manifest = verify_artifact(root) if verify else read_manifest(root)
    require_weights(root, manifest)
    mapping = artifact_mapping(manifest)
    return mapping, [load_graph(root / f"rank{r}") for r in range(mapping.world_size)]


def load_artifact(path: str | os.PathLike[str], *, verify: bool = True) -> Graph:
    """The rank-0 graph of an artifact, weights memory-mapped (hashes checked first unless verify=False)."""
    root = Path(path)
    if verify:
        verify_artifact(root)
    else:
        read_manifest(root)
    return load_graph(root / "rank0")
