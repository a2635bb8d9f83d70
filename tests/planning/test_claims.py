"""The seed documents' memory claims for ERNIE-4.5-300B-A47B (REFERENCE.md section 7), planned.

Each test plans the full-size model (`@meta`: no weights) as compile would build it. Where the
plan disagrees with a claim, the test asserts the documented reason with its numbers
(docs/planning.md section 6) rather than the claim.
"""

from __future__ import annotations

import pytest
from _plan_kit import plan_args

from ernie_ir.planning import MemoryPlan, plan_memory

MODEL = "ernie-4.5-300b-a47b"
GiB = 1024 ** 3
G80 = "80GiB"
SERVE = {"seq_len": 32768, "batch": 8, "cuda_arch": 90}
"""FastDeploy's --max-model-len 32768; 8 sequences of full length in the KV cache at once."""
LORA = {"quant": "wint8mix", "lora_rank": 32, "mode": "training", "recompute": True,
        "offload_optimizer": True, "cuda_arch": 90}
"""ERNIEKit's run_sft_wint8mix_lora_{8k,32k}.yaml: compute_type wint4/8, lora_rank 32, recompute,
optimizer offload, batch 1 (300B has no shared experts, so ERNIEKit's wint4/8 is our wint8mix)."""
FP8 = {"quant": "fp8", "mode": "training", "recompute": True, "offload_optimizer": True,
       "moment_dtype": "bf16", "cuda_arch": 90}
"""ERNIEKit's run_sft_fp8_{8k,32k}.yaml: full-parameter, FP8 params, BF16 grads and (low-precision)
moments, optimizer states offloaded, recompute."""


def by_devices(plan: MemoryPlan) -> dict[int, list[bool | None]]:
    out: dict[int, list[bool | None]] = {}
    for t in plan.search:
        out.setdefault(t.devices, []).append(t.fits)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("quant", "devices"), [("wint4", 4), ("wint8", 8)])
def test_serving_needs_the_claimed_device_count(quant: str, devices: int) -> None:
    """FastDeploy: wint4 on 4 x 80G (not 2), wint8 on 8 x 80G (not 4), --max-model-len 32768."""
    plan = plan_memory(MODEL, "cuda", *plan_args(quant=quant, device_memory=G80, **SERVE))
    assert plan.min_devices == devices
    assert (plan.tp, plan.ep) == (devices, 1)  # FastDeploy's default layout: TP, experts cut
    tried = by_devices(plan)
    assert tried[devices // 2] and not any(tried[devices // 2])  # no half-size layout fits
    assert plan.fits and plan.headroom_bytes > 10 * GiB


@pytest.mark.slow
def test_fastdeploy_wint4_on_moe_is_wint8mix_and_fits_on_4_not_2() -> None:
    """FastDeploy turns --quantization wint4 on ERNIE MoE into mix_quant (dense int8, experts int4)."""
    assert plan_memory(MODEL, "cuda", *plan_args(quant="wint8mix", tp=4, device_memory=G80, **SERVE)).fits
    two = plan_memory(MODEL, "cuda", *plan_args(quant="wint8mix", tp=2, device_memory=G80, **SERVE))
    assert not two.fits
    assert two.per_rank[0].by_category["weights"] > 70 * GiB  # the weights alone nearly fill a device


@pytest.mark.slow
def test_wint8mix_lora_fits_on_4_at_8k() -> None:
    plan = plan_memory(MODEL, "cuda", *plan_args(seq_len=8192, device_memory=G80, **LORA))
    assert plan.min_devices == 4 and (plan.tp, plan.ep) == (4, 4)  # ERNIEKit: tp 4, moe_group mp
    assert plan.trainable == "graph" and plan.fits


@pytest.mark.slow
def test_wint8mix_lora_32k_fits_on_4_narrowly_where_erniekit_uses_8() -> None:
    """ERNIEKit's 32K LoRA config runs on 8 (tp 8); with the vocabulary-parallel loss (the
    training runtime's default) this plan fits tp 4 ep 4, by under 2 GiB (docs/planning.md
    section 7 says why the claim still asks for 8)."""
    four = plan_memory(MODEL, "cuda", *plan_args(tp=4, ep=4, seq_len=32768, device_memory=G80, **LORA))
    eight = plan_memory(MODEL, "cuda", *plan_args(tp=8, ep=8, seq_len=32768, device_memory=G80, **LORA))
    assert four.fits and eight.fits
    assert 0 < four.headroom_bytes < 2 * GiB
    # kept at the end of forward: the 54 layer inputs recompute keeps (and the final norm's input),
    # whole on every rank (no sequence parallelism): 55 x 32768 x 8192 x 2 B = 27.5 GiB; the
    # loss's vocabulary shard of the f32 logits, 32768 x 103424 / 4 x 4 B = 3.2 GiB
    detail = four.per_rank[0].activation_detail
    assert detail["saved_bytes"] == pytest.approx(55 * 32768 * 8192 * 2 + 32768 * 103424 // 4 * 4, rel=1e-3)


def test_without_recompute_lora_does_not_fit_even_at_8k() -> None:
    options = {**LORA, "recompute": False}
    plan = plan_memory(MODEL, "cuda", *plan_args(tp=4, ep=4, seq_len=8192, device_memory=G80, **options))
    assert not plan.fits and plan.per_rank[0].by_category["activations"] > 60 * GiB


@pytest.mark.slow
def test_fp8_full_sft_fits_on_16_at_8k_with_offloaded_optimizer() -> None:
    plan = plan_memory(MODEL, "cuda", *plan_args(tp=16, ep=16, seq_len=8192, device_memory=G80, **FP8))
    assert plan.fits and plan.trainable == "full"
    r = plan.per_rank[0]
    assert r.weights_by_dtype["f8e4m3"] > 0.95 * r.by_category["weights"]  # params are FP8
    assert r.by_category["gradients"] == pytest.approx(2 * r.weights_by_dtype["f8e4m3"], rel=0.02)  # bf16
    assert r.by_category["optimizer_moments"] == 0 and r.host_bytes > 0
    # ERNIEKit asks for 2 TB of host memory next to the 16 GPUs: bf16 moments + f32 masters
    assert 1.9e12 < plan.host_total_bytes < 2.6e12
    assert any("FP8" in n for n in plan.notes)  # compile cannot split FP8 today: said, not hidden
    # offloading is what makes it fit: with the moments and masters on the device it does not
    assert not plan_memory(MODEL, "cuda",
                           *plan_args(tp=16, ep=16, seq_len=8192, device_memory=G80,
                                      **{**FP8, "offload_optimizer": False})).fits


@pytest.mark.slow
def test_fp8_full_sft_at_32k_disagrees_for_the_documented_reason() -> None:
    """ERNIEKit claims 16 x 80G at 32K too (tp 8 x pp 2 with sequence parallelism); this plan
    says no. The excess is less than what sequence parallelism would remove (the logits are
    already vocabulary-parallel: each tp-16 rank keeps 1/16 of them)."""
    plan = plan_memory(MODEL, "cuda", *plan_args(tp=16, ep=16, seq_len=32768, device_memory=G80, **FP8))
    assert not plan.fits
    layer_inputs = 54 * 32768 * 8192 * 2
    excess = -plan.headroom_bytes
    # with layer inputs cut 8 ways (SP over ERNIEKit's tp 8), it would fit
    assert excess < layer_inputs * 7 / 8
    assert excess > 0
