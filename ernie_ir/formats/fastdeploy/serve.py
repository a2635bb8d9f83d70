"""How a FastDeploy folder is served: the `python -m fastdeploy.entrypoints.openai.api_server`
command, the `serve.sh` a FastDeploy artifact carries, and the `fastdeploy.LLM(...)` call.

The flag names are FastDeploy's (develop 8c3513a4, `../shared/fastdeploy`): `--model`,
`--tensor-parallel-size`, `--max-model-len`, `--max-num-seqs`, `--gpu-memory-utilization`,
`--max-num-batched-tokens`, `--load-choices` (engine/args_utils.py, `EngineArgs.add_cli_args`),
`--port`, `--metrics-port` (entrypoints/openai/utils.py, `make_arg_parser`) and
`--engine-worker-queue-port` (args_utils.py). No `--quantization`: every folder ernie-ir writes
names its quantization in config.json's `quantization_config`, which FastDeploy ranks above the
flag (model_executor/layers/quantization/__init__.py, `parse_quant_config`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from ernie_ir.formats.fastdeploy.checkpoint import SERVE_TP1

MODULE = "fastdeploy.entrypoints.openai.api_server"
SCRIPT = "serve.sh"
"""The file name of the launch script at the top of a FastDeploy artifact."""

PORTS = (("--port", "PORT", 8180), ("--metrics-port", "METRICS_PORT", 8181),
         ("--engine-worker-queue-port", "ENGINE_WORKER_QUEUE_PORT", 8182))
"""(flag, environment variable, default): the ports serve.sh passes (the values FastDeploy's own
ERNIE 4.5 examples use), each overridable by its variable or by the flag given to serve.sh."""

FASTDEPLOY_GPU_MEMORY_UTILIZATION = 0.9
FASTDEPLOY_MAX_NUM_BATCHED_TOKENS = 8192
"""FastDeploy's own defaults (an unset max_num_batched_tokens is 8192 under its default V1
scheduler): left off the command when the limits equal them."""


@dataclass(frozen=True)
class ServeLimits:
    """The engine flags a serve command carries; the defaults are what `ernie-ir plan` models for
    a cuda inference artifact when not told otherwise (planning.request: seq_len 4096 as
    --max-model-len, FastDeploy's --max-num-seqs 8, 0.9 and 8192)."""

    max_model_len: int = 4096
    max_num_seqs: int = 8
    gpu_memory_utilization: float = FASTDEPLOY_GPU_MEMORY_UTILIZATION
    max_num_batched_tokens: int = FASTDEPLOY_MAX_NUM_BATCHED_TOKENS


def serve_flags(tp: int, limits: ServeLimits | None = None, *, ours: bool = True) -> list[str]:
    """The api_server flags after `--model` (ports left out) for a folder of `tp` ranks. One rank
    of a folder ernie-ir wrote (`ours`) is read with FastDeploy's v0 loader (`--load-choices
    default`): its default v1 loader stops on a one-rank pre-quantized folder (`UnboundLocalError:
    fd_suffix_map`, model_executor/utils.py, rename_offline_ckpt_suffix_to_fd_suffix), and it is
    the loader the bf16 form was checked with. A published checkpoint (not `ours`) keeps
    FastDeploy's default loader."""
    lim = limits if limits is not None else ServeLimits()
    flags = ["--tensor-parallel-size", str(tp), "--max-model-len", str(lim.max_model_len),
             "--max-num-seqs", str(lim.max_num_seqs)]
    if lim.gpu_memory_utilization != FASTDEPLOY_GPU_MEMORY_UTILIZATION:
        flags += ["--gpu-memory-utilization", f"{lim.gpu_memory_utilization:g}"]
    if lim.max_num_batched_tokens != FASTDEPLOY_MAX_NUM_BATCHED_TOKENS:
        flags += ["--max-num-batched-tokens", str(lim.max_num_batched_tokens)]
    return flags + (SERVE_TP1.split() if tp == 1 and ours else [])


def serve_command(folder: str, tp: int, limits: ServeLimits | None = None, *, ours: bool = True) -> str:
    """The shell command that serves the FastDeploy folder `folder` on `tp` ranks: what serve.sh
    runs with its default ports (`ours`: see `serve_flags`)."""
    ports = [str(v) for flag, _, default in PORTS for v in (flag, default)]
    flags = serve_flags(tp, limits, ours=ours)
    return shlex.join(["python", "-m", MODULE, "--model", folder, *flags, *ports])


def llm_call(folder: str, tp: int, limits: ServeLimits | None = None) -> str:
    """The same engine from Python: `fastdeploy.LLM(...)` with the command's flags as keywords."""
    flags = serve_flags(tp, limits)
    pairs = zip(flags[::2], flags[1::2], strict=True)
    kwargs = [f"model={folder!r}", *(f"{flag[2:].replace('-', '_')}={_literal(v)}" for flag, v in pairs)]
    return f"LLM({', '.join(kwargs)})"


def _literal(value: str) -> str:
    try:
        float(value)
    except ValueError:
        return repr(value)
    return value


def serve_script(tp: int, limits: ServeLimits | None = None) -> str:
    """serve.sh: the api_server command for the folder it sits in, with the ports from the
    environment, the caller's arguments passed on after ours (argparse keeps a flag's last
    value), and the `fastdeploy.LLM` call in a comment."""
    lim = limits if limits is not None else ServeLimits()
    flags = " ".join(serve_flags(tp, lim))
    ports = " ".join(f'{flag} "${{{var}:-{default}}}"' for flag, var, default in PORTS)
    env = ", ".join(f"{var} ({default})" for _, var, default in PORTS)
    devices = "one GPU" if tp == 1 else f"{tp} GPUs (one per tensor-parallel rank)"
    return f"""#!/bin/sh
# Serves this folder (a FastDeploy checkpoint written by `ernie-ir compile`) with FastDeploy's
# OpenAI-compatible API server on {devices}.
# --max-model-len {lim.max_model_len} and --max-num-seqs {lim.max_num_seqs}: what `ernie-ir plan` models for
# this artifact; `ernie-ir plan <this folder> --device-memory 80GiB` says whether they fit.
# Ports: {env} from the environment.
# PYTHON: the interpreter that has FastDeploy (default: python).
# Arguments are passed on after these flags, and the last value of a flag wins:
#   ./serve.sh --max-model-len 8192 --port 9000
#
# The same engine from Python (offline generation):
#   from fastdeploy import LLM, SamplingParams
#   llm = {llm_call("<this folder>", tp, lim)}
#   print(llm.generate(["Hello"], SamplingParams(max_tokens=64))[0].outputs.text)
set -e
here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd -P)
exec "${{PYTHON:-python}}" -m {MODULE} --model "$here" \\
  {flags} \\
  {ports} "$@"
"""
