"""IR read from disk is checked as IR given on the command line: every op attribute's range and the
model config in `meta` (issue 41), whether it comes as an `.ir` file, a graph folder or an artifact."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from ernie_ir.frontends import load_model
from ernie_ir.ir import IRParseError
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.storage import load_graph, save_graph


@pytest.fixture(scope="module")
def text() -> str:
    return print_graph(load_model("gpt-345m@tiny"))


def test_a_non_finite_config_number_in_meta_is_refused_naming_the_key(text: str) -> None:
    # the first "eps = 1e-05" is the config's layer_norm_eps, which no op reads at run time
    bad = text.replace("eps = 1e-05", "eps = 1e309", 1)
    assert "layer_norm_eps = 1e309" in bad
    with pytest.raises(IRParseError, match=r"^x\.ir:2:\d+: meta config\.layer_norm_eps: 1e309 is not a "
                                           r"finite number: write a finite value$"):
        parse_graph(bad, source="x.ir")
    for literal in ("inf", "-inf", "nan"):
        with pytest.raises(IRParseError, match=rf"meta config\.layer_norm_eps: {literal} is not a finite"):
            parse_graph(text.replace("eps = 1e-05", f"eps = {literal}", 1), source="x.ir")


def test_other_metadata_keeps_inf_and_nan(text: str) -> None:
    graph = parse_graph(text.replace("meta {", "meta {calibration = {peak = inf, spread = nan}, ", 1))
    calibration = graph.metadata["calibration"]
    assert calibration["peak"] == math.inf and math.isnan(calibration["spread"])


@pytest.mark.parametrize("fast", [True, False])
def test_an_attribute_out_of_range_names_the_file_node_and_attribute(text: str, fast: bool) -> None:
    bad = re.sub(r"\{eps = 1e-05\}", "{eps = 1e309}", text, count=1)
    node = re.search(r"^\s*(%\w+) = layer_norm\(.*eps = 1e309", bad, flags=re.M)
    assert node is not None
    with pytest.raises(IRParseError, match=rf"^g\.ir:\d+:\d+: node {node.group(1)}: op layer_norm: attribute "
                                           r"eps: inf is not a finite number"):
        parse_graph(bad, source="g.ir", fast=fast)


def test_a_graph_folder_is_checked_on_load(tmp_path: Path, text: str) -> None:
    folder = save_graph(load_model("gpt-345m@tiny"), tmp_path / "g")
    ir = folder / "graph.ir"
    ir.write_text(ir.read_text().replace("eps = 1e-05", "eps = 1e309", 1))
    with pytest.raises(IRParseError, match=rf"^{re.escape(str(ir))}:2:\d+: meta config\.layer_norm_eps"):
        load_graph(folder)
