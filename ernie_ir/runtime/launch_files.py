"""The files the launcher (launcher.py) and the rank worker (paddle_dist.py) both name.

The launcher starts the rank worker as a file and reads what the ranks leave behind: the
one-line error of a failing rank, and the staging folder of a checkpoint that a failed run
must remove. Both sides take the names from here, so neither imports the other.
"""

from __future__ import annotations

from pathlib import Path

ERROR_FILE = "error.rank{rank}.txt"
"""Where a failing rank writes its one-line error (in $ERNIE_IR_WORKDIR), for the launcher."""
CHECKPOINTS = Path("training") / "checkpoints"


def staging_dir(root: Path, master: str) -> Path:
    """Where the ranks of the launch whose rendezvous is `master` (host:port) stage a checkpoint:
    one launch, one port, so the name is the same on every rank and unique per run."""
    return root / CHECKPOINTS / f".partial-{master.replace(':', '-')}"
