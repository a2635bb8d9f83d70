"""What `ernie-ir compile` prints about fallbacks (issue 24 item 5): one line per distinct reason
with the count and the first scopes, every scope under --verbose; the manifest and the --json
report still list every fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli_kit import cli

from ernie_ir.cli.compile_view import fallback_lines
from ernie_ir.targets.compile import FallbackGroup, group_fallbacks

MODEL = "ernie-4.5-0.3b@tiny"  # 2 layers x 4 linears; kunlun has no int4 dense kernel: 8 fallbacks
ARGS = ("--target", "kunlun", "--quant", "wint4")
REASON = "kunlun has no int4 dense weight-only kernel (weight_only_linear_xpu takes int8)"
SCOPES = [f"ernie.layers.{i}.{s}" for i in range(2)
          for s in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_gate_proj", "mlp.down_proj")]


def _fallback_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("fallback: ")]


def test_compile_prints_one_line_per_fallback_reason_with_a_count_and_the_first_scopes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "compile", MODEL, *ARGS, "--out", str(tmp_path / "a"))
    assert code == 0
    assert _fallback_lines(out) == [
        f"fallback: 8 linear nodes -> dequantize(int4) + linear (portable): {REASON}; at "
        f"{SCOPES[0]}, {SCOPES[1]}, {SCOPES[2]} and 5 more (--verbose lists them)"]
    assert not any(s in out for s in SCOPES[3:])
    # the manifest records every fallback, as before
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text(encoding="utf-8"))
    recorded = manifest["kernel_plan"]["fallbacks"]
    assert [f["scope"] for f in recorded] == SCOPES
    assert all(f == {"scope": f["scope"], "op": "linear", "kernel": "dequantize(int4) + linear (portable)",
                     "reason": REASON} for f in recorded)


def test_compile_verbose_prints_every_fallback_scope(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "compile", MODEL, *ARGS, "--out", str(tmp_path / "a"), "--verbose")
    assert code == 0
    lines = out.splitlines()
    head = f"fallback: 8 linear nodes -> dequantize(int4) + linear (portable): {REASON}; at:"
    assert _fallback_lines(out) == [head]
    start = lines.index(head) + 1
    assert lines[start:start + len(SCOPES)] == [f"  {s}" for s in SCOPES]
    assert "more" not in out


def test_compile_json_still_reports_every_fallback(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "compile", MODEL, *ARGS, "--out", str(tmp_path / "a"), "--json")
    assert code == 0
    assert [f["scope"] for f in json.loads(out)["fallbacks"]] == SCOPES


def test_fallback_groups_keep_plan_order_and_count_repeated_scopes() -> None:
    fallbacks = [
        {"scope": "l1.experts", "op": "dequantize", "kernel": "k", "reason": "unconfirmed"},
        {"scope": "l0.qkv", "op": "linear", "kernel": "k8", "reason": "no layout"},
        {"scope": "l1.experts", "op": "dequantize", "kernel": "k", "reason": "unconfirmed"},
        {"scope": "l2.experts", "op": "dequantize", "kernel": "k", "reason": "unconfirmed"},
        {"scope": "l1.qkv", "op": "linear", "kernel": "k8", "reason": "other"},
    ]
    groups = group_fallbacks(fallbacks)
    assert groups == [
        FallbackGroup("dequantize", "k", "unconfirmed", ("l1.experts", "l1.experts", "l2.experts")),
        FallbackGroup("linear", "k8", "no layout", ("l0.qkv",)),
        FallbackGroup("linear", "k8", "other", ("l1.qkv",))]
    assert fallback_lines(groups) == [
        "fallback: 3 dequantize nodes -> k: unconfirmed; at l1.experts (x2), l2.experts",
        "fallback: 1 linear node -> k8: no layout; at l0.qkv",
        "fallback: 1 linear node -> k8: other; at l1.qkv"]
    assert fallback_lines(groups[:1], verbose=True) == [
        "fallback: 3 dequantize nodes -> k: unconfirmed; at:", "  l1.experts (x2)", "  l2.experts"]
    assert fallback_lines(groups[:1], head=1) == [
        "fallback: 3 dequantize nodes -> k: unconfirmed; at l1.experts (x2) and 1 more "
        "(--verbose lists them)"]


def test_weights_of_several_shapes_refused_for_one_cause_are_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """cuda sm80 names each refused weight's shape in its reason; the 13 fallbacks of the tiny
    MoE (4 shapes of linear, 2 of expert) are 3 causes: in_features 80 for linears, and 80 or
    32 for experts. A group's line names its distinct shapes."""
    code, out, _ = cli(capsys, "compile", "ernie-4.5-21b-a3b@tiny", "--target", "cuda", "--quant", "wint8mix",
                       "--out", str(tmp_path / "a"))
    assert code == 0
    lines = _fallback_lines(out)
    assert len(lines) == 3
    assert lines[0].startswith("fallback: 9 linear nodes -> dequantize(int8) + linear (portable): "
                               "no sm80 layout for [80, 112], [80, 80], [80, 384], [80, 128]: in_features 80 "
                               "is not a multiple of 64")
    # the shapes refused, not a literal "[...]"; no advice to take the fallback that was taken
    assert "[...]" not in out and "portable fallback" not in out and "--cuda-arch 70 packs it" in lines[0]
    assert lines[0].endswith("and 6 more (--verbose lists them)")
    assert [line.split(" -> ")[0] for line in lines[1:]] == ["fallback: 2 dequantize nodes"] * 2
    recorded = json.loads((tmp_path / "a" / "manifest.json").read_text())["kernel_plan"]["fallbacks"]
    assert len(recorded) == 13 and "no sm80 layout for [80, 112]" in recorded[0]["reason"]
