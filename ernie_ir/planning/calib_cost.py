"""What a `method=gptq` calibration costs on CPU: memory per layer and time, from the config alone.

`calibrated-quant` (docs/quantization.md 4.7) works one decoder layer at a time. For each
layer it holds the calibration windows as the layer's inputs, runs the layer twice over them
(float, to gather each linear's X^T X; quantized, to make the next layer's inputs) and sweeps
GPTQ over every linear. Per layer, with T = windows x seq tokens and a linear W [K, N]:

- Hessians: K x K float64 per linear (per routed expert for an expert stack), all of a layer's
  held at once: 8 K^2 bytes each;
- held inputs: T x hidden float32: 4 T hidden bytes;
- forward FLOPs (one run): 2 K N per token per linear (a routed expert sees moe_k / experts of
  the tokens), plus attention's 4 x seq x heads x head_dim per token (scores and values, full
  window, no causal halving);
- Hessian FLOPs: 2 K^2 per token seen, per linear;
- sweep FLOPs: K^2 (K + N) per linear (the factorization ~K^3, the error updates K^2 N).

Seconds = (2 x forward + Hessian FLOPs) / PASS_RATE + sweep FLOPs / SWEEP_RATE. Both rates are
the ones ERNIE-4.5-0.3B's measured calibration implies on the development machine (one thread
of a shared 2-core CPU, numpy): 67 s of sweeps for its 18 layers and 10.4 s per 512-token
window (docs/quantization.md 4.7); so that model's estimate is the measurement, by construction,
and others scale by their FLOPs. A MoE model's layers in [moe_layer_start_index,
moe_layer_end_index] (every moe_layer_interval) have routed experts; the others a dense MLP.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEASURED_MODEL = "ernie-4.5-0.3b"
MEASURED_FIXED_S = 67.0
"""Seconds of GPTQ sweeps for all 18 layers of ERNIE-4.5-0.3B (docs/quantization.md 4.7)."""
MEASURED_WINDOW_S = 10.4
"""Seconds per 512-token window for all 18 layers: the two runs and the Hessians."""
MEASURED_SEQ = 512
DEFAULT_WINDOWS = 128
DEFAULT_SEQ = 512


@dataclass(frozen=True)
class CalibratedLinear:
    """One calibrated linear of a layer: in K, out N, the share of the tokens it sees, and how
    many there are of it (experts)."""

    k: int
    n: int
    share: float = 1.0
    count: int = 1


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer's calibration figures for T tokens."""

    hessian_bytes: int
    held_bytes: int
    forward_flops: float
    hessian_flops: float
    sweep_flops: float

    @property
    def peak_bytes(self) -> int:
        return self.hessian_bytes + self.held_bytes


@dataclass(frozen=True)
class CalibrationEstimate:
    """A whole model's calibration: per-layer costs and the time at the measured rates."""

    windows: int
    seq_len: int
    layers: tuple[LayerCost, ...]
    pass_rate: float
    sweep_rate: float

    @property
    def seconds(self) -> float:
        return sum((2 * c.forward_flops + c.hessian_flops) / self.pass_rate + c.sweep_flops / self.sweep_rate
                   for c in self.layers)

    @property
    def largest(self) -> LayerCost:
        return max(self.layers, key=lambda c: c.peak_bytes)


