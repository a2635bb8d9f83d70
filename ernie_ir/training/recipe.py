"""The training executable of an artifact: `training/train.json`, what `ernie-ir train` reads.

`training_recipe(graph, target, mapping)`: the trainable params, the QAT state params, the
run's defaults (optimizer, schedule, batch, padding: TrainOptions' defaults, written by
`training.loop.recipe_sections`), the mixed-precision recipe (`precision`:
ernie_ir.training.precision) and the launch command on the target's
devices (several ranks: the training rank worker, `python -m ernie_ir.training.rank_worker`,
once per device). The target reaches it as data (`DeviceLaunch`: the facts a launch line
needs, which every `HardwareTarget` has), so training never imports a target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.mapping import Mapping
from ernie_ir.training.launch import WORKER
from ernie_ir.training.precision import Precision, precision_of

TRAIN_RECIPE = "train.json"


class DeviceLaunch(Protocol):
    """What a training launch line needs of a target (every HardwareTarget has these)."""

    name: str
    paddle_device: str
    visible_devices_env: str
    launch_flag: str
    extra_env: dict[str, str]
    collective_backend: str

    @property
    def device_kind(self) -> str: ...


class TrainingModeError(ErnieIRError):
    """A training artifact was asked for but the pipeline leaves nothing to train."""


def check_trainable(graph: Graph) -> list[str]:
    """The trainable params of `graph`; TrainingModeError if there are none."""
    names = [p.name for p in graph.params.values() if p.trainable]
    if not names:
        raise TrainingModeError("--mode training needs trainable params, and this pipeline leaves none: "
                                "keep full-param in it (full-parameter training, compile's default), or "
                                "add LoRA (--lora-rank R) or QAT (--quant qat-int8)")
    return names


def training_recipe(graph: Graph, target: DeviceLaunch, mapping: Mapping | None = None, *,
                    precision: Precision | None = None) -> dict[str, Any]:
    """`train.json` of `graph` for `target`'s devices (one rank graph; `mapping`: the layout;
    `precision`: the mixed-precision recipe, None: `precision_of(graph)`, f32 moments, no offload)."""
    from ernie_ir.training.loop import recipe_sections

    trainable = check_trainable(graph)
    state = sorted(p.name for p in graph.params.values() if "qat_state" in p.annotations)
    lr_mult = {p.name: float(p.annotations["learning_rate"]) for p in graph.params.values()
               if p.trainable and "learning_rate" in p.annotations}
    frozen = sorted(p.name for p in graph.params.values() if not p.trainable and p.name not in state)
    vocab = graph.outputs[0].type.shape[-1] if graph.outputs else None
    world = 1 if mapping is None else mapping.world_size
    processes = 1 if mapping is None else mapping.processes  # dp replicas share the rank graphs
    devices = ",".join(str(i) for i in range(processes))
    # On the device, the rank worker trains each rank's Layer with the device's kernels (one
    # rank too): never the CPU path of `ernie-ir train`.
    kind = target.device_kind
    device_cmd = (f'{target.visible_devices_env}={devices} python -m paddle.distributed.launch '
                  f'--nproc_per_node {processes} {target.launch_flag} {devices} '
                  f'"$(command -v python)" -m {WORKER} '
                  f"<artifact> --device {kind} --save --steps N [--data FILE.jsonl] "
                  "[--config train.yaml|json]")
    if processes > 1:
        replicas = mapping is not None and mapping.dp > 1
        dp = f", {mapping.dp} data-parallel replicas of {world}" if mapping is not None and replicas else ""
        cpu_cmd = (f"ernie-ir train <artifact> --steps N [--data FILE.jsonl] [--config train.yaml] "
                   f"[--lr X ...]   ({processes} gloo "
                   f"processes, one per rank{dp})")
        checkpoints = ("training/checkpoints/run-K-step-N/ (at the end and every --save-steps): "
                       "params.safetensors (trainable params + QAT state at global names and shapes, "
                       "merged by the shard annotations), rank{r}.safetensors (each rank's slices), "
                       "optimizer.rank{r}.safetensors (each rank's AdamW state) and trainer_state.json "
                       "(step, options, data position, RNG state: --resume continues it); rank{r}/ is "
                       "never modified")
    else:
        cpu_cmd = "ernie-ir train <artifact> --steps N [--data FILE.jsonl] [--config train.yaml] [--lr X ...]"
        checkpoints = ("training/checkpoints/run-K-step-N/ (at the end and every --save-steps): "
                       "params.safetensors (trainable params + QAT state), optimizer.rank0.safetensors "
                       "(AdamW state) and trainer_state.json (step, options, data position, RNG state: "
                       "--resume continues it); rank0/ is never modified")
    return {
        "format": "ernie-ir-training", "version": 1,
        "graph": "rank{rank}/graph.ir", "weights": "rank{rank}/weights.safetensors",
        "world_size": world,
        "trainable": trainable, "learning_rate_multipliers": lr_mult, "qat_state": state,
        "frozen_count": len(frozen),
        "loss": ("next-token cross-entropy on logits[:, :-1] vs labels[:, 1:], the mean over the real "
                 "target tokens of the step (labels equal to padding.ignore_index neither counted nor "
                 "averaged over; accumulated batches weighted by their token counts)"),
        **recipe_sections(),  # optimizer, schedule, batch, padding: TrainOptions' defaults
        "precision": (precision or precision_of(graph)).section(),
        "vocab_size": vocab,
        "data": 'jsonl, one {"input_ids": [...]} per line',
        "checkpoints": checkpoints,
        "device": {"paddle_set_device": target.paddle_device, "cpu": "cpu"},
        "launch": {"cpu": cpu_cmd, target.name: device_cmd},
        "env": {target.visible_devices_env: devices, **target.extra_env},
        "collective_backend": target.collective_backend,
        **({"cpu_collective_backend": "gloo"} if processes > 1 else {}),
        **({"data_parallel": {"dp": mapping.dp, "sharding": mapping.sharding, "processes": processes}}
           if mapping is not None and mapping.dp > 1 else {}),
    }


def emit_paddle_training(graph: Graph, folder: Path, target: DeviceLaunch, mapping: Mapping | None = None,
                         precision: Precision | None = None) -> dict[str, Any]:
    recipe = training_recipe(graph, target, mapping, precision=precision)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / TRAIN_RECIPE).write_text(json.dumps(recipe, indent=2) + "\n", encoding="utf-8")
    return {"format": "paddle-training", "recipe": f"training/{TRAIN_RECIPE}",
            "trainable": len(recipe["trainable"]), "qat_state": len(recipe["qat_state"])}
