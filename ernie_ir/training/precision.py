"""The mixed-precision recipe of a training artifact: the engines' (Paddle's `AdamW(multi_precision=True)`,
ERNIEKit's `fp16_opt_level: O2`), recorded by compile in `training/train.json` (`precision`) and
in the manifest (`training_precision`), sized by `ernie-ir plan`.

    params             the trainable params' stored dtype (bf16 for ERNIE 4.5 checkpoints)
    gradients          one per trainable param, in its dtype (widened to f32 inside the AdamW kernel)
    master_weights     f32 copies of the trainable params not already f32 (multi_precision=True)
    moments            AdamW's m and v: f32 (default) or bf16 (`--moment-dtype bf16`: Paddle's
                       `use_lowprecision_moment`, ERNIEKit's option of that name)
    offload_optimizer  moments and master weights in (pinned) host memory (`--offload-optimizer`)

On a device the rank worker builds `paddle.optimizer.AdamW(multi_precision=True,
use_lowprecision_moment=moments == bf16)` (`adamw_kwargs`). On a CPU (no bf16 matmul kernels)
the Layer computes in f32 and AdamW keeps f32 moments: `cpu_line` says so, with what a device
run would keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ernie_ir.ir import DType, ErnieIRError, Graph

MOMENT_DTYPES = {"float32": "f32", "fp32": "f32", "f32": "f32", "bf16": "bf16", "bfloat16": "bf16"}
"""--moment-dtype spellings -> the dtype recorded (the IR's names)."""
DEFAULT_MOMENTS = "f32"


def moment_dtype(text: str) -> str:
    """The moment dtype `--moment-dtype TEXT` names (f32 or bf16); ErnieIRError, one line, else."""
    name = MOMENT_DTYPES.get(str(text).strip().lower())
    if name is None:
        raise ErnieIRError(f"--moment-dtype {text!r}: choose float32 (AdamW's f32 moments, the default) or "
                           "bf16 (Paddle's use_lowprecision_moment)")
    return name


@dataclass(frozen=True)
class Precision:
    """The recipe (see the module docstring): per-param dtypes as the IR names them."""

    params: str
    """The trainable params' dtype; several joined by "+" (e.g. "bf16+f32")."""
    moments: str = DEFAULT_MOMENTS
    offload_optimizer: bool = False

    @property
    def master_weights(self) -> str:
        """f32 when some trainable param is not f32 (Paddle keeps a master copy of each), else none."""
        return "f32" if any(d != "f32" for d in self.params.split("+")) else "none"

    def section(self) -> dict[str, Any]:
        """The `precision` section of train.json (and the manifest's `training_precision`)."""
        lowp = self.moments == "bf16"
        return {"params": self.params, "gradients": self.params, "master_weights": self.master_weights,
                "moments": self.moments, "offload_optimizer": self.offload_optimizer,
                "device_optimizer": f"paddle.optimizer.AdamW(multi_precision=True, "
                                    f"use_lowprecision_moment={lowp})",
                "cpu": "f32: the Layer computes in f32 (CPUs have no bf16 matmul kernels); AdamW keeps "
                       "f32 moments and no master weights"}

    def record(self) -> dict[str, Any]:
        """The dtypes and the offload alone (the manifest's `training_precision`)."""
        return {k: v for k, v in self.section().items() if k not in ("device_optimizer", "cpu")}

    @classmethod
    def from_recipe(cls, recipe: dict[str, Any]) -> Precision | None:
        """The recipe a train.json records (None: an artifact compiled before it was recorded)."""
        sec = recipe.get("precision")
        if not isinstance(sec, dict) or not isinstance(sec.get("params"), str):
            return None
        return cls(str(sec["params"]), moment_dtype(sec.get("moments", DEFAULT_MOMENTS)),
                   bool(sec.get("offload_optimizer", False)))

    def device_summary(self) -> str:
        offload = ", optimizer states in host memory" if self.offload_optimizer else ""
        return (f"params {self.params}, gradients {self.params}, master weights {self.master_weights}, "
                f"AdamW moments {self.moments}{offload}")

    def cpu_line(self) -> str:
        """`train`'s one line on a CPU run: it trains in f32; what a device run would keep."""
        return (f"precision: this CPU run trains in f32 (no bf16 matmuls on CPU); a device run keeps "
                f"{self.device_summary()} (paddle.optimizer.AdamW multi_precision=True)")

    def adamw_kwargs(self, paddle: Any) -> dict[str, Any]:
        """AdamW's precision arguments on Paddle's current device: on a CPU none (f32 training),
        elsewhere multi_precision (f32 masters of bf16/f16 params) and use_lowprecision_moment
        (bf16 moments) as recorded."""
        if str(paddle.device.get_device()).startswith("cpu"):
            return {}
        return {"multi_precision": True, "use_lowprecision_moment": self.moments == "bf16"}


def precision_of(graph: Graph, moments: str | None = None, offload_optimizer: bool = False) -> Precision:
    """The recipe of a training graph: its trainable params' dtypes, `moments` (a --moment-dtype
    spelling; None: f32) and the offload."""
    dtypes = sorted({str(p.type.dtype) for p in graph.params.values() if p.trainable},
                    key=lambda d: (d == str(DType.F32), d))
    return Precision("+".join(dtypes) or str(DType.F32),
                     DEFAULT_MOMENTS if moments is None else moment_dtype(moments), offload_optimizer)
