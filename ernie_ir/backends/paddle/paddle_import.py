"""`require_paddle`: the one place the runtime imports Paddle, lazily, with the install hint.

Paddle is an extra (`ernie-ir[paddle]`, or `paddlepaddle-gpu` installed by hand), so nothing
imports it at module level: the Paddle Layer (paddle_layer), the device probes (devices), the
training loop and the rank worker call `require_paddle()` when they need it. This module
imports nothing of the runtime, so each of them can import it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ernie_ir.ir import ErnieIRError

PADDLE_HINT = "install ernie-ir[paddle] or paddlepaddle-gpu"


class PaddleMissingError(ErnieIRError):
    """PaddlePaddle is needed for this and is not installed."""


def require_paddle() -> Any:
    """The `paddle` module, or PaddleMissingError with the install hint."""
    # Paddle's C++ logging and its extension loader's ccache warning are noise to our users.
    os.environ.setdefault("GLOG_minloglevel", "2")
    import signal
    import threading

    term = signal.getsignal(signal.SIGTERM)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*ccache.*")
            import paddle
    except ImportError:
        raise PaddleMissingError(f"PaddlePaddle is not installed: {PADDLE_HINT}") from None
    if callable(term) and threading.current_thread() is threading.main_thread():
        # Paddle's import puts its own C++ SIGTERM handler in place (it aborts, so no cleanup
        # runs); give back the one the program had (the CLI's: clean up like Ctrl-C).
        signal.signal(signal.SIGTERM, term)
    return paddle
