"""The bf16 form of weight-only MoE experts (`formats.fastdeploy.on_grid`): FastDeploy's only
route for them is a bf16 folder it quantizes at load with Paddle's `weight_quantize`; the values
we write must give back our codes and scales.

Checked against Paddle itself: `paddle.nn.quant.weight_quantize(w, algo, arch)` on this CPU (the
kernel FastDeploy's load calls; a GPU runs another kernel, modelled by `gpu_weight_codes` from
its source) of every weight in the folder, against the packed bytes and scales of the artifact's
own rank weights, at sm70 and sm80, for wint8, wint4 and wint8mix. The shares recorded in
config.json must equal what Paddle gives.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from ernie_ir.formats.fastdeploy import load_fastdeploy_checkpoint
from ernie_ir.ops.quant_numerics import INT_BOUND, gpu_weight_codes, grid_weight, weight_quantize
from ernie_ir.targets import CompileOptions, compile_model, verify_artifact

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_testkit import tiny_config, write_paddle_checkpoint

MOE = "ernie-4.5-21b-a3b@tiny"
SM80_MOE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 1024, "moe_intermediate_size": 128, "moe_num_shared_experts": 1,
            "moe_num_experts": 8, "moe_k": 2}


def _bf16(f: Any, key: str) -> np.ndarray:
    return np.frombuffer(f.get_slice(key)[:].tobytes(), np.uint16).view(ml_dtypes.bfloat16).reshape(
        f.get_slice(key).get_shape())


def paddle_gives_back(art: Path, arch: int) -> dict[str, list[int]]:
    """Per algo: [codes, codes equal, channels, scales equal, tensors with identical packed bytes,
    tensors] of Paddle's weight_quantize of every bf16 weight of the folder against the rank
    weights."""
    paddle = pytest.importorskip("paddle")
    from paddle.nn.quant import weight_quantize as paddle_quantize

    from ernie_ir.ops.cuda_layout import unpack

    out: dict[str, list[int]] = {}
    with safe_open(str(art / "model.safetensors"), framework="np") as top, \
            safe_open(str(art / "rank0" / "weights.safetensors"), framework="np") as rank:
        for key in rank.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            if not key.endswith(".quant_weight"):
                continue
            prefix = key[: -len(".quant_weight")]
            packed = rank.get_tensor(key)
            scale = _bf16(rank, prefix + ".weight_scale")
            w = _bf16(top, prefix + ".weight")
            k, n = w.shape
            algo = "weight_only_int8" if packed.shape[0] == n else "weight_only_int4"
            x = paddle.to_tensor(w.astype(np.float32)).astype("bfloat16")  # exact: w is bf16
            q, s = paddle_quantize(x, algo=algo, arch=arch)
            got_packed = q.numpy()
            got_scale = s.astype("float32").numpy()
            bits = 8 if algo.endswith("int8") else 4
            ours = unpack(packed, k, n, bits, arch)
            theirs = unpack(got_packed, k, n, bits, arch)
            c = out.setdefault(f"int{bits}", [0, 0, 0, 0, 0, 0])
            c[0] += ours.size
            c[1] += int((ours == theirs).sum())
            c[2] += n
            c[3] += int((got_scale == scale.astype(np.float32)).sum())
            c[4] += int(np.array_equal(got_packed.view(np.uint8), packed.view(np.uint8)))
            c[5] += 1
    return out


@pytest.fixture(scope="module")
def sm80_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sm80") / "src"
    write_paddle_checkpoint(folder, {**tiny_config("ernie-4.5-21b-a3b"), **SM80_MOE})
    return folder


@pytest.mark.parametrize("quant", ["wint8mix", "wint8", "wint4"])
@pytest.mark.parametrize("arch", [70, 80])
def test_paddle_weight_quantize_gives_back_our_codes(tmp_path: Path, sm80_source: Path, quant: str,
                                                     arch: int) -> None:
    model = MOE if arch == 70 else str(sm80_source)
    art = Path(compile_model(model, "cuda", CompileOptions(quant=quant, cuda_arch=arch, emit="fastdeploy",
                                                           out=tmp_path / "art")).out)
    verify_artifact(art)
    config = json.loads((art / "config.json").read_text())
    recorded = config["ernie_ir"]["load_time_quantization"]
    measured = paddle_gives_back(art, arch)
    assert set(recorded) == set(measured) == ({"int8"} if quant == "wint8" else {"int4"} if quant == "wint4"
                                              else {"int8", "int4"})
    for kind, (codes, same, channels, scales, identical, tensors) in measured.items():
        assert scales == channels  # every scale comes back (they are absmax scales)
        assert recorded[kind]["scales"] == 1.0 and recorded[kind]["codes_gpu"] == 1.0
        assert recorded[kind]["codes"] == codes and recorded[kind]["channels"] == channels
        # what we record of Paddle's CPU kernel is what Paddle's CPU kernel does, to the code
        assert recorded[kind]["codes_cpu"] == round(same / codes, 9)
        if kind == "int4":
            assert same == codes and identical == tensors  # int4: the very packed bytes
        else:  # int8 on the CPU kernel: a few large codes move by one (its rounded-scale division)
            assert 0.99 < same / codes <= 1


def test_the_folder_is_bf16_on_the_grid_of_the_rank_weights(tmp_path: Path) -> None:
    art = Path(compile_model(MOE, "cuda", CompileOptions(quant="wint8mix", cuda_arch=70, emit="fastdeploy",
                                                         out=tmp_path / "art")).out)
    ckpt = load_fastdeploy_checkpoint(art)  # the bf16 form reads back as stored, one rank
    assert ckpt.tp == 1 and ckpt.quantization["is_quantized"] is False
    top = ckpt.ranks[0]
    assert not [k for k in top if k.endswith((".quant_weight", ".weight_scale"))]
    dequantized = rank_weights_dequantized(art)
    assert dequantized and set(dequantized) <= set(top)
    for key, w in dequantized.items():
        # code x absmax / bound (`grid_weight`): the scale is absmax / bound rounded to bf16, and the
        # value one more bf16 rounding: within 2^-7 of code x scale
        assert top[key].dtype == ml_dtypes.bfloat16
        assert np.all(np.abs(top[key].astype(np.float32) - w) <= np.abs(w) * 2.0 ** -7), key
    # the disk cost: 2 bytes a quantized weight, the rest as stored
    size = (art / "model.safetensors").stat().st_size
    rank = (art / "rank0" / "weights.safetensors").stat().st_size
    assert 1.9 < size / rank < 4.2


def rank_weights_dequantized(art: Path) -> dict[str, np.ndarray]:
    """The artifact's quantized rank weights as code x scale (float32), under FastDeploy's names."""
    from ernie_ir.ops.cuda_layout import unpack

    out = {}
    with safe_open(str(art / "rank0" / "weights.safetensors"), framework="np") as f:
        for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            if key.endswith(".quant_weight"):
                prefix = key[: -len(".quant_weight")]
                packed, scale = f.get_tensor(key), _bf16(f, prefix + ".weight_scale").astype(np.float32)
                n = scale.shape[0]
                bits = 8 if packed.shape[0] == n else 4
                codes = unpack(packed, packed.shape[1], n, bits, 70)
                out[prefix + ".weight"] = codes.astype(np.float32) * scale
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_grid_weight_gives_back_every_absmax_scale_and_code(bits: int) -> None:
    """Every bf16 absmax significand at three exponents: the scale it quantizes to, and a channel of
    every code, come back through Paddle's arithmetic (CPU, bit for bit; GPU, the kernel's model)."""
    bound = INT_BOUND[bits]
    absmax = np.concatenate([np.arange(e, e + 0x80, dtype=np.uint16) for e in (0x3C00, 0x3F80, 0x4200)])
    absmax = absmax.view(ml_dtypes.bfloat16)
    codes = np.arange(-bound, bound + 1, dtype=np.int8)
    w = codes[:, None].astype(np.float32) / bound * absmax.astype(np.float32)[None]
    w = w.astype(ml_dtypes.bfloat16)
    w[-1] = absmax  # each channel's absmax is exactly the bf16 value
    q, s = weight_quantize(w, bits)
    grid = grid_weight(q, s, bits)
    back_q, back_s = weight_quantize(grid, bits)
    assert np.array_equal(back_s.view(np.uint16), s.view(np.uint16))
    assert np.array_equal(gpu_weight_codes(grid, bits), q)
    if bits == 4:
        assert np.array_equal(back_q, q)
    else:
        assert (back_q == q).mean() > 0.99 and np.abs(back_q.astype(int) - q).max() <= 1
