"""Writing a compiled artifact (DESIGN.md section 6): the global graph, each rank's graph and
weights, the launch files, the executables, the tokenizer and the manifest.

    manifest.json          format version, ernie-ir version, source model + sha256, resolved
                           pipeline, target, mode, parallel layout, kernel plan summary, and the
                           sha256 of every other file
    graph.ir               the global IR: the final graph of a one-rank artifact; for several
                           ranks, the unsplit graph the split cut them from
    rank{r}/graph.ir       per-rank IR (one rank: rank0 only), legalized for the target
    rank{r}/weights.safetensors   each rank's weights, streamed from the lazy (memory-mapped)
                           sources one tensor at a time
    inference/launch.sh    the target's launch recipe (ernie_ir.targets.artifact writes it as data)
    inference/launch.json  the same recipe as data, with the collective backend

Writing is atomic and locked (ernie_ir.artifacts.publish): everything goes into a hidden temp
folder next to the destination, which is moved into place at the end under the destination's
lock; any failure or interruption removes the temp folder. An existing destination is replaced
only with `force`, decided when the new artifact is moved into place. The target reaches the
writer as data (its name, its launch recipe and script), so this layer knows no target.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ernie_ir.ir import Graph
from ernie_ir.ir.mapping import Mapping
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.storage import GRAPH_FILE, WEIGHTS_FILE, write_graph_files
from ernie_ir.ir.weights import SafetensorsFile

from .manifest import (
    MANIFEST,
    ArtifactError,
    ManifestRecord,
    build_manifest,
    hash_tree,
    read_manifest,
    show,
    write_manifest,
)
from .publish import artifact_lock, clean_stale, make_temp_dir, move_into_place, replaceable, test_pause


def check_out(out: str | os.PathLike[str], force: bool) -> Path:
    """The artifact destination, or ArtifactError if it may not be written (before any work).

    Also the first chance to clean up after killed compiles into the same parent (under the
    destination's lock; another compile holding it: one line, at once). The decision to replace
    is made again when the artifact is moved into place (`write_artifact`)."""
    dest = Path(out)
    real, cwd = dest.resolve(), Path.cwd().resolve()
    at_or_above = real == cwd or real in cwd.parents or not dest.name or dest.name == ".."
    for parent in real.parents:
        if (parent / MANIFEST).is_file():
            try:
                read_manifest(parent)
            except ArtifactError:
                continue  # someone else's manifest.json
            raise ArtifactError(f"--out {show(out)} is inside the artifact {show(parent)} (it would add "
                                "files to it and break its hashes): choose a folder outside it")
    if dest.parent.is_dir() and not at_or_above:
        with artifact_lock(dest):  # held by another compile: fail now, not after the work
            clean_stale(dest.parent, dest.name)
    if os.path.lexists(dest) and not force:
        raise ArtifactError(f"{show(dest)} already exists: pass --force to replace it")
    if os.path.lexists(dest) and (dest.is_symlink() or not dest.is_dir()):
        replaceable(dest)
    if at_or_above:
        raise ArtifactError(f"--out {show(out)} is the current folder or one above it: name a new folder "
                            "for the artifact, e.g. --out artifacts/model")
    if os.path.lexists(dest):
        replaceable(dest)
    return dest


@dataclass
class ArtifactContents:
    """What goes into an artifact besides its global graph (`write_artifact`).

    `source`: the manifest's source entry, or a function giving it (called when the manifest is
    written, last: e.g. a hash of the source computed meanwhile). `ranks`: the rank graphs
    (None: the global graph, one rank) under `mapping` (None: one rank). `emitters`: backend
    name -> fn(graph, executable folder) that writes that backend's files (e.g. "onnxruntime" ->
    `inference/onnx/`); the manifest's "backends" lists "interpreter" and these names (those in
    FORMATS, e.g. "fastdeploy", go to "formats" instead), and every file they write is hashed
    like the others. `tokenizer(root)`: writes the model's tokenizer files under the new
    artifact's root, after the executables, and returns the folder it used (relative, recorded
    as the manifest's `"tokenizer"`), or None when there was none. `extra`: more manifest fields.
    """

    target: str
    """The target's name (the manifest's `target`)."""
    mode: str
    launch_recipe: dict[str, Any]
    """The target's launch recipe (`launch.json`), for the layout's processes."""
    launch_script: str
    """`launch.sh`: the same recipe as a script."""
    pipeline: str
    source: dict[str, Any] | Callable[[], dict[str, Any]]
    ranks: Sequence[Graph] | None = None
    mapping: Mapping | None = None
    emitters: dict[str, Callable[[Graph, Path], Any]] = field(default_factory=dict)
    tokenizer: Callable[[Path], str | None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def write_artifact(graph: Graph, out: str | os.PathLike[str], contents: ArtifactContents, *,
                   force: bool = False, progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Write the artifact folder atomically and return its path: `graph` as the global
    `graph.ir`, each rank's graph and weights into `rank{r}/`, the launch recipe, the
    executables, the tokenizer and the manifest (`ArtifactContents` says what each is).
    `progress(stage, done, total)` reports weights written and executables emitted.

    The write holds the destination's lock (ernie_ir.artifacts.publish): a second writer fails
    with one line; `out` is replaced only with `force` and only if it is still an artifact when
    the new one is moved into place.
    """
    dest = check_out(out, force)
    with artifact_lock(dest, parents=True), _temp_folder(dest, out) as tmp:
        rank_graphs = list(contents.ranks) if contents.ranks else [graph]
        layout = contents.mapping if contents.mapping is not None else Mapping.create()
        if len(rank_graphs) != layout.rank_graphs:
            raise ArtifactError(f"{len(rank_graphs)} rank graphs for a world of {layout.world_size} x "
                                f"{layout.pp} stage(s)")
        (tmp / "graph.ir").write_text(print_graph(graph), encoding="utf-8")
        known, has_weights = _write_ranks(tmp, rank_graphs, progress)
        test_pause("weights")
        exe = tmp / contents.mode
        exe.mkdir()
        recipe = json.dumps(contents.launch_recipe, indent=2) + "\n"
        (exe / "launch.json").write_text(recipe, encoding="utf-8")
        (exe / "launch.sh").write_text(contents.launch_script, encoding="utf-8")
        (exe / "launch.sh").chmod(0o777 & ~_umask())  # executable, as far as the user's umask allows
        for i, (backend, emit) in enumerate(contents.emitters.items(), 1):
            emit(graph, exe)
            if progress is not None:
                progress(f"executable {backend}", i, len(contents.emitters))
        folder = contents.tokenizer(tmp) if contents.tokenizer is not None else None
        extra = {**contents.extra, **({"tokenizer": folder} if folder is not None else {})}
        from ernie_ir import __version__

        source = contents.source() if callable(contents.source) else contents.source
        record = ManifestRecord(ernie_ir_version=__version__, source=source, pipeline=contents.pipeline,
                                target=contents.target, mode=contents.mode, weights=has_weights,
                                mapping=layout, kernel_plan=graph.metadata.get("kernel_plan", {}),
                                backends=tuple(contents.emitters), extra=extra)
        manifest = build_manifest(record, hash_tree(tmp, known),
                                  (GRAPH_FILE, WEIGHTS_FILE) if has_weights else (GRAPH_FILE,))
        write_manifest(tmp, manifest)
        test_pause("manifest")
        move_into_place(tmp, dest, force)  # the decision to replace `out` is made here
    return dest


