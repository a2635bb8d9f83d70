"""One rank of test_gloo_vocab_loss's PyLayer check (started by paddle.distributed.launch).

argv: the folder holding cases.npz; writes rank{R}.npz (per case: the per-token loss and this
rank's d logits)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ernie_ir.backends.paddle.layer import require_paddle
from ernie_ir.backends.paddle.rank_worker import init_process_group, world_from_env
from ernie_ir.training.vocab_parallel import vocab_parallel_cross_entropy


def main() -> None:
    paddle = require_paddle()
    rank, world = world_from_env()
    init_process_group(rank, world, timeout_s=60)
    folder = Path(sys.argv[1])
    cases = np.load(folder / "cases.npz")
    out: dict[str, np.ndarray] = {}
    for c in range(int(cases["count"])):
        logits, labels, grad, cuts = (cases[f"{k}{c}"] for k in ("logits", "labels", "grad", "cuts"))
        lo, hi = int(cuts[rank]), int(cuts[rank + 1])
        x = paddle.to_tensor(logits[:, lo:hi], stop_gradient=False)
        loss = vocab_parallel_cross_entropy(x, paddle.to_tensor(labels), lo, ignore_index=-100, world=world)
        (loss * paddle.to_tensor(grad)).sum().backward()
        out[f"loss{c}"], out[f"grad{c}"] = loss.numpy(), x.grad.numpy()
    np.savez(folder / f"rank{rank}.npz", **out)


if __name__ == "__main__":
    main()
