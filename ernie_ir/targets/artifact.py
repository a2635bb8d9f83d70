"""The compiled artifact's target side (DESIGN.md section 6): `inference/launch.json` and
`inference/launch.sh` (or `training/...`), the launch recipe of a target: paddle.distributed.launch
with the target's flag and env; several ranks: one rank worker per device; several machines:
`launch.sh --nnodes N --node-rank R --master HOST:PORT` on each.

`launch_recipe` and `launch_script` turn a target's facts into those files; the writer itself
(atomic and locked), reading and verifying live in ernie_ir.artifacts (`artifacts.writer`,
`artifacts.manifest`), re-exported here under the names targets always had.
"""

from __future__ import annotations

from typing import Any

from ernie_ir.artifacts.manifest import (  # noqa: F401  (re-exported: the names targets always had)
    FORMAT,
    FORMAT_VERSION,
    FORMATS,
    MANIFEST,
    ArtifactError,
    artifact_mapping,
    load_artifact,
    load_rank_graphs,
    read_manifest,
    require_weights,
    verify_artifact,
)
from ernie_ir.artifacts.writer import ArtifactContents, check_out, write_artifact  # noqa: F401
from ernie_ir.targets.capabilities import HardwareTarget

WORKERS = {"inference": "ernie_ir.backends.paddle.rank_worker run",
           "training": "ernie_ir.training.rank_worker"}
"""The rank worker of each mode, as `python -m` takes it (module, then its subcommand)."""


def launch_recipe(target: HardwareTarget, mode: str, tp: int = 1) -> dict[str, Any]:
    """How the artifact is started on its devices (`tp`: the number of processes, one per rank).

    The launcher starts the rank worker once per device (one rank too): each process checks and
    loads its `rank{r}/`, builds its Paddle Layer for the device (the device's weight-only
    kernels where the kernel plan names them) and runs it; collectives run on the target's
    backend (nccl, xccl, bkcl). On a CPU, `ernie-ir run|train <artifact> --backend paddle`
    starts the same worker over gloo itself.
    """
    devices = ",".join(str(i) for i in range(tp))
    env = {target.visible_devices_env: devices, **target.extra_env}
    kind = target.device_kind
    extra = " --save" if mode == "training" else ""
    cpu = ("ernie-ir train <artifact> --steps N" if mode == "training" else
           "ernie-ir run <artifact> --tokens 1,2,3 --backend paddle")
    return {
        "target": target.name,
        "launcher": "python -m paddle.distributed.launch",
        "flag": target.launch_flag,
        "devices": devices,
        "nproc": tp,
        "collective_backend": target.collective_backend,
        "env": env,
        "paddle_device": target.paddle_device,
        "inference_config": target.inference_config,
        "entry": f"python -m {WORKERS[mode]} <artifact> --device {kind}{extra}",
        "worker": f"python -m {WORKERS[mode]}",
        "note": (f"{tp} process(es), one per rank: each checks and loads rank{{r}}/, builds its Paddle "
                 "Layer for the device (collectives are paddle.distributed calls) and rank 0 reports"),
        "cpu": {"collective_backend": "gloo", "command": cpu,
                "note": "one gloo process per rank on this machine's CPU"},
        "multi_node": {
            "flags": "--nnodes N --node-rank R --master HOST:PORT",
            "paddle_flags": "--nnodes N --rank R --master HOST:PORT --nproc_per_node NPROC/N",
            "note": ("run launch.sh (or the CPU command) on each of N machines with the same --nnodes and "
                     "--master (node 0's address and a free port) and its own --node-rank 0 .. N-1; N "
                     "divides nproc; node 0 holds rank 0: it reports and writes the checkpoints; the "
                     "artifact at the same path on every node (shared, for checkpoints)"),
            "nodes": {str(n): [f"launch.sh --nnodes {n} --node-rank {r} --master HOST:PORT" for r in range(n)]
                      for n in range(2, tp + 1) if tp % n == 0},
        },
        "mode": mode,
    }


