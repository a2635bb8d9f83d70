"""The pass manager: verification after each pass, the "changed" contract, requires/produces,
properties on the graph, and instruments (timing, IR printing, dumps, rewrite counts)."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
from _passes_testkit import assert_ir, cli, ir, registered

from ernie_ir.ir import Graph
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.verifier import verify_problems
from ernie_ir.passes import (
    DumpInstrument,
    Pass,
    PassContext,
    PassInstrument,
    PassManager,
    PassOptions,
    PassVerificationError,
    PipelineError,
    PrintIRInstrument,
    RewriteCountInstrument,
    TimingInstrument,
    build_pipeline,
    function_pass,
    load_pipeline,
    run_pipeline,
)
from ernie_ir.passes.infra.manager import PassContractError
from ernie_ir.passes.infra.pipeline_syntax import parse_pipeline_text

# -- test passes ----------------------------------------------------------------------------------


@function_pass("t-break-types", "Rebinds silu's input to a bf16 value (a deliberately broken pass).")
def break_types(graph: Graph, options: PassOptions, ctx: PassContext) -> bool:
    silu = graph.nodes_by_op("silu")[0]
    silu.set_input(0, graph.value_by_name("m"))
    return True


@function_pass("t-force-erase", "Erases a node that is still read (a deliberately broken pass).")
def force_erase(graph: Graph, options: PassOptions, ctx: PassContext) -> bool:
    assert graph.first is not None
    graph.erase(graph.first, force=True)
    return True


@function_pass("t-liar", "Changes a scope but says it changed nothing.")
def liar(graph: Graph, options: PassOptions, ctx: PassContext) -> bool:
    assert graph.first is not None
    graph.first.scope = "moved"
    return False


@function_pass("t-boaster", "Says it changed the graph but does not.")
def boaster(graph: Graph, options: PassOptions, ctx: PassContext) -> bool:
    return True


@function_pass("t-quantize", "Establishes `t.quantized` (without touching the graph).",
               produces=("t.quantized",))
def quantize(graph: Graph, options: PassOptions, ctx: PassContext) -> bool:
    return False


@function_pass("t-pack", "Needs `t.quantized`, establishes `t.packed`.", requires=("t.quantized",),
               produces=("t.packed",))
def pack(graph: Graph, options: PassOptions, ctx: PassContext) -> bool:
    return False


@function_pass("t-dequantize", "Undoes `t.quantized`.", invalidates=("t.quantized",))
def dequantize(graph: Graph, options: PassOptions, ctx: PassContext) -> bool:
    return False


@function_pass("t-needs-magic", "Needs a property no pass produces.", requires=("t.magic",))
def needs_magic(graph: Graph, options: PassOptions, ctx: PassContext) -> bool:
    return False


class TagOptions(PassOptions):
    label: str = "tagged"


class Tag(Pass):
    """Records `label` in the graph metadata (a pass with a string option)."""

    name = "t-tag"
    description = "Writes its label into the graph metadata."
    Options = TagOptions

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        assert isinstance(self.options, TagOptions)
        if graph.metadata.get("tag") == self.options.label:
            return False
        graph.metadata["tag"] = self.options.label
        ctx.count("tags")
        return True


TEST_PASSES = (break_types, force_erase, liar, boaster, quantize, pack, dequantize, needs_magic, Tag)


@pytest.fixture(autouse=True)
def test_passes() -> Iterator[None]:
    with registered(*TEST_PASSES):
        yield


GRAPH = """
graph @g(%x: f32[B,4], %m: bf16[B,4]) -> (y: f32[B,4], n: bf16[B,4]) {
  %0 = silu(%x) : f32[B,4] loc("act")
  %1 = silu(%x) : f32[B,4] loc("act2")
  %2 = reshape(%0) {shape = [0, 2, 2]} : f32[B,2,2]
  %3 = reshape(%2) {shape = [0, 4]} : f32[B,4]
  %4 = add(%3, %1) : f32[B,4]
  %5 = gelu(%m) : bf16[B,4]
  return %4, %5
}
"""

# -- verification after each pass ---------------------------------------------------------------


def test_the_verifier_names_the_pass_that_broke_the_ir_and_the_passes_before_it():
    g = ir(GRAPH)
    with pytest.raises(PassVerificationError) as e:
        run_pipeline(g, "canonicalize,cse,t-break-types,dce")
    assert str(e.value) == (
        "IR is invalid after pass t-break-types (pass 3; ran before it: canonicalize, cse): "
        "node #0 silu at act: outputs are typed f32[B,4] but the op produces bf16[B,4]")


def test_the_verifier_catches_a_forced_erase_and_counts_every_problem():
    g = ir("""
    graph @g(%x: f32[4]) -> (y: f32[4]) {
      %0 = silu(%x) : f32[4] loc("erased")
      %1 = gelu(%0) : f32[4] loc("reader1")
      %2 = add(%0, %1) : f32[4] loc("reader2")
      return %2
    }""")
    with pytest.raises(PassVerificationError) as e:
        run_pipeline(g, "t-tag{label=x},t-force-erase")
    assert str(e.value) == (
        "IR is invalid after pass t-force-erase (pass 2; ran before it: t-tag{label=x}): "
        "node #0 gelu at reader1: input x is not defined in this graph (its producer was erased "
        "or it belongs to another graph) (and 1 more)")


def test_the_first_pass_breaking_the_ir_says_nothing_ran_before_it():
    with pytest.raises(PassVerificationError, match=r"after pass t-force-erase \(pass 1; ran before "
                                                    r"it: none\)"):
        run_pipeline(ir(GRAPH), "t-force-erase")


def test_without_debug_mode_the_manager_does_not_verify():
    g = ir(GRAPH)
    run_pipeline(g, "t-break-types", debug=False)
    assert verify_problems(g)  # broken, and nobody said so: that is what debug mode is for


def test_a_pass_that_changes_the_graph_but_returns_false_breaks_its_contract():
    with pytest.raises(PassContractError, match=r"^pass t-liar changed the graph but returned False"):
        run_pipeline(ir(GRAPH), "dce,t-liar")


def test_a_pass_that_claims_a_change_it_did_not_make_is_recorded_as_unchanged():
    result = run_pipeline(ir(GRAPH), "t-boaster")
    assert (result.changed, result.changed_by) == (False, [])


# -- requires / produces -------------------------------------------------------------------------


def test_ordering_errors_are_found_when_the_pipeline_is_built():
    with pytest.raises(PipelineError) as e:
        load_pipeline("t-pack,t-quantize")
    assert str(e.value) == ("pass t-pack (position 1) requires t.quantized, which no earlier pass "
                            "produces; run t-quantize before it")


def test_an_invalidated_property_must_be_produced_again():
    load_pipeline("t-quantize,t-pack,t-dequantize")
    with pytest.raises(PipelineError, match=r"^pass t-pack \(position 3\) requires t.quantized, which "
                                            r"no earlier pass produces; run t-quantize before it$"):
        load_pipeline("t-quantize,t-dequantize,t-pack")
    load_pipeline("t-quantize,t-dequantize,t-quantize,t-pack")


def test_an_ordering_error_without_a_provider_has_no_hint():
    with pytest.raises(PipelineError) as e:
        load_pipeline("dce,t-needs-magic")
    assert str(e.value) == ("pass t-needs-magic (position 2) requires t.magic, which no earlier pass "
                            "produces")


def test_properties_the_graph_already_has_satisfy_requires():
    load_pipeline("t-pack", initial={"t.quantized"})
    g = ir(GRAPH)
    run_pipeline(g, "t-quantize")
    run_pipeline(g, "t-pack")  # a pipeline given as text starts from the graph's properties
    assert g.metadata["properties"] == ["t.packed", "t.quantized"]


def test_properties_are_recorded_on_the_graph_and_printed_with_it():
    g = ir(GRAPH)
    result = run_pipeline(g, "t-quantize,t-pack")
    assert g.metadata["properties"] == ["t.packed", "t.quantized"]
    # The manager records properties; the passes changed nothing and said so truthfully.
    assert not result.changed
    assert '  meta {properties = ["t.packed", "t.quantized"]}\n' in print_graph(g)
    assert parse_graph(print_graph(g)).metadata["properties"] == ["t.packed", "t.quantized"]
    run_pipeline(g, "t-dequantize")
    assert g.metadata["properties"] == ["t.packed"]


def test_the_manager_checks_requires_against_the_graph_at_run_time():
    unchecked = build_pipeline(parse_pipeline_text("t-pack"), check_order=False)
    with pytest.raises(PipelineError, match=r"^pass t-pack requires t.quantized, which this graph does "
                                            r"not have$"):
        PassManager(unchecked).run(ir(GRAPH))


# -- instruments ------------------------------------------------------------------------------------


class Snapshots(PassInstrument):
    """A user-written instrument: the IR text after every pass."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def enter_pipeline(self, pipeline, graph: Graph) -> None:
        self.texts.append(print_graph(graph))

    def after_pass(self, index, p, graph, changed, ctx) -> None:
        self.texts.append(print_graph(graph))


