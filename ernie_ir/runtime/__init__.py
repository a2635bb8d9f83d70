"""Running graphs and artifacts: the reference interpreter (and, later, backends)."""

from ernie_ir.runtime.interpreter import Interpreter, run_graph

__all__ = ["Interpreter", "run_graph"]
