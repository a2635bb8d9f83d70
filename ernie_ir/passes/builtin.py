"""Imports every built-in pass module (each registers itself) and the generic presets.

`ernie_ir.passes` hands this import to the registry as its loader, so the pass modules
load on the first lookup (`get_pass`, `all_passes`, building a pipeline), not when
`ernie_ir.passes` is imported.
"""

from __future__ import annotations

from .cleanup import canonicalize, cse, dce  # noqa: F401
from .decoding import kv_cache  # noqa: F401
from .finetune import full_param  # noqa: F401
from .fusion import linear_bias, parallel_block, qkv_gate_up  # noqa: F401
from .infra.registry import REGISTRY

if "O1" not in REGISTRY.presets:
    REGISTRY.add_preset("O1", "canonicalize,cse,dce", "Generic cleanup: canonicalize, CSE, DCE.")
if "O2" not in REGISTRY.presets:
    REGISTRY.add_preset("O2", "O1,fuse-linear-bias,fuse-parallel-block,fuse-qkv,fuse-gate-up,dce",
                        "O1, then fuse: biases, parallel attention+FFN blocks, q/k/v, gate/up.")
# after O1 and O2, so that the quantization presets are listed after them
from .lora import import_adapter, insert, merge  # noqa: F401
from .parallel import pipeline_stages, split  # noqa: F401
from .quant import annotate, calibrated, fp8, presets, qat, qat_convert, w4a8, weight_only, wint2  # noqa: F401
