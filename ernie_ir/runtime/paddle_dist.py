"""Moved: the rank workers are `python -m ernie_ir.backends.paddle.rank_worker` (run, generate)
and `python -m ernie_ir.training.rank_worker` (train). A `launch.sh` written before the move
looks this module up and runs it as a file; it then stops here with one line that says so."""

import sys

if __name__ == "__main__":
    print("error: this artifact's launch.sh was written by an older ernie-ir (its rank worker "
          "moved): recompile the artifact with this ernie-ir", file=sys.stderr)
    sys.exit(2)