def test_timing_rows_follow_the_pipeline():
    timing = TimingInstrument()
    run_pipeline(ir(GRAPH), "canonicalize,cse,dce,t-tag{label=\"a b\"}", instruments=[timing])
    assert [(r.index, r.spec, r.changed) for r in timing.rows] == [
        (1, "canonicalize", True), (2, "cse", True), (3, "dce", False), (4, 't-tag{label="a b"}', True)]
    assert all(r.seconds >= 0 for r in timing.rows)
    assert timing.total == pytest.approx(sum(r.seconds for r in timing.rows))


def test_print_ir_prints_around_the_chosen_passes_only_when_they_change_the_graph():
    printed: list[str] = []
    snaps = Snapshots()
    run_pipeline(ir(GRAPH), "cse,canonicalize,cse,dce",
                 instruments=[snaps, PrintIRInstrument(printed.append, before=["cse"], after=["cse",
                                                                                              "dce"])])
    # cse #1 changed the graph; cse #3 found nothing more; dce found nothing dead (both said so).
    assert printed == [
        f"// ----- IR before cse (pass 1) -----\n{snaps.texts[0]}",
        f"// ----- IR after cse (pass 1) -----\n{snaps.texts[1]}",
        "// ----- cse (pass 3) left the IR unchanged -----",
        "// ----- dce (pass 4) left the IR unchanged -----",
    ]


