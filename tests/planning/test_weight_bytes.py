"""Planned weight bytes equal, exactly, the tensor bytes `compile` writes into each rank's weights file.

The artifact side is read from the safetensors header alone (data offsets), so the check is
independent of the planner's arithmetic: packed int4, cuda's arch layouts, XPU scales in f32,
LoRA adapters and every rank's slice are whatever the compiler wrote.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ernie_ir.planning import plan_memory
from ernie_ir.targets import CompileOptions, compile_model

ST_DTYPE = {"bf16": "BF16", "f16": "F16", "f32": "F32", "i8": "I8", "i4": "U8", "f8e4m3": "F8_E4M3"}
"""IR dtype -> the safetensors dtype its bytes are stored as (int4: packed into U8)."""


def header(path: Path) -> dict[str, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h


def stored_bytes(path: Path) -> tuple[int, dict[str, int]]:
    """(total tensor bytes, bytes per safetensors dtype) of one weights file."""
    by: dict[str, int] = {}
    for entry in header(path).values():
        start, stop = entry["data_offsets"]
        by[entry["dtype"]] = by.get(entry["dtype"], 0) + stop - start
    return sum(by.values()), by


QUANTS = ["none", "wint8", "wint4", "wint8mix"]
CASES = [
    # (model, target, cuda arch, layouts): MoE with shared experts, MoE without, dense, GPT, SE;
    # cuda sm70 packs every tiny shape, sm80 falls back to the portable form for most of them
    ("ernie-4.5-21b-a3b@tiny", "cuda", 70, [(1, 1), (2, 1), (2, 2), (1, 2)]),
    ("ernie-4.5-21b-a3b@tiny", "kunlun", None, [(1, 1), (2, 2)]),
    ("ernie-4.5-300b-a47b@tiny", "cuda", 80, [(1, 1), (2, 1), (2, 2)]),
    ("ernie-4.5-300b-a47b@tiny", "ascend", None, [(2, 2)]),
    ("ernie-4.5-0.3b@tiny", "cuda", 70, [(1, 1), (2, 1)]),
    ("gpt-345m@tiny", "kunlun", None, [(2, 1)]),
    ("ernie-3.5-se-3b@tiny", "cuda", 70, [(2, 1)]),
]
PARAMS = [(m, t, a, q, tp, ep) for m, t, a, layouts in CASES for q in QUANTS for tp, ep in layouts]


def check(model: str, target: str, arch: int | None, tp: int, ep: int, out: Path, **kw: object) -> None:
    cuda = {"cuda_arch": arch} if arch is not None else {}
    options = CompileOptions(tp=tp, ep=ep, out=out, **cuda, **kw)  # type: ignore[arg-type]
    compile_model(model, target, options)
    plan = plan_memory(model, target, options)  # the same options: what compile was asked
    assert plan.devices == max(tp, ep)
    for r in plan.per_rank:
        total, by = stored_bytes(out / f"rank{r.rank}" / "weights.safetensors")
        assert r.by_category["weights"] + r.by_category["lora"] == total, f"rank {r.rank}"
        planned: dict[str, int] = {}
        for dtype, b in r.weights_by_dtype.items():
            planned[ST_DTYPE[dtype]] = planned.get(ST_DTYPE[dtype], 0) + b
        assert planned == by, f"rank {r.rank}"


@pytest.mark.parametrize(("model", "target", "arch", "quant", "tp", "ep"), PARAMS,
                         ids=[f"{m}-{t}{a or ''}-{q}-tp{tp}ep{ep}" for m, t, a, q, tp, ep in PARAMS])
def test_planned_weights_equal_the_artifact(model: str, target: str, arch: int | None, quant: str,
                                            tp: int, ep: int, tmp_path: Path) -> None:
    check(model, target, arch, tp, ep, tmp_path / "a", quant=quant)


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 2)])
def test_lora_adapters_are_counted_as_written(tp: int, ep: int, tmp_path: Path) -> None:
    check("ernie-4.5-21b-a3b@tiny", "cuda", 70, tp, ep, tmp_path / "a", quant="wint8mix", lora_rank=4,
          mode="training")
    plan = plan_memory("ernie-4.5-21b-a3b@tiny", "cuda",
                       CompileOptions(quant="wint8mix", lora_rank=4, tp=tp, ep=ep, mode="training",
                                      cuda_arch=70))
    assert all(r.by_category["lora"] > 0 for r in plan.per_rank)
    assert plan.trainable == "graph"


@pytest.mark.parametrize("quant", ["fp8", "qat-int8"])
def test_fp8_and_qat_weights_equal_the_artifact(quant: str, tmp_path: Path) -> None:
    check("ernie-4.5-0.3b@tiny", "cuda", 90, 1, 1, tmp_path / "a", quant=quant)
