"""The interpreter backend: an artifact's lowered rank graphs run by the reference interpreter."""

from ernie_ir.backends.interpreter.session import InterpreterSession

__all__ = ["InterpreterSession"]
