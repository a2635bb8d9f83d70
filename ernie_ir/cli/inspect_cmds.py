"""`ernie-ir show`, `explain`, `passes` and `ops`: print a model's IR, where a rewrite rule
matches, and the passes and ops there are."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from .common import (
    DisablePassOpt,
    EpOpt,
    LoraAdapterOpt,
    LoraAlphaOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    MergeLoraOpt,
    MetaOpt,
    ModelArg,
    PipelineOpt,
    QuantConfigOpt,
    QuantOpt,
    StopAfterOpt,
    TpOpt,
    TrustOpt,
    err,
    full_pipeline,
    load_rewritten,
    out,
    split_names,
)


def show(
    model: ModelArg,
    pipeline: PipelineOpt = None,
    summary: Annotated[bool, typer.Option("--summary", help="Print counts instead of the IR.")] = False,
    hashes: Annotated[bool, typer.Option("--hashes", help="Print a content hash per param.")] = False,
    print_before: Annotated[
        list[str] | None, typer.Option("--print-before", help="Print the IR before PASS (if it changes).")
    ] = None,
    print_after: Annotated[
        list[str] | None, typer.Option("--print-after", help="Print the IR after PASS (or say that it "
                                       "left the IR unchanged).")
    ] = None,
    dump_dir: Annotated[
        Path | None, typer.Option("--dump-dir", help="Write every step to numbered .ir files in a new "
                                  "or empty folder.")
    ] = None,
    timing: Annotated[bool, typer.Option("--timing", help="Print a timing table of the passes (each "
                                         "pass alone; verification and printing apart).")] = False,
    disable_pass: DisablePassOpt = None,
    stop_after: StopAfterOpt = None,
    quant: QuantOpt = None,
    quant_config: QuantConfigOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_adapter: LoraAdapterOpt = None,
    merge_lora: MergeLoraOpt = False,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    rank: Annotated[int, typer.Option("--rank", help="With --tp/--ep: which rank's graph to print.")] = 0,
    meta: MetaOpt = False,
    trust_pickle: TrustOpt = False,
) -> None:
    """Print a model's IR (exactly the text format, so it can be parsed back)."""
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.ir.printer import print_graph

    from .summary import summary_tables

    pipeline = full_pipeline(pipeline, quant, quant_config, lora_rank, lora_alpha, lora_targets,
                              lora_adapter, merge_lora)
    if tp != 1 or ep != 1:
        pipeline = ",".join(x for x in (pipeline, f"split{{tp={tp},ep={ep},rank={rank}}}") if x)
    elif rank:
        raise ErnieIRError("--rank needs --tp and/or --ep (a one-rank graph has rank 0 only)")
    graph = load_rewritten(model, pipeline, trust_pickle=trust_pickle, meta=meta,
                            print_before=split_names(print_before), print_after=split_names(print_after),
                            dump_dir=dump_dir, timing=timing, disable_pass=disable_pass,
                            stop_after=stop_after)
    if summary:
        for table in summary_tables(graph):
            out.print(table)
        return
    sys.stdout.write(print_graph(graph, with_hashes=hashes))


def explain(
    rule: Annotated[str, typer.Argument(help="A rewrite rule name (or a rewrite pass with one rule).")],
    model: ModelArg,
    pipeline: PipelineOpt = None,
    disable_pass: DisablePassOpt = None,
    stop_after: StopAfterOpt = None,
    trust_pickle: TrustOpt = False,
) -> None:
    """Say where a rewrite rule matches in a model, or why it does not."""
    from ernie_ir.passes import all_passes
    from ernie_ir.passes.infra.rewrite import RuleSet, find_rule

    r = find_rule(rule, all_passes())
    graph = load_rewritten(model, pipeline, trust_pickle=trust_pickle, disable_pass=disable_pass,
                            stop_after=stop_after)
    (trace,) = RuleSet([r]).explain(graph)
    out.print(trace.summary(), markup=False)
    for m in RuleSet([r]).find(graph)[:20]:
        root = m.nodes[0]
        out.print(f"  match: {root.op} at {root.scope or '<root>'} ({len(m.nodes)} nodes)", markup=False)


def passes() -> None:
    """List the passes and presets (built-in and plugins), with their options' defaults."""
    from ernie_ir.passes.infra.registry import REGISTRY, pass_listing

    for line in pass_listing(out.width):
        out.print(line, markup=False)
    if REGISTRY.broken:
        for b in REGISTRY.broken:
            err.print(f"error: plugin {b.name!r} ({b.target}) failed to load: {b.error}", markup=False)
        raise typer.Exit(2)


def ops_cmd() -> None:
    """List the ops (built-in and plugins): inputs, attributes, lowerings and origin."""
    from ernie_ir.ir.registry import REGISTRY, all_ops
    from ernie_ir.targets.coverage import lowering_status

    from .tables import KeyTable

    t = KeyTable("name", "inputs", "attrs", "onnx", "paddle", "origin", title="ops")
    for name, op in all_ops().items():
        ins = ", ".join(i.name + ("?" if i.optional else "") + ("..." if i.variadic else "")
                        for i in op.inputs)
        status = lowering_status(op)
        t.add_row(name, ins, ", ".join(op.Attrs.model_fields), status["onnx"], status["paddle"],
                  REGISTRY.origins.get(name, ""))
    out.print(t)
    for b in REGISTRY.broken:
        err.print(f"error: {b.describe()}", markup=False)
    if REGISTRY.broken:
        raise typer.Exit(2)
