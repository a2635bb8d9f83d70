"""`ernie-ir plan`: the JSON contract, the table, the SVG, other inputs, and bad input (one line, exit 2)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from _cli_kit import cli, user_error

from ernie_ir.frontends.builtins import PUBLISHED
from ernie_ir.planning import CATEGORIES, MemorySizeError, PlanRequest, parse_memory, plan_memory
from ernie_ir.targets import CompileOptions, compile_model

TINY = "ernie-4.5-21b-a3b@tiny"


def test_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "plan", TINY, "--target", "cuda", "--tp", "2", "--ep", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["format"] == "ernie-ir-memory-plan" and data["version"] == 1
    for key in ("fits", "devices", "tp", "ep", "min_devices", "per_rank", "headroom_bytes",
                "device_memory_bytes", "pipeline", "assumptions", "search", "notes"):
        assert key in data
    assert isinstance(data["fits"], bool) and data["devices"] == 2 and (data["tp"], data["ep"]) == (2, 2)
    assert data["min_devices"] is None and data["searched"] is False  # tp/ep given: no search
    assert len(data["per_rank"]) == 2
    for r in data["per_rank"]:
        assert list(r["by_category"]) == list(CATEGORIES)
        assert r["total_bytes"] == sum(r["by_category"].values())
    assert data["device_memory_bytes"] == 80 * 2**30 and data["device_memory_given"] is False


def test_search_finds_the_smallest_layout_and_reports_null_when_none_fits(
        capsys: pytest.CaptureFixture[str]) -> None:
    # no reserve, a budget one byte short of the one-device plan: two devices are the answer
    one = plan_memory(TINY, "cuda", request=PlanRequest(reserve=0, seq_len=16))
    budget = one.max_rank_bytes - 1
    plan = plan_memory(TINY, "cuda", request=PlanRequest(reserve=0, seq_len=16, device_memory=budget))
    assert plan.searched and plan.min_devices == 2 and plan.fits and (plan.tp, plan.ep) == (2, 1)
    assert [(t.devices, t.tp, t.ep) for t in plan.search[:2]] == [(1, 1, 1), (2, 2, 1)]
    code, out, _ = cli(capsys, "plan", TINY, "--target", "cuda", "--device-memory", "1MiB", "--json")
    data = json.loads(out)
    assert code == 0 and data["searched"] and data["min_devices"] is None and data["fits"] is False
    assert any(t["error"] for t in data["search"])  # indivisible layouts are listed, not fatal


def test_training_search_prefers_experts_over_the_tp_group() -> None:
    from ernie_ir.load import load_input
    from ernie_ir.planning import candidate_layouts

    moe = load_input(TINY)
    assert candidate_layouts(moe, "inference", 4) == [(1, 1, 1), (2, 2, 1), (2, 2, 2), (2, 1, 2),
                                                     (4, 4, 1), (4, 4, 4), (4, 4, 2), (4, 1, 4)]
    assert candidate_layouts(moe, "training", 2)[1:3] == [(2, 2, 2), (2, 2, 1)]
    dense = load_input("ernie-4.5-0.3b@tiny")
    assert candidate_layouts(dense, "training", 8) == [(1, 1, 1), (2, 2, 1), (4, 4, 1), (8, 8, 1)]


def test_table_and_svg(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    svg = tmp_path / "plan.svg"
    code, out, _ = cli(capsys, "plan", TINY, "--target", "kunlun", "--quant", "wint8mix", "--mode",
                       "training", "--lora-rank", "4", "--ep", "2", "--offload-optimizer",
                       "--recompute", "--plot", str(svg))
    assert code == 0
    for word in ("device memory per rank", "ranks 0-1", "lora", "gradients", "activations", "headroom",
                 "host (offloaded)", "trainable: graph"):
        assert word in out, word
    root = ET.fromstring(svg.read_text(encoding="utf-8"))
    bars = [e for e in root.iter("{http://www.w3.org/2000/svg}rect") if e.find(
        "{http://www.w3.org/2000/svg}title") is not None]
    titles = {b.find("{http://www.w3.org/2000/svg}title").text.split(":")[0] for b in bars}  # type: ignore[union-attr]
    assert {"rank 0 weights", "rank 1 weights", "rank 0 activations", "rank 1 lora"} <= titles
    assert "rank 0 optimizer_moments" not in titles  # offloaded: host memory, not on the bar


def test_checkpoint_folder_is_read_from_its_config_alone(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PUBLISHED["ernie-4.5-0.3b"]), encoding="utf-8")
    plan = plan_memory(str(folder), "cuda", CompileOptions(quant="wint8"), PlanRequest(seq_len=1024))
    same = plan_memory("ernie-4.5-0.3b", "cuda", CompileOptions(quant="wint8"), PlanRequest(seq_len=1024))
    assert plan.per_rank[0].by_category == same.per_rank[0].by_category
    assert plan.per_rank[0].by_category["weights"] > 300 * 2**20  # full size, not a tiny model


def test_an_artifact_is_planned_from_its_rank_graphs(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    out = tmp_path / "a"
    compile_model(TINY, "cuda", CompileOptions(quant="wint8mix", tp=2, cuda_arch=70, out=out))
    from_artifact = plan_memory(str(out), "cuda")
    from_model = plan_memory(TINY, "cuda", CompileOptions(quant="wint8mix", tp=2, cuda_arch=70))
    assert [r.by_category for r in from_artifact.per_rank] == [r.by_category for r in from_model.per_rank]
    assert user_error(capsys, "plan", str(out), "--target", "cuda", "--tp", "2").endswith(
        "drop --quant/--lora-rank/--tp/--ep (or plan its source model)")
    assert "compiled for --target cuda" in user_error(capsys, "plan", str(out), "--target", "kunlun")


@pytest.mark.parametrize("text", ["80GiB", "80G", "80GB", "80 gib", "80gb", "85899345920B"])
def test_memory_strings_are_binary(text: str) -> None:
    assert parse_memory(text) == 80 * 2**30


def test_memory_string_forms() -> None:
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5T") == 3 * 2**39
    assert parse_memory("8e10B") == 80_000_000_000
    for bad in ("80XB", "", "GB", "-1G", "80GiBB", "eighty", "80", "8e10"):
        with pytest.raises(MemorySizeError):
            parse_memory(bad)


@pytest.mark.parametrize(("argv", "says"), [
    (["--device-memory", "80XB"], "not a memory size"),
    (["--device-memory", "0B"], "at least one byte"),
    (["--reserve", "2XB"], "--reserve"),
    (["--tp", "3"], "--tp 3"),
    (["--ep", "3"], "--ep 3"),
    (["--tp", "2", "--ep", "4"], "unsupported layout"),
    (["--offload-optimizer"], "--mode training"),
    (["--recompute"], "--mode training"),
    (["--mode", "training", "--quant", "wint8"], "cannot update weight-only"),
    (["--mode", "finetune"], "--mode"),
    (["--mode", "training", "--lora-rank", "2", "--moment-dtype", "fp64"], "--moment-dtype"),
    (["--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
    (["--seq-len", "0"], "positive"),
    (["--batch", "-1"], "positive"),
    (["--lora-rank", "0"], "--lora-rank"),
    (["--quant", "wint3"], "unknown quantization"),
    (["--quant", "fp8"], "FP8"),
    (["--plot", "plan.png"], "--plot"),
])
def test_bad_input_is_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert says in user_error(capsys, "plan", TINY, "--target", "cuda", *argv)


def test_bad_model_and_target_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "unknown target" in user_error(capsys, "plan", TINY, "--target", "tpu")
    assert "neither a model folder" in user_error(capsys, "plan", "nosuch-model", "--target", "cuda")
    assert "--ep 2" in user_error(capsys, "plan", "ernie-4.5-0.3b@tiny", "--target", "cuda", "--ep", "2")
    assert "FP8" in user_error(capsys, "plan", TINY, "--target", "ascend", "--quant", "fp8")
    assert "--cuda-arch" in user_error(capsys, "plan", TINY, "--target", "kunlun", "--cuda-arch", "90")
