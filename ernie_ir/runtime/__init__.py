"""Running graphs and artifacts: the reference interpreter (and, later, backends)."""

from .interpreter import Interpreter, run_graph

__all__ = ["Interpreter", "run_graph"]