def layer_linears(config: Mapping[str, Any], index: int) -> list[CalibratedLinear]:
    """The calibrated linears of decoder layer `index` (attention, then the MLP or the experts)."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or h // heads)
    out = [CalibratedLinear(h, (heads + 2 * kv) * hd), CalibratedLinear(heads * hd, h)]
    experts = int(config.get("moe_num_experts") or 0)
    start = int(config.get("moe_layer_start_index", 0))
    end = int(config.get("moe_layer_end_index", int(config["num_hidden_layers"]) - 1))
    step = int(config.get("moe_layer_interval", 1)) or 1
    if experts and start <= index <= end and (index - start) % step == 0:
        inter = int(config["moe_intermediate_size"])
        share = int(config["moe_k"]) / experts
        out += [CalibratedLinear(h, 2 * inter, share, experts), CalibratedLinear(inter, h, share, experts)]
        shared = int(config.get("moe_num_shared_experts") or 0)
        if shared:
            out += [CalibratedLinear(h, 2 * inter * shared), CalibratedLinear(inter * shared, h)]
    else:
        inter = int(config["intermediate_size"])
        out += [CalibratedLinear(h, 2 * inter), CalibratedLinear(inter, h)]
    return out


def layer_cost(config: Mapping[str, Any], index: int, windows: int, seq_len: int) -> LayerCost:
    """Decoder layer `index`'s figures for `windows` windows of `seq_len` tokens (module docstring)."""
    tokens = windows * seq_len
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    hd = int(config.get("head_dim") or h // heads)
    lins = layer_linears(config, index)
    attention = 4.0 * seq_len * heads * hd
    return LayerCost(
        hessian_bytes=sum(8 * x.k * x.k * x.count for x in lins),
        held_bytes=4 * tokens * h,
        forward_flops=tokens * (sum(2.0 * x.k * x.n * x.share * x.count for x in lins) + attention),
        hessian_flops=tokens * sum(2.0 * x.k * x.k * x.share * x.count for x in lins),
        sweep_flops=sum(float(x.k) ** 2 * (x.k + x.n) * x.count for x in lins))


def _costs(config: Mapping[str, Any], windows: int, seq_len: int) -> tuple[LayerCost, ...]:
    return tuple(layer_cost(config, i, windows, seq_len) for i in range(int(config["num_hidden_layers"])))


def measured_rates() -> tuple[float, float]:
    """(pass FLOP/s, sweep FLOP/s) that ERNIE-4.5-0.3B's measured calibration implies."""
    from ernie_ir.frontends.builtins import builtin_config

    one = _costs(builtin_config(MEASURED_MODEL, "meta"), 1, MEASURED_SEQ)
    return (sum(2 * c.forward_flops + c.hessian_flops for c in one) / MEASURED_WINDOW_S,
            sum(c.sweep_flops for c in one) / MEASURED_FIXED_S)


def calibration_estimate(config: Mapping[str, Any], windows: int = DEFAULT_WINDOWS,
                         seq_len: int | None = None) -> CalibrationEstimate:
    """The calibration cost of the model `config` describes (a config.json dict). `seq_len` None:
    the default window, min(512, max_position_embeddings)."""
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ, int(config.get("max_position_embeddings") or DEFAULT_SEQ))
    pass_rate, sweep_rate = measured_rates()
    return CalibrationEstimate(windows, seq_len, _costs(config, windows, seq_len), pass_rate, sweep_rate)


def model_config(model: str) -> dict[str, Any] | None:
    """The config.json dict of MODEL: a built-in (`NAME`, `NAME@meta`, `NAME@tiny`) or a checkpoint
    folder; None for anything else (an artifact, a graph file)."""
    from ernie_ir.frontends.builtins import PUBLISHED, builtin_config

    name, _, variant = model.partition("@")
    if name in PUBLISHED and not Path(model).exists():
        try:
            return builtin_config(name, variant or "meta")
        except KeyError:
            return None
    path = Path(model) / "config.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and "hidden_size" in data else None
    return None


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _duration(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


def calibration_note(model: str, windows: int = DEFAULT_WINDOWS, seq_len: int | None = None) -> str | None:
    """One line: the CPU time and peak memory of calibrating MODEL with method=gptq (None: its config
    is not known)."""
    config = model_config(model)
    if config is None:
        return None
    try:
        est = calibration_estimate(config, windows, seq_len)
    except (KeyError, TypeError, ValueError):  # a config without the fields the estimate reads
        return None
    big = est.largest
    return (f"method=gptq at {est.windows} windows of {est.seq_len} tokens: "
            f"~{_duration(est.seconds)} of CPU (one thread, at the rates ERNIE-4.5-0.3B's measured "
            f"calibration gives), {len(est.layers)} layers; peak ~{_gb(big.peak_bytes)} for the largest "
            "layer "
            f"(Hessians {_gb(big.hessian_bytes)} float64, held inputs {_gb(big.held_bytes)} float32) "
            "(docs/quantization.md 4.7)")
