"""Pass infrastructure and built-in passes, one subpackage per family.

- `infra/`: what a pass is (`base`), the registry, pipeline syntax and
  pipelines, the pass manager, instruments, rewrite rules and dataflow rules,
  and the param bookkeeping passes share.
- `cleanup/`: canonicalize, cse, dce.
- `quant/`: the quantization config and presets, `quant-annotate` and the
  passes that convert what it annotates (weight-only, FP8, QAT), and the CLI
  flags (`--quant`, `--lora-*`) as pipeline text.
- `lora/`: inserting, importing and merging LoRA adapters.
- `fusion/`: bias, q/k/v, gate/up and parallel-block fusion, and the
  projection model and lazy weight views they share.
- `parallel/`: `split`, the global graph into rank graphs; `pipeline-stages`, every rank
  graph into pipeline stages; the `rank_varying` analysis.
- `builtin`: imports every pass module above (each registers itself); the
  registry runs it on its first lookup.

The names below are the public API; import anything else from its module.
"""

import importlib

from .infra.base import NoOptions, Pass, PassContext, PassOptions, function_pass
from .infra.instruments import (
    DumpInstrument,
    PassInstrument,
    PrintIRInstrument,
    RewriteCountInstrument,
    TimingInstrument,
)
from .infra.manager import PassManager, PassVerificationError, PipelineResult, run_pipeline
from .infra.pipeline import Pipeline, build_pipeline, load_pipeline
from .infra.pipeline_syntax import PipelineError
from .infra.registry import REGISTRY as _REGISTRY
from .infra.registry import all_passes, all_presets, get_pass, register_pass, register_preset
from .infra.rewrite import (
    MatchContext,
    MatchResult,
    PatternBuilder,
    RewritePass,
    RewriteRule,
    RuleSet,
    Var,
    rewrite_pass,
)

__all__ = [
    "DumpInstrument",
    "MatchContext",
    "MatchResult",
    "NoOptions",
    "Pass",
    "PassContext",
    "PassInstrument",
    "PassManager",
    "PassOptions",
    "PassVerificationError",
    "PatternBuilder",
    "Pipeline",
    "PipelineError",
    "PipelineResult",
    "PrintIRInstrument",
    "RewriteCountInstrument",
    "RewritePass",
    "RewriteRule",
    "RuleSet",
    "TimingInstrument",
    "Var",
    "all_passes",
    "all_presets",
    "build_pipeline",
    "function_pass",
    "get_pass",
    "load_pipeline",
    "register_pass",
    "register_preset",
    "rewrite_pass",
    "run_pipeline",
]


def _load_builtin_passes() -> None:
    importlib.import_module("ernie_ir.passes.builtin")


_REGISTRY.add_loader(_load_builtin_passes)
