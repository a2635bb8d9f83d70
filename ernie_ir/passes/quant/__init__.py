"""Quantization: decide (annotate), then convert; and the flags that say what to apply.

- `config`: `QuantConfig`, which linears get which quantization, as plain data.
- `presets`: `--quant NAME` presets as pipelines (registered on import).
- `annotate`: the `quant-annotate` pass, which records the decision on the weights.
- `weight_only`, `fp8`, `qat`: the passes that convert annotated linears
  (`weight-only-quant`, `fp8-quant`, `qat-insert`).
- `calibrated`, `gptq`, `calib_data`: `calibrated-quant`, which quantizes the weights annotated
  `method=gptq` on calibration data (GPTQ's numerics; the data reader), before weight-only-quant.
- `cli_flags`: `--quant`, `--quant-config` and the `--lora-*` flags as pipeline text.
"""