def launch_script(recipe: dict[str, Any]) -> str:
    lines = ["#!/bin/sh",
             f"# ernie-ir launch recipe: target {recipe['target']}, {recipe['nproc']} process(es), "
             f"collective backend {recipe['collective_backend']}",
             'ARTIFACT="$(cd "$(dirname "$0")/.." && pwd)"']
    for k, v in recipe["env"].items():
        lines.append(f'export {k}="${{{k}:-{v}}}"')
    vis = next(iter(recipe["env"]))
    command = "train" if recipe.get("mode") == "training" else "run"
    # The rank worker, not `ernie-ir run`: that would run the CPU interpreter (every rank of it
    # in each process, for several ranks).
    kind = recipe["paddle_device"].split(":")[0]
    extra = " --save" if command == "train" else ""
    lines.append("# on a CPU instead: " + recipe["cpu"]["command"].replace("<artifact>", '"$ARTIFACT"'))
    lines.append('PYTHON="$(command -v python || command -v python3)" || exit 1')
    worker = f'"$PYTHON" -m {WORKERS[recipe.get("mode", "inference")]}'
    lines += _multi_node_lines(recipe, vis, f'{worker} "$ARTIFACT" --device {kind}{extra} "$@"')
    lines.append(f'exec {recipe["launcher"]} --nproc_per_node {recipe["nproc"]} {recipe["flag"]} '
                 f'"${{{vis}}}" {worker} "$ARTIFACT" --device {kind}{extra} "$@"')
    return "\n".join(lines) + "\n"


def _multi_node_lines(recipe: dict[str, Any], vis: str, entry: str) -> list[str]:
    """launch.sh's `--nnodes N --node-rank R --master HOST:PORT` (taken out of the arguments the
    worker gets): node R of N runs nproc / N processes on the first nproc / N visible devices,
    through paddle.distributed.launch's --nnodes/--rank/--master; node 0 first prints every
    node's command. Bad values: one line, exit 2, before anything starts."""
    nproc = int(recipe["nproc"])
    return [
        "# several machines: launch.sh --nnodes N --node-rank R --master HOST:PORT on each node (the same",
        "# N and HOST:PORT, node 0's address and a free port; R = 0 .. N-1; N divides "
        f"{nproc}); node 0 reports",
        'fail() { echo "error: $*" >&2; exit 2; }',
        "NNODES= NODE_RANK= MASTER=",
        'n=$#; i=0',
        'while [ "$i" -lt "$n" ]; do',
        '  a="$1"; shift; i=$((i + 1))',
        '  case "$a" in',
        '    --nnodes|--node-rank|--master)',
        '      [ "$i" -lt "$n" ] || fail "$a needs a value"',
        '      v="$1"; shift; i=$((i + 1))',
        '      case "$a" in --nnodes) NNODES="$v";; --node-rank) NODE_RANK="$v";; *) MASTER="$v";; esac;;',
        '    *) set -- "$@" "$a";;',
        '  esac',
        'done',
        '[ -n "$NNODES" ] || [ -z "$NODE_RANK$MASTER" ] || fail "--node-rank/--master need --nnodes N"',
        'if [ -n "$NNODES" ] && [ "$NNODES" != 1 ]; then',
        '  case "$NNODES" in ""|*[!0-9]*|0) fail "--nnodes $NNODES: give a number of nodes";; esac',
        f'  [ $(({nproc} % NNODES)) -eq 0 ] || fail "--nnodes $NNODES does not divide the {nproc} processes"',
        '  case "$NODE_RANK" in ""|*[!0-9]*) fail "--node-rank R (0 .. $((NNODES - 1))) is needed";; esac',
        '  [ "$NODE_RANK" -lt "$NNODES" ] || fail "--node-rank $NODE_RANK: outside [0, $NNODES)"',
        '  case "$MASTER" in ?*:[0-9]*) ;; *) fail "--master \\"$MASTER\\": expected HOST:PORT";; esac',
        f'  PER=$(({nproc} / NNODES))',
        f'  DEVS="$(echo "${{{vis}}}" | cut -d, -f1-"$PER")"',
        '  unset PADDLE_TRAINER_ID  # it would override --rank',
        '  if [ "$NODE_RANK" = 0 ]; then',
        '    r=0; while [ "$r" -lt "$NNODES" ]; do',
        '      echo "node $r: $0 --nnodes $NNODES --node-rank $r --master $MASTER $*" >&2; r=$((r + 1))',
        '    done',
        '  fi',
        f'  exec {recipe["launcher"]} --nnodes "$NNODES" --rank "$NODE_RANK" --master "$MASTER" '
        f'--nproc_per_node "$PER" {recipe["flag"]} "$DEVS" {entry}',
        'fi',
    ]
