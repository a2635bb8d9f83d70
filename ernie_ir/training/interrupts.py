"""`deferred_signals`: SIGINT and SIGTERM held back while a checkpoint is published.

Publishing a checkpoint is several steps (rename the staged folder, list its files in the
manifest, write a LoRA run's `adapter/`, remove the checkpoints past `save_total_limit`); an
interrupt between two of them would leave a folder the manifest does not list, or a LoRA
checkpoint without its adapter. Inside the block a SIGINT or SIGTERM is only recorded; on leaving
it, the previous handlers are back and the first signal recorded is raised again, so Ctrl-C still
ends the run (as a KeyboardInterrupt, or whatever handler the caller installed), right after the
checkpoint is whole.

Only the main thread can install signal handlers: elsewhere the block defers nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block, then deliver the first one that arrived."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def record(signum: int, _frame: Any) -> None:
        pending.append(signum)

    previous = {s: signal.signal(s, record) for s in HELD}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending:
            signal.raise_signal(pending[0])