def _write_ranks(tmp: Path, rank_graphs: list[Graph],
                 progress: Callable[[str, int, int], None] | None) -> tuple[dict[str, str], bool]:
    """Each rank's graph and weights into `tmp/rank{r}/` (a meta graph: its IR alone); returns
    the sha256 of the files written (hashed as they were written) and whether weights were."""
    total = sum(1 for g in rank_graphs for p in g.params.values() if p.source is not None)
    written = 0
    known: dict[str, str] = {}
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
    return known, has_weights


@contextlib.contextmanager
def _temp_folder(dest: Path, out: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh temp folder next to `dest` (after removing what killed compiles left there; the
    caller holds dest's lock), removed on any failure or interruption."""
    clean_stale(dest.parent, dest.name)
    try:
        tmp = make_temp_dir(dest)
    except OSError as e:
        raise ArtifactError(f"cannot write the artifact {show(out)}: {e.strerror or e} "
                            f"({show(e.filename or dest.parent)}): choose a writable --out") from None
    try:
        test_pause("temp")
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # disk full, permissions: a user error, not a crash
            raise ArtifactError(f"cannot write the artifact {show(out)}: {e.strerror or e}: free space or "
                                "choose a writable --out (nothing was written)") from None
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read_back(graph: Graph, weights: Path) -> None:
    """Point every param at its bytes in the rank file just written: the executables emitted
    next read them from there (memory-mapped) instead of quantizing and packing them again."""
    written = SafetensorsFile(weights)
    for p in graph.params.values():
        if p.source is not None and p.name in written:
            p.source = written.source(p.name)
