"""Sequence parallelism (`--sp`), pipeline stages (`--pp`) and 1F1B micro-batches
(`--micro-batches`) in the planner: hand-computed terms, the seed claims at ERNIEKit's layouts,
and the bad inputs (docs/planning.md sections 3 and 7). Modelled, not compiled."""

from __future__ import annotations

import pytest
from _cli_kit import cli, user_error
from _plan_kit import plan_args

from ernie_ir.planning import plan_memory
from ernie_ir.planning.plan import _layer_count, _load

TINY = "ernie-4.5-0.3b@tiny"
LORA = {"mode": "training", "lora_rank": 4, "recompute": True}
GiB = 1024 ** 3


def test_sp_divides_the_kept_hidden_states_by_tp() -> None:
    """With recompute a tiny LoRA rank keeps the L layer inputs and the final norm's input
    ([B, S, H] bf16 each) and the final norm's f32 1/rms per row: under SP all of them are token
    shards (/ tp); the loss's vocabulary shard is unchanged."""
    b, s, tp = 2, 16, 2
    whole = plan_memory(TINY, "cuda", *plan_args(tp=tp, seq_len=s, batch=b, **LORA))
    sharded = plan_memory(TINY, "cuda", *plan_args(tp=tp, sp=True, seq_len=s, batch=b, **LORA))
    g = _load(TINY)
    hidden = next(n for n in g if n.op in ("embedding", "vocab_parallel_embedding")).outputs[0].shape[-1]
    layers = _layer_count(g)
    states = (layers + 1) * b * s * hidden * 2 + b * s * 4
    d0, d1 = whole.per_rank[0].activation_detail, sharded.per_rank[0].activation_detail
    assert d0["saved_bytes"] - d1["saved_bytes"] == states - states // tp
    assert sharded.sequence_parallel and "token shards" in sharded.assumptions["sequence_parallel"]
    # weights, gradients: unchanged
    assert sharded.per_rank[0].by_category["weights"] == whole.per_rank[0].by_category["weights"]


def test_stage_params_sum_to_the_whole_model() -> None:
    one = plan_memory(TINY, "cuda", *plan_args(tp=2, seq_len=16, batch=4, **LORA))
    two = plan_memory(TINY, "cuda", *plan_args(tp=2, pp=2, seq_len=16, batch=4, **LORA))
    assert two.devices == 4 and [r.stage for r in two.per_rank] == [0, 0, 1, 1]
    whole, first, last = one.per_rank[0], two.per_rank[0], two.per_rank[2]
    for cat in ("lora", "gradients"):
        assert first.by_category[cat] + last.by_category[cat] == whole.by_category[cat]
    # the tiny model ties lm_head to the embedding: the first stage (embedding) and the last
    # (lm_head) each hold it, [V / tp, H] bf16 per rank
    g = _load(TINY)
    table = g.params["ernie.embed_tokens.weight"].type.shape
    tied = table[0] // 2 * table[1] * 2
    assert first.by_category["weights"] + last.by_category["weights"] == whole.by_category["weights"] + tied


def test_1f1b_in_flight_counts_and_bubble() -> None:
    p = plan_memory(TINY, "cuda", *plan_args(tp=2, pp=2, micro_batches=4, seq_len=16, batch=4, **LORA))
    assert [s.in_flight for s in p.stages] == [2, 1]  # min(pp - s, M)
    assert [r.activation_detail["in_flight_micro_batches"] for r in p.per_rank] == [2, 2, 1, 1]
    assert p.bubble_fraction == pytest.approx(1 / 5)  # (p - 1) / (m + p - 1)
    assert p.assumptions["micro_batch_sequences"] == 1
    one = plan_memory(TINY, "cuda", *plan_args(tp=2, pp=2, micro_batches=1, seq_len=16, batch=4, **LORA))
    assert [s.in_flight for s in one.stages] == [1, 1] and one.bubble_fraction == pytest.approx(1 / 2)
    # stage 0, two micro-batches in flight: its one-micro-batch peak + one more saved set
    d = p.per_rank[0].activation_detail
    assert d["peak_with_recompute_bytes"] >= d["saved_bytes"] * 2
    assert p.stages[0].layers == [0, 0] and p.stages[1].layers == [1, 1] and p.stages[1].head
    # hand check: stage 0 at 4 micro-batches of 1 sequence = its peak for one sequence + one more
    # sequence's saved set (the tiny model's 2 layers force the same partition)
    single = plan_memory(TINY, "cuda", *plan_args(tp=2, pp=2, seq_len=16, batch=1, **LORA)).per_rank[0]
    acts = p.per_rank[0].by_category["activations"]
    assert acts == single.by_category["activations"] + single.activation_detail["saved_bytes"]
    last = plan_memory(TINY, "cuda", *plan_args(tp=2, pp=2, seq_len=16, batch=1, **LORA)).per_rank[2]
    assert p.per_rank[2].by_category["activations"] == last.by_category["activations"]


