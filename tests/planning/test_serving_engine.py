"""A cuda inference plan models FastDeploy, the engine that serves it (REFERENCE.md section 13):
only `gpu_memory_utilization` of a device is its to use, activations are those of its profile run
over `max_num_batched_tokens`, and it starts only when the KV blocks left hold one `max_model_len`
sequence plus 2 blocks. `--engine none` plans the bare model as before (docs/planning.md section 4).
"""

from __future__ import annotations

import json

import pytest
from _cli_kit import cli, user_error

from ernie_ir.planning import PlanRequest, plan_memory
from ernie_ir.targets import CompileOptions

MODEL = "ernie-4.5-300b-a47b"
TINY = "ernie-4.5-21b-a3b@tiny"
GiB = 1024 ** 3


@pytest.mark.slow
@pytest.mark.parametrize(("quant", "devices"), [("wint8", 8), ("wint4", 4)])
def test_plan_answers_fastdeploys_device_count_by_default(quant: str, devices: int,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`ernie-ir plan ernie-4.5-300b-a47b --target cuda --quant Q --seq-len 32768 --device-memory
    80GiB`: FastDeploy's published minimum on 80 GB cards (WINT8 8, WINT4 4). The bare model said
    4 for WINT8 (77.35 of 80 GiB), a layout FastDeploy refuses to start."""
    code, out, _ = cli(capsys, "plan", MODEL, "--target", "cuda", "--quant", quant, "--seq-len", "32768",
                       "--device-memory", "80GiB", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["engine"] == "fastdeploy"
    assert data["min_devices"] == devices and (data["tp"], data["ep"]) == (devices, 1)
    half = [t for t in data["search"] if t["devices"] == devices // 2]
    assert half and not any(t["fits"] for t in half)  # no layout of half as many devices starts
    assert all(t["max_rank_bytes"] > 72 * GiB for t in half)  # over 0.9 x 80 GiB, each of them
    rank = data["per_rank"][0]
    kv = rank["kv_detail"]
    assert kv["blocks_per_sequence"] == 512 and kv["blocks_needed"] == 514  # 32768 / 64 + 2
    # 54 layers x K and V x 64 tokens x 8 KV heads / tp x 128 x bf16
    assert kv["block_bytes"] == 54 * 2 * 64 * max(1, 8 // devices) * 128 * 2
    assert kv["sequences"] > data["engine_settings"]["max_num_seqs"]  # room for the default batch


def test_wint8_on_4_does_not_start_for_fastdeploys_reason() -> None:
    """On 4 x 80 GiB the weights, reserve and profile activations leave no room in 72 GiB for one
    32K sequence; the bare model (all 80 GiB, no utilization cap) fitted at tp 4 ep 4."""
    plan = plan_memory(MODEL, "cuda", CompileOptions(quant="wint8", tp=4, ep=4),
                       PlanRequest(seq_len=32768, device_memory="80GiB"))
    r = plan.per_rank[0]
    assert plan.engine_settings is not None and plan.engine_settings.usable_bytes == int(80 * GiB * 0.9)
    assert not plan.fits and r.kv_detail["blocks"] < r.kv_detail["blocks_needed"]
    before_kv = r.by_category["weights"] + r.by_category["activations"] + r.by_category["reserve"]
    assert 72 * GiB - before_kv < r.kv_detail["blocks_needed"] * r.kv_detail["block_bytes"]
    assert r.total_bytes < 80 * GiB  # it would fit the whole device: the 0.9 is what refuses it


@pytest.mark.slow
def test_engine_none_gives_the_bare_model() -> None:
    bare = plan_memory(MODEL, "cuda", CompileOptions(quant="wint8"),
                       PlanRequest(seq_len=32768, device_memory="80GiB", engine="none"))
    assert bare.engine == "none" and bare.engine_settings is None
    assert bare.min_devices == 4 and (bare.tp, bare.ep) == (4, 4)
    assert bare.max_rank_bytes == pytest.approx(77.35 * GiB, abs=0.01 * GiB)
    assert bare.per_rank[0].kv_detail == {}


def test_the_engines_arithmetic_by_hand() -> None:
    """Activations: the bare model's prefill over max_num_batched_tokens with max_num_seqs logits
    rows; KV: (max_model_len / 64 + 2) blocks; budget: device x gpu_memory_utilization."""
    memory = 64 * 2**20
    fd = plan_memory(TINY, "cuda", CompileOptions(tp=2),
                     PlanRequest(seq_len=129, device_memory=memory, max_num_seqs=3,
                                 gpu_memory_utilization=0.5, max_num_batched_tokens=256, reserve="1MiB"))
    bare = plan_memory(TINY, "cuda", CompileOptions(tp=2),
                       PlanRequest(seq_len=256, batch=3, engine="none", reserve="1MiB"))
    assert fd.seq_len == 129 and fd.batch == 1
    for r, b in zip(fd.per_rank, bare.per_rank, strict=True):
        assert r.by_category["weights"] == b.by_category["weights"]
        assert r.by_category["activations"] == b.by_category["activations"]
        block = b.by_category["kv_cache"] // (3 * 256) * 64
        assert r.kv_detail["block_bytes"] == block
        assert r.kv_detail["blocks_needed"] == 3 + 2  # 129 tokens: 3 blocks
        assert r.by_category["kv_cache"] == 5 * block
        usable = memory // 2
        assert r.headroom_bytes == usable - r.total_bytes
        left = usable - (r.total_bytes - r.by_category["kv_cache"])
        assert r.kv_detail["blocks"] == min(left // block, 40000) > 1000
        assert r.kv_detail["sequences"] == r.kv_detail["blocks"] // 3


def test_it_starts_exactly_when_the_blocks_hold_one_sequence_plus_two() -> None:
    one = plan_memory(TINY, "cuda", request=PlanRequest(seq_len=100, gpu_memory_utilization=1.0, reserve=0))
    total = one.max_rank_bytes
    fits = plan_memory(TINY, "cuda", CompileOptions(tp=1),
                       PlanRequest(seq_len=100, gpu_memory_utilization=1.0, reserve=0, device_memory=total))
    short = plan_memory(TINY, "cuda", CompileOptions(tp=1),
                        PlanRequest(seq_len=100, gpu_memory_utilization=1.0, reserve=0,
                                    device_memory=total - 1))
    assert fits.fits and fits.per_rank[0].kv_detail["blocks"] == 4  # 100 tokens: 2 blocks + 2
    assert not short.fits and short.per_rank[0].kv_detail["blocks"] == 3


def test_batch_where_given_is_full_length_sequences_the_blocks_must_hold() -> None:
    plan = plan_memory(TINY, "cuda", request=PlanRequest(seq_len=640, batch=4))
    assert plan.engine_settings is not None and plan.engine_settings.required_sequences == 4
    assert plan.per_rank[0].kv_detail["blocks_needed"] == 4 * 10 + 2


def test_more_blocks_than_fastdeploy_allocates_never_start() -> None:
    plan = plan_memory(TINY, "cuda", CompileOptions(tp=1),
                       PlanRequest(max_model_len=40000 * 64, device_memory="1TiB"))
    assert plan.per_rank[0].kv_detail["blocks_needed"] == 40002 and not plan.fits
    assert any("40000 KV blocks" in n for n in plan.notes)


def test_json_carries_the_engine_and_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "plan", TINY, "--target", "cuda", "--max-model-len", "2048", "--max-num-seqs",
                       "16", "--gpu-memory-utilization", "0.85", "--device-memory", "1GiB", "--tp", "2",
                       "--json")
    assert code == 0
    data = json.loads(out)
    assert data["engine"] == "fastdeploy" and data["seq_len"] == 2048 and data["batch"] == 1
    assert data["engine_settings"] == {
        "name": "fastdeploy", "max_model_len": 2048, "max_num_seqs": 16, "gpu_memory_utilization": 0.85,
        "max_num_batched_tokens": 8192, "block_size": 64, "max_blocks": 40000, "required_sequences": 1,
        "usable_bytes": int(2**30 * 0.85)}
    assert data["assumptions"]["prefill_tokens"] == 8192
    for r in data["per_rank"]:
        assert set(r["kv_detail"]) == {"block_bytes", "blocks_per_sequence", "blocks_needed", "blocks",
                                       "sequences"}
        assert r["kv_detail"]["blocks_needed"] == 2048 // 64 + 2
        assert r["headroom_bytes"] == int(2**30 * 0.85) - r["total_bytes"]
    code, out, _ = cli(capsys, "plan", TINY, "--target", "cuda", "--max-model-len", "2048", "--tp", "2")
    assert code == 0
    assert "engine: fastdeploy, --max-model-len 2048 --max-num-seqs 8 --gpu-memory-utilization 0.9" in out
    assert "72.00 GiB of 80.00 GiB (gpu_memory_utilization 0.9)" in out
    assert "blocks of 64 tokens" in out and "the engine needs 34" in out


@pytest.mark.parametrize("argv", [["--target", "kunlun"], ["--target", "ascend"],
                                  ["--target", "cuda", "--mode", "training", "--lora-rank", "2"]])
def test_the_engine_is_none_off_cuda_inference(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "plan", TINY, *argv, "--json")
    data = json.loads(out)
    assert code == 0 and data["engine"] == "none" and data["engine_settings"] is None


@pytest.mark.parametrize(("argv", "says"), [
    (["--target", "kunlun", "--engine", "fastdeploy"], "--engine fastdeploy models FastDeploy serving on "
     "cuda, not --target kunlun: drop --engine"),
    (["--target", "ascend", "--engine", "fastdeploy"], "not --target ascend"),
    (["--target", "cuda", "--mode", "training", "--lora-rank", "2", "--engine", "fastdeploy"],
     "not --mode training"),
    (["--target", "cuda", "--engine", "vllm"], "--engine 'vllm': choose fastdeploy"),
    (["--target", "cuda", "--engine", "none", "--max-num-seqs", "4"], "--max-num-seqs is FastDeploy's flag"),
    (["--target", "kunlun", "--max-model-len", "4096"], "does not apply with --target kunlun"),
    (["--target", "cuda", "--mode", "training", "--gpu-memory-utilization", "0.9"], "--mode training"),
    (["--target", "cuda", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0.0: the fraction"),
    (["--target", "cuda", "--gpu-memory-utilization", "1.5"], "in (0, 1]"),
    (["--target", "cuda", "--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
    (["--target", "cuda", "--max-num-seqs", "0"], "--max-num-seqs 0"),
    (["--target", "cuda", "--max-model-len", "0"], "--max-model-len 0"),
    (["--target", "cuda", "--max-num-batched-tokens", "-1"], "--max-num-batched-tokens -1"),
    (["--target", "cuda", "--seq-len", "4096", "--max-model-len", "8192"], "disagree"),
])
def test_engine_flags_misused_are_one_line(argv: list[str], says: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert says in user_error(capsys, "plan", TINY, *argv)


@pytest.mark.slow
@pytest.mark.parametrize(("quant", "memory", "devices"), [
    ("wint8", "24GiB", 2), ("wint4", "24GiB", 1),  # A10 24GB (and the A30, which has 24 GB)
    ("wint8", "48GiB", 1), ("wint4", "48GiB", 1),  # L20 48GB
])
def test_fastdeploys_21b_table(quant: str, memory: str, devices: int) -> None:
    """FastDeploy's ERNIE-4.5-21B-A3B minimum GPUs, launched with --max-model-len 32768
    --max-num-seqs 128 (docs/planning.md section 7 has every cell)."""
    plan = plan_memory("ernie-4.5-21b-a3b", "cuda", CompileOptions(quant=quant),
                       PlanRequest(seq_len=32768, max_num_seqs=128, device_memory=memory))
    assert plan.min_devices == devices
