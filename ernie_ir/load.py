"""Resolving a MODEL argument (CLI, golden cases) into a Graph.

MODEL may be an IR text file (`*.ir`), an artifact folder (`manifest.json`:
its hashes are checked and its rank-0 graph loaded), a graph folder
(`graph.ir` + `weights.safetensors`), a checkpoint folder, or a built-in model
name such as `ernie-4.5-0.3b@tiny`; the last two are the frontends' business.

Layer (docs/architecture.md): above `frontends` and the artifact format, below
`targets` (`compile_model` takes a MODEL as the CLI does), so targets reach the
frontends through `load_input` only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.storage import GRAPH_FILE, load_graph


def load_input(spec: str, *, trust_pickle: bool = False, meta: bool = False) -> Graph:
    """The graph MODEL names (see the module docstring); ErnieIRError with one line otherwise.

    `meta`: a checkpoint folder or built-in read as its full-size graph without weights."""
    path = Path(spec)
    if meta and (path.is_file() or (path / "manifest.json").is_file() or (path / GRAPH_FILE).is_file()):
        raise ErnieIRError(f"--meta reads a checkpoint folder's config.json or a built-in name; {spec} is "
                           "an IR file, an artifact or a graph folder: drop --meta")
    if path.is_file():
        if path.suffix != ".ir":
            raise ErnieIRError(f"{spec}: expected an IR text file (*.ir) or a model folder")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ErnieIRError(f"{spec}: not a text file (IR files are UTF-8 text)") from None
        return parse_graph(text, source=spec)
    if path.suffix == ".ir" and not path.exists():
        raise ErnieIRError(f"{spec}: no such IR file: check the path")
    if path.is_dir() and (path / "manifest.json").is_file():
        from ernie_ir.artifacts import load_artifact

        return load_artifact(path)  # verifies every hash first
    if path.is_dir() and (path / GRAPH_FILE).is_file():
        return load_graph(path)
    from ernie_ir.frontends import load_model

    return load_model(spec, trust_pickle=trust_pickle, meta=meta)


GENERATION_CONFIG = "generation_config.json"


def read_tokenizer(folder: str | Path) -> object | None:
    """The tokenizer of `folder` (None: it has none); ErnieIRError for files that cannot be read."""
    from ernie_ir.frontends.tokenizer import load_tokenizer

    return load_tokenizer(folder)


def copy_tokenizer(spec: str, dest: Path, *, tokenizer_json: bool = False) -> list[str]:
    """Copy the tokenizer files (and generation_config.json) of checkpoint folder `spec` into
    `dest`; the names copied or written, [] when `spec` is no folder or has no tokenizer.

    `tokenizer_json`: the folder must also hold a tokenizer.json + tokenizer_config.json that
    onnxruntime-genai's tokenizer reads: written from the tokenizer where the checkpoint has
    none (a bare SentencePiece model). Bad tokenizer files: ErnieIRError naming the file."""
    from ernie_ir.frontends.tokenizer import load_tokenizer, tokenizer_files, write_hf_tokenizer_json

    src = Path(spec)
    if not src.is_dir():
        return []
    tokenizer = load_tokenizer(src)  # reads (and so checks) the files before any is copied
    if tokenizer is None:
        return []
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for f in [*tokenizer_files(src), src / GENERATION_CONFIG]:
        if f.is_file():
            shutil.copyfile(f, dest / f.name)
            names.append(f.name)
    if tokenizer_json and "tokenizer.json" not in names:
        names += [p.name for p in write_hf_tokenizer_json(tokenizer, dest) if p.name not in names]
    return names
