"""Pass infrastructure and built-in passes.

- `base`: what a pass is (`Pass`, `function_pass`, options, properties).
- `rewrite`: declarative rules (pattern / check / rewrite), rule sets, tracer.
- `pipeline`: pipeline text and YAML, validation, presets.
- `manager`: running a pipeline with verification and instruments.
- `instruments`: timing, IR printing, dumps, rewrite counts.
- one module per built-in pass (`dce`, `cse`, `canonicalize`, ...).
"""

from .base import NoOptions, Pass, PassContext, PassOptions, PipelineError, function_pass
from .instruments import (
    DumpInstrument,
    PassInstrument,
    PrintIRInstrument,
    RewriteCountInstrument,
    TimingInstrument,
)
from .manager import PassManager, PassVerificationError, PipelineResult, run_pipeline
from .pipeline import Pipeline, build_pipeline, load_pipeline
from .registry import all_passes, all_presets, get_pass, register_pass, register_preset
from .rewrite import (
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
