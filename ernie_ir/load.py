"""Resolving a MODEL argument (CLI, golden cases) into a Graph.

MODEL may be an IR text file (`*.ir`), a graph folder (`graph.ir` +
`weights.safetensors`), a checkpoint folder, or a built-in model name such as
`ernie-4.5-0.3b@tiny`; the last two are the frontends' business.
"""

from __future__ import annotations

from pathlib import Path

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.storage import GRAPH_FILE, load_graph


def load_input(spec: str, *, trust_pickle: bool = False) -> Graph:
    path = Path(spec)
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
        from ernie_ir.targets import load_artifact

        return load_artifact(path)  # verifies every hash first
    if path.is_dir() and (path / GRAPH_FILE).is_file():
        return load_graph(path)
    try:
        from ernie_ir import frontends
    except ImportError as e:  # pragma: no cover - frontends ship with the package
        raise ErnieIRError(f"cannot load {spec!r}: frontends unavailable ({e})") from None
    load_model = getattr(frontends, "load_model", None)
    if load_model is None:
        raise ErnieIRError(f"{spec!r} is neither an IR file nor a graph folder")
    return load_model(spec, trust_pickle=trust_pickle)