@pytest.mark.parametrize(("argv", "says"), [
    (("--sp",), "--sp shards the residual stream"),
    (("--tp", "1", "--sp"), "needs --tp 2 or more"),
    (("--batch", "4", "--micro-batches", "3"), "--micro-batches 3 does not divide --batch 4"),
    (("--pp", "3"), "every stage needs at least one"),
    (("--pp", "0"), "a parallel degree is a positive integer"),
])
def test_bad_inputs_one_line(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], says: str) -> None:
    assert says in user_error(capsys, "plan", TINY, "--target", "cuda", "--mode", "training",
                              "--lora-rank", "4", *argv)


def test_sp_pp_apply_to_training_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert "applies to --mode training" in user_error(capsys, "plan", TINY, "--target", "cuda", "--tp", "2",
                                                      "--sp")


def test_cli_prints_the_stages(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "plan", TINY, "--target", "cuda", "--mode", "training", "--lora-rank", "4",
                       "--tp", "2", "--pp", "2", "--sp", "--batch", "4", "--micro-batches", "4", width=200)
    assert code == 0
    assert "pp 2, sp, 4 micro-batches" in out and "stage 0: layers 0-0 + embedding" in out
    assert "bubble 20.0%" in out


def test_devices_search_tries_sp_and_pp() -> None:
    p = plan_memory(TINY, "cuda", *plan_args(devices=4, device_memory=1000, **LORA))
    tried = {(t.tp, t.ep, t.dp, t.pp, t.sp) for t in p.search}
    assert (2, 1, 2, 1, True) in tried and (2, 1, 1, 2, False) in tried and (1, 1, 2, 2, False) in tried
    first = [(t.pp, t.sp) for t in p.search][: 3]
    assert first == [(1, False)] * 3  # the layouts compile builds come first


# -- the seed claims at the seeds' layouts (ERNIE-4.5-300B-A47B @meta, 80 GiB, sm90) ------------------

MODEL = "ernie-4.5-300b-a47b"
LORA300 = {"quant": "wint8mix", "lora_rank": 32, "mode": "training", "recompute": True,
           "offload_optimizer": True, "cuda_arch": 90, "device_memory": "80GiB"}
FP8 = {"quant": "fp8", "mode": "training", "recompute": True, "offload_optimizer": True,
       "moment_dtype": "bf16", "cuda_arch": 90, "device_memory": "80GiB"}


@pytest.mark.slow
def test_wint8mix_lora_32k_on_8_at_tp8_with_sp() -> None:
    p = plan_memory(MODEL, "cuda", *plan_args(tp=8, ep=8, sp=True, seq_len=32768, **LORA300))
    assert p.fits and p.devices == 8
    assert p.max_rank_bytes == pytest.approx(29.95 * GiB, abs=0.01 * GiB)
    # 55 hidden states [32768, 8192] bf16 / 8 + the loss's f32 vocabulary shard
    d = p.per_rank[0].activation_detail
    assert d["saved_bytes"] == pytest.approx(55 * 32768 * 8192 * 2 / 8 + 32768 * 103424 // 8 * 4, rel=2e-2)


@pytest.mark.slow
def test_fp8_full_sft_32k_on_16_at_tp8_pp2_with_sp() -> None:
    """ERNIEKit's run_sft_fp8_32k.yaml: tp 8 x pp 2, sp, recompute, bf16 moments, offload, batch 1 x
    8 accumulation steps (8 micro-batches of one sequence)."""
    p = plan_memory(MODEL, "cuda",
                    *plan_args(tp=8, ep=8, pp=2, sp=True, micro_batches=8, seq_len=32768, batch=8, **FP8))
    assert p.devices == 16 and p.fits
    assert [s.in_flight for s in p.stages] == [2, 1]
    assert p.max_rank_bytes == pytest.approx(61.35 * GiB, abs=0.01 * GiB)
    assert 75 * GiB > max(r.total_bytes for r in p.per_rank)


@pytest.mark.slow
@pytest.mark.parametrize(("options", "seq_len", "total", "stage"), [
    ({**LORA300, "tp": 4, "ep": 4, "sp": True}, 32768, 57.07, 0),  # fits on fewer than claimed
    ({**FP8, "tp": 8, "ep": 8, "pp": 2, "sp": True, "batch": 8, "micro_batches": 8}, 8192, 56.53, 1),
    ({**FP8, "tp": 16, "ep": 16, "sp": True}, 32768, 58.71, 0),  # what --devices 16 picks
])
def test_other_sp_pp_rows(options: dict[str, object], seq_len: int, total: float, stage: int) -> None:
    p = plan_memory(MODEL, "cuda", *plan_args(seq_len=seq_len, **options))  # type: ignore[arg-type]
    worst = max(p.per_rank, key=lambda r: r.total_bytes)
    assert p.fits and worst.stage == stage
    assert p.max_rank_bytes == pytest.approx(total * GiB, abs=0.01 * GiB)