def test_print_ir_star_means_every_pass():
    printed: list[str] = []
    run_pipeline(ir(GRAPH), "canonicalize,dce,cse", instruments=[PrintIRInstrument(printed.append,
                                                                                 after=["*"])])
    assert [text.split("\n", 1)[0] for text in printed] == [
        "// ----- IR after canonicalize (pass 1) -----", "// ----- dce (pass 2) left the IR unchanged -----",
        "// ----- IR after cse (pass 3) -----"]


def test_dumps_are_numbered_with_a_replay_header_and_parse_back(tmp_path: Path):
    folder = tmp_path / "dump dir"  # a space: the replay command must quote the path
    dump = DumpInstrument(folder)
    snaps = Snapshots()
    g = ir(GRAPH)
    run_pipeline(g, "canonicalize,t-tag{label=\"it's\"},cse,dce", instruments=[snaps, dump])
    assert [p.name for p in dump.files] == ["000-input.ir", "001-canonicalize.ir", "002-t-tag.ir",
                                            "003-cse.ir", "004-dce.ir"]
    assert sorted(folder.iterdir()) == dump.files
    remaining = ["canonicalize,t-tag{label=\"it's\"},cse,dce", "t-tag{label=\"it's\"},cse,dce",
                 "cse,dce", "dce", ""]
    for step, (path, text, rest) in enumerate(zip(dump.files, snaps.texts, remaining, strict=True)):
        lines = path.read_text(encoding="utf-8").split("\n")
        assert lines[0] == f"// ernie-ir dump, step {step}: {path.stem[4:] if step else 'input'}"
        assert lines[1] == "// pipeline: canonicalize,t-tag{label=\"it's\"},cse,dce"
        prefix = "// replay from this step: "
        assert lines[2].startswith(prefix)
        assert shlex.split(lines[2][len(prefix):]) == ["ernie-ir", "show", str(path), "--pipeline",
                                                       rest]
        dumped = parse_graph(path.read_text(encoding="utf-8"), source=str(path))
        assert "\n".join(lines[3:]) == text
        assert_ir(dumped, parse_graph(text))
    assert_ir(g, parse_graph(snaps.texts[-1]))


def test_a_dump_replays_to_the_same_final_graph(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    dump = DumpInstrument(tmp_path / "steps")
    g = ir(GRAPH)
    run_pipeline(g, "canonicalize,t-tag{label=\"it's\"},cse,dce", instruments=[dump])
    header = dump.files[1].read_text(encoding="utf-8").split("\n")[2]
    argv = shlex.split(header.split(": ", 1)[1])
    assert argv[0] == "ernie-ir"
    code, out, err = cli(capsys, *argv[1:])
    assert (code, err) == (0, "")
    assert_ir(parse_graph(out), g)


def test_rewrite_counts_reach_the_pipeline_result_and_the_instrument():
    counts = RewriteCountInstrument()
    result = run_pipeline(ir(GRAPH), "canonicalize,cse,t-tag,dce,t-tag", instruments=[counts])
    expected = {
        "1:canonicalize": {"fold-reshape-chain": 1, "identity-reshape": 1},
        "2:cse": {"merged": 1},
        "3:t-tag": {"tags": 1},
    }
    assert result.stats == expected
    assert counts.counts == expected
    assert result.changed_by == ["canonicalize", "cse", "t-tag"]

