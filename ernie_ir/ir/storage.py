"""Graph folders: `graph.ir` (the text) + `weights.safetensors` (param data).

`save_graph` streams one param at a time into the weights file, so saving
never holds more than one tensor in memory; `load_graph` parses the text and
attaches memory-mapped sources, so loading reads no weight bytes. A reload is
bit-exact: the same dtypes, shapes and bytes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import ErnieIRError, WeightError
from .graph import Graph
from .parser import parse_graph
from .printer import print_graph
from .weights import SafetensorsFile, content_hash, write_safetensors

GRAPH_FILE = "graph.ir"
WEIGHTS_FILE = "weights.safetensors"


def sha256_file(path: str | os.PathLike[str]) -> str:
    """sha256 of a file, read in 1 MiB chunks (artifacts list one per file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_graph_files(graph: Graph, folder: Path,
                      on_tensor: Callable[[str, int, int], None] | None = None, *,
                      require_finite: bool = True) -> dict[str, str]:
    """Write graph.ir and weights.safetensors into an existing folder; returns {file: sha256}.

    `require_finite`: a float param holding NaN or Inf is refused (WeightError naming it) as
    its values are written, so a compiled artifact never carries weights that cannot compute."""
    text = print_graph(graph).encode("utf-8")
    (folder / GRAPH_FILE).write_bytes(text)
    weights = write_safetensors(
        folder / WEIGHTS_FILE,
        ((p.name, p.source) for p in graph.params.values() if p.source is not None),
        on_tensor=on_tensor,
        require_finite=require_finite,
    )
    return {GRAPH_FILE: hashlib.sha256(text).hexdigest(), WEIGHTS_FILE: weights}


def save_graph(graph: Graph, folder: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Save a graph folder atomically: a failure leaves nothing behind."""
    dest = Path(folder)
    if dest.exists() and not overwrite:
        raise ErnieIRError(f"{dest} already exists (pass overwrite=True / --force to replace it)")
    # a graph folder may hold what it is given: no finiteness check
    return replace_folder(dest, lambda tmp: write_graph_files(graph, tmp, require_finite=False))


def replace_folder(dest: Path, fill: Callable[[Path], object]) -> Path:
    """`fill` a fresh temp folder beside `dest`, then put it in `dest`'s place (replacing what
    was there); any failure or interruption removes the temp folder and leaves `dest` as it was."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        fill(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def load_graph(folder: str | os.PathLike[str], *, check_hashes: bool = True) -> Graph:
    """Load a graph folder; params get memory-mapped sources from weights.safetensors."""
    root = Path(folder)
    text_path = root / GRAPH_FILE
    if not text_path.is_file():
        raise ErnieIRError(f"{root} is not a graph folder (no {GRAPH_FILE})")
    try:
        text = text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ErnieIRError(f"{text_path}: not a text file (IR files are UTF-8 text)") from None
    graph = parse_graph(text, source=str(text_path))
    weights = root / WEIGHTS_FILE
    if weights.exists():
        st = SafetensorsFile(weights)
        for key in st:
            p = graph.params.get(key)
            if p is None:
                raise WeightError(f"{weights}: tensor {key!r} is not a param of the graph")
            p.source = None
            src = st.source(key)
            p._check_source(src)
            p.source = src
            if check_hashes and p.digest is not None and content_hash(src.read()) != p.digest:
                raise WeightError(f"param @{key}: data does not match the hash in {GRAPH_FILE}")
    return graph
