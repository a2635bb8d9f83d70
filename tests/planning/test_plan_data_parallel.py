"""Data parallelism and ZeRO sharding in the memory plan (`plan --dp/--sharding/--devices`).

Every expected figure is computed from a plan of the same model without dp (the planner's own
figures), never typed in: stage 1 divides the AdamW moments and f32 master weights by dp, stage 2
the gradients too, and nothing else on a rank changes with dp (docs/planning.md section 5).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _cli_kit import cli, user_error
from _plan_kit import plan_args

from ernie_ir.load import load_input
from ernie_ir.planning import device_layouts, plan_memory
from ernie_ir.targets import CompileOptions, compile_model

DENSE = "ernie-4.5-0.3b@tiny"
MOE = "ernie-4.5-21b-a3b@tiny"
TRAIN = {"mode": "training", "reserve": 0, "seq_len": 16}
OPTIMIZER = ("optimizer_moments", "master_weights")
UNCHANGED = ("weights", "lora", "activations", "kv_cache", "reserve")


def ceil_half(n: int) -> int:
    return -(-n // 2)


@pytest.mark.parametrize("model", [DENSE, MOE])
def test_stage1_halves_optimizer_states_per_rank_at_dp2(model: str) -> None:
    one = plan_memory(model, "cuda", *plan_args(tp=2, **TRAIN))
    two = plan_memory(model, "cuda", *plan_args(tp=2, dp=2, sharding="stage1", **TRAIN))
    assert (two.dp, two.sharding, two.devices) == (2, "stage1", 2 * one.devices)
    assert len(two.per_rank) == len(one.per_rank)  # one replica's ranks
    for a, b in zip(one.per_rank, two.per_rank, strict=True):
        assert a.by_category["optimizer_moments"] > 0 and a.by_category["master_weights"] > 0
        for cat in OPTIMIZER:
            assert b.by_category[cat] == ceil_half(a.by_category[cat])
            assert b.unsharded_bytes[cat] == a.by_category[cat]
        assert b.by_category["gradients"] == a.by_category["gradients"]  # stage 1 keeps them whole
        for cat in UNCHANGED:
            assert b.by_category[cat] == a.by_category[cat]
        assert b.activation_detail == a.activation_detail
        assert b.sharding_saved_bytes == sum(a.by_category[c] - b.by_category[c] for c in OPTIMIZER)
        assert b.total_bytes == a.total_bytes - b.sharding_saved_bytes


def test_stage2_halves_gradients_too() -> None:
    one = plan_memory(MOE, "cuda", *plan_args(tp=2, ep=2, **TRAIN))
    two = plan_memory(MOE, "cuda", *plan_args(tp=2, ep=2, dp=2, sharding="stage2", **TRAIN))
    for a, b in zip(one.per_rank, two.per_rank, strict=True):
        for cat in ("gradients", *OPTIMIZER):
            assert b.by_category[cat] == ceil_half(a.by_category[cat])
            assert b.unsharded_bytes[cat] == a.by_category[cat]
        for cat in UNCHANGED:
            assert b.by_category[cat] == a.by_category[cat]


def test_dp_alone_changes_no_rank_and_multiplies_the_host_total() -> None:
    one = plan_memory(DENSE, "cuda", *plan_args(tp=2, offload_optimizer=True, **TRAIN))
    four = plan_memory(DENSE, "cuda", *plan_args(tp=2, dp=4, offload_optimizer=True, **TRAIN))
    assert four.devices == 8 and four.sharding == "none"
    assert [r.by_category for r in four.per_rank] == [r.by_category for r in one.per_rank]
    assert [r.host_by_category for r in four.per_rank] == [r.host_by_category for r in one.per_rank]
    assert all(r.sharding_saved_bytes == 0 for r in four.per_rank)
    assert four.host_total_bytes == 4 * one.host_total_bytes  # every replica offloads its own
    assert four.assumptions["global_tokens_per_step"] == 4 * four.assumptions["tokens_per_step"] == 4 * 16
    # sharded and offloaded: each rank's host share is divided, the total over all replicas is the
    # unsharded one of a single replica (up to rounding)
    sharded = plan_memory(DENSE, "cuda",
                          *plan_args(tp=2, dp=4, sharding="stage1", offload_optimizer=True, **TRAIN))
    for a, b in zip(one.per_rank, sharded.per_rank, strict=True):
        assert b.by_category == a.by_category  # moments and masters were on the host anyway
        for cat in OPTIMIZER:
            assert b.host_by_category[cat] == -(-a.host_by_category[cat] // 4)
    assert 0 <= sharded.host_total_bytes - one.host_total_bytes < 2 * 4 * len(one.per_rank)


def test_device_layouts_smallest_model_parallel_group_first() -> None:
    dense = load_input(DENSE)
    assert device_layouts(dense, "training", 8) == [(8, 1, 1, 8), (8, 2, 1, 4), (8, 4, 1, 2), (8, 8, 1, 1)]
    assert device_layouts(dense, "training", 8, dp=2) == [(8, 4, 1, 2)]
    assert device_layouts(dense, "training", 6, max_devices=2) == [(6, 1, 1, 6), (6, 2, 1, 3)]
    moe = load_input(MOE)
    assert device_layouts(moe, "training", 4) == [(4, 1, 1, 4), (4, 2, 2, 2), (4, 2, 1, 2), (4, 1, 2, 2),
                                                  (4, 4, 4, 1), (4, 4, 1, 1), (4, 4, 2, 1), (4, 1, 4, 1)]
    assert device_layouts(moe, "training", 4, tp=2) == [(4, 2, 2, 2), (4, 2, 1, 2)]


def test_search_over_a_device_count_picks_a_data_parallel_layout() -> None:
    # full plans at tp 1 / 2 / 4 of the dense tiny model: a budget only tp 4 meets unsharded
    sizes = {t: plan_memory(DENSE, "cuda", *plan_args(tp=t, **TRAIN)).max_rank_bytes for t in (1, 2, 4)}
    budget = sizes[4] + 1
    assert sizes[2] > budget
    plan = plan_memory(DENSE, "cuda", *plan_args(devices=8, device_memory=budget, **TRAIN))
    assert plan.fits and (plan.tp, plan.ep, plan.dp, plan.devices) == (4, 1, 2, 8)
    assert plan.searched and plan.search_devices == 8 and plan.min_devices is None
    assert [(s.tp, s.dp, s.fits) for s in plan.search] == [(1, 8, False), (2, 4, False), (4, 2, True)]
    # stage 1 over the larger dp makes the smaller tensor-parallel group fit
    sharded = plan_memory(DENSE, "cuda",
                          *plan_args(sharding="stage1", devices=8, device_memory=budget, **TRAIN))
    assert sharded.fits and (sharded.tp, sharded.dp) == (2, 4)
    # nothing fits: the plan is the layout nearest to fitting, said in a note
    none = plan_memory(DENSE, "cuda", *plan_args(devices=8, device_memory=1000, **TRAIN))
    assert not none.fits and none.tp == 8 and none.max_rank_bytes == min(
        s.max_rank_bytes for s in none.search if s.max_rank_bytes is not None)
    assert any("nothing fits on 8 devices" in n for n in none.notes)


def test_dp_with_the_min_devices_search_counts_replicas() -> None:
    sizes = {t: plan_memory(DENSE, "cuda", *plan_args(tp=t, **TRAIN)).max_rank_bytes for t in (1, 2)}
    plan = plan_memory(DENSE, "cuda", *plan_args(dp=2, device_memory=sizes[2], **TRAIN))
    assert plan.min_devices == 4 and (plan.tp, plan.dp, plan.devices) == (2, 2, 4)
    assert [(s.devices, s.tp, s.dp) for s in plan.search] == [(2, 1, 2), (4, 2, 2)]


def test_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "plan", MOE, "--target", "cuda", "--mode", "training", "--tp", "2", "--ep",
                       "2", "--dp", "2", "--sharding", "stage2", "--offload-optimizer", "--json")
    assert code == 0
    data = json.loads(out)
    assert (data["tp"], data["ep"], data["dp"], data["sharding"], data["devices"]) == (2, 2, 2, "stage2", 4)
    assert data["search_devices"] is None and data["searched"] is False
    for r in data["per_rank"]:
        assert set(r["unsharded_bytes"]) == {"gradients", *OPTIMIZER}
        assert r["by_category"]["gradients"] == ceil_half(r["unsharded_bytes"]["gradients"])
        for cat in OPTIMIZER:  # offloaded: the divided share is on the host
            assert r["host_by_category"][cat] == ceil_half(r["unsharded_bytes"][cat])
        assert r["sharding_saved_bytes"] > 0
    assert data["assumptions"]["sharding"].startswith("stage2")
    assert data["assumptions"]["data_parallel"].startswith("dp 2")
    assert data["assumptions"]["global_tokens_per_step"] == 2 * data["assumptions"]["tokens_per_step"]
    code, out, _ = cli(capsys, "plan", DENSE, "--target", "cuda", "--mode", "training", "--devices", "4",
                       "--json")
    data = json.loads(out)
    assert code == 0 and data["search_devices"] == 4 and data["searched"]
    assert all("dp" in s for s in data["search"]) and data["devices"] == 4
    code, out, _ = cli(capsys, "plan", DENSE, "--target", "cuda", "--json")  # inference: dp 1, no sharding
    data = json.loads(out)
    assert (data["dp"], data["sharding"]) == (1, "none") and data["per_rank"][0]["unsharded_bytes"] == {}


def test_table_shows_dp_sharding_and_the_saving(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "plan", DENSE, "--target", "cuda", "--mode", "training", "--tp", "2", "--dp",
                       "2", "--sharding", "stage1", width=200)
    assert code == 0
    for text in ("dp 2, sharding stage1", "optimizer_moments (/2 stage1)", "master_weights (/2 stage1)",
                 "total without sharding", "sharding stage1 over dp 2, largest rank: optimizer_moments",
                 "gradients", "not divided (stage2 divides them)"):
        assert text in out, text
    code, out, _ = cli(capsys, "plan", DENSE, "--target", "cuda", "--mode", "training", "--devices", "4",
                       "--sharding", "stage2", "--offload-optimizer", width=200)
    assert code == 0
    for text in ("layout search over 4 devices", "host without sharding", "gradients (/4 stage2)", "dp"):
        assert text in out, text


@pytest.mark.parametrize(("argv", "says"), [
    (["--devices", "8", "--dp", "3"], "--dp 3 does not divide --devices 8"),
    (["--devices", "8", "--tp", "3"], "--tp 3 does not divide --devices 8"),
    (["--devices", "8", "--tp", "2", "--dp", "2"], "= 4 devices, not --devices 8"),
    (["--sharding", "stage1"], "give --dp 2 or more"),
    (["--sharding", "stage1", "--dp", "1"], "give --dp 2 or more"),
    (["--sharding", "stage3", "--dp", "2"], "stage3"),
    (["--sharding", "zero9", "--dp", "2"], "choose none, stage1"),
    (["--dp", "0"], "--dp 0"),
    (["--devices", "0"], "--devices 0"),
])
def test_bad_training_input_is_one_line(argv: list[str], says: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert says in user_error(capsys, "plan", DENSE, "--target", "cuda", "--mode", "training", *argv)


@pytest.mark.parametrize("argv", [["--dp", "2"], ["--devices", "8"], ["--sharding", "stage1"]])
def test_data_parallel_flags_are_training_only(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert "applies to --mode training" in user_error(capsys, "plan", DENSE, "--target", "cuda", *argv)


GiB = 1024 ** 3
FP8 = {"quant": "fp8", "mode": "training", "recompute": True, "moment_dtype": "bf16", "cuda_arch": 90}
LORA = {"quant": "wint8mix", "lora_rank": 32, "mode": "training", "recompute": True, "cuda_arch": 90}
BF16 = {"mode": "training", "recompute": True, "cuda_arch": 90}
OFF = {"offload_optimizer": True}
ROWS = [  # docs/planning.md section 7, "ERNIEKit's stage-1 sharding at 300B": the fixed layouts
    ({**FP8, **OFF, "tp": 16, "ep": 16}, 8192, 62.28, True),
    ({**FP8, **OFF, "tp": 8, "ep": 8, "dp": 2, "sharding": "stage1"}, 8192, 114.65, False),
    ({**FP8, **OFF, "tp": 8, "ep": 8, "dp": 2, "sharding": "stage2"}, 8192, 79.84, True),
    ({**FP8, **OFF, "tp": 8, "ep": 8, "dp": 2, "sharding": "stage1"}, 32768, 138.83, False),
    ({**FP8, **OFF, "tp": 16, "ep": 16, "dp": 2, "sharding": "stage1"}, 8192, 62.28, True),
    ({**FP8, "tp": 16, "ep": 16}, 8192, 201.86, False),
    ({**FP8, "tp": 16, "ep": 16, "dp": 2, "sharding": "stage1"}, 8192, 132.07, False),
    ({**FP8, "tp": 16, "ep": 16, "dp": 4, "sharding": "stage1"}, 8192, 97.18, False),
    ({**FP8, "tp": 16, "ep": 16, "dp": 4, "sharding": "stage2"}, 8192, 70.95, True),
    ({**LORA, **OFF, "tp": 4, "ep": 4}, 8192, 52.58, True),
    ({**LORA, "tp": 4, "ep": 4, "dp": 2, "sharding": "stage1"}, 8192, 55.37, True),
    ({**BF16, "tp": 16, "ep": 16}, 8192, 289.09, False),
    ({**BF16, "tp": 16, "ep": 16, "dp": 6, "sharding": "stage1"}, 8192, 114.57, False),
    ({**BF16, "tp": 16, "ep": 16, "dp": 6, "sharding": "stage2"}, 8192, 85.43, False),
    ({**BF16, "tp": 16, "ep": 16, "dp": 8, "sharding": "stage2"}, 8192, 75.25, True),
]


@pytest.mark.slow
@pytest.mark.parametrize(("options", "seq_len", "total", "fits"), ROWS)
def test_300b_sharding_rows_of_the_docs(options: dict[str, Any], seq_len: int, total: float,
                                        fits: bool) -> None:
    plan = plan_memory("ernie-4.5-300b-a47b", "cuda",
                       *plan_args(seq_len=seq_len, device_memory="80GiB", **options))
    assert round(plan.max_rank_bytes / GiB, 2) == total and plan.fits is fits
    r = plan.per_rank[0]
    dp = plan.dp
    divided = {"none": (), "stage1": OPTIMIZER, "stage2": ("gradients", *OPTIMIZER)}[plan.sharding]
    for cat in ("gradients", *OPTIMIZER):  # the division, from the plan's own unsharded figures
        held = r.by_category[cat] + r.host_by_category.get(cat, 0)
        assert held == (-(-r.unsharded_bytes[cat] // dp) if cat in divided else r.unsharded_bytes[cat])


@pytest.mark.slow
def test_300b_what_sharding_saves() -> None:
    """The optimizer states dominate full fine-tuning: FP8 as ERNIEKit runs it (bf16 moments, f32
    masters) keeps 139.6 GiB of states on a 204.5 GiB tp-16 rank; offloaded, stage 1 halves each
    rank's host share at dp 2 and keeps the host total of 16 unsharded ranks."""
    options = {**FP8, "seq_len": 8192, "tp": 16, "ep": 16}
    one = plan_memory("ernie-4.5-300b-a47b", "cuda", *plan_args(**options)).per_rank[0]
    states = sum(one.by_category[c] for c in OPTIMIZER)
    assert 139 * GiB < states < 140 * GiB and states > 0.68 * one.total_bytes
    plain = plan_memory("ernie-4.5-300b-a47b", "cuda", *plan_args(dp=2, **OFF, **options))
    sharded = plan_memory("ernie-4.5-300b-a47b", "cuda",
                          *plan_args(dp=2, sharding="stage1", **OFF, **options))
    assert sharded.per_rank[0].host_bytes == pytest.approx(states / 2, abs=8)
    assert sharded.host_total_bytes == pytest.approx(plain.host_total_bytes / 2, abs=64)
    assert 2.1 * 1024 * GiB < sharded.host_total_bytes < 2.2 * 1024 * GiB  # ERNIEKit's "2TB CPU RAM"


def test_an_artifact_is_planned_with_its_recorded_dp(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    lora = {"mode": "training", "lora_rank": 2}
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    compile_model(DENSE, "cuda", CompileOptions(tp=2, out=one, **lora))
    compile_model(DENSE, "cuda", CompileOptions(tp=2, dp=2, sharding="stage2", out=two, **lora))
    source = plan_memory(DENSE, "cuda", CompileOptions(tp=2, dp=2, sharding="stage2", **lora))
    recorded = plan_memory(str(two), "cuda", CompileOptions(mode="training"))
    given = plan_memory(str(one), "cuda", CompileOptions(mode="training", dp=2, sharding="stage2"))
    for plan in (recorded, given):
        assert (plan.dp, plan.sharding, plan.devices) == (2, "stage2", 4)
        assert [r.by_category for r in plan.per_rank] == [r.by_category for r in source.per_rank]
    assert "laid out for dp 2" in user_error(capsys, "plan", str(two), "--target", "cuda", "--mode",
                                             "training", "--dp", "4")
    assert "--devices 5" in user_error(capsys, "plan", str(one), "--target", "cuda", "--mode", "training",
                                       "--devices", "5")
