"""Reference: paddleformers ``LoRAModel`` on a random dense ERNIE 4.5, float32 on CPU.

Runs in the ``pf`` environment. Never imports ernie_ir.

Usage::

    python pf_lora.py SPEC OUT_DIR

SPEC: every key of ``pf_ernie_dense.py`` (same defaults) plus ``r`` [4],
``lora_alpha`` [8] and ``target_modules`` [the four ERNIEKit patterns].
lora_A and lora_B are overwritten with seeded N(0, 0.1^2) values (lora_B is
zero at init; a non-zero B makes the adapter change the logits).

Writes into OUT_DIR:
- ``base/``: ``save_pretrained`` of the dense model, saved before wrapping;
- ``adapter/``: ``LoRAModel.save_pretrained`` output;
- ``input_ids.npy``, ``logits.npy`` (with the adapter), ``base_logits.npy``
  (same model, adapter disabled), all float32 logits [batch, seq, vocab];
- ``meta.json``: versions, parameters, adapter files and keys, timings.
"""

from __future__ import annotations

from typing import Any

import _refcommon as rc
import numpy as np
from pf_ernie_dense import DEFAULTS, build_model

TARGETS = [".*qkv_proj.*", ".*o_proj.*", ".*up_gate_proj.*", ".*down_proj.*"]


def main() -> None:
    rc.quiet_env()
    spec, out = rc.parse_args()
    p: dict[str, Any] = {**DEFAULTS, "r": 4, "lora_alpha": 8, "target_modules": TARGETS}
    p.update({k: v for k, v in spec.items() if k in p})
    timer = rc.Timer()

    import paddle
    import paddleformers
    from paddleformers.peft import LoRAConfig, LoRAModel
    from safetensors.numpy import load_file

    timer.lap("import")
    paddle.set_device("cpu")
    paddle.seed(p["seed"])
    model = build_model(p)
    model.save_pretrained(str(out / "base"))
    timer.lap("build_base")

    lora_cfg = LoRAConfig(
        target_modules=list(p["target_modules"]),
        r=int(p["r"]),
        lora_alpha=p["lora_alpha"],
        dtype="float32",
    )
    lora = LoRAModel(model, lora_cfg)
    lora.eval()
    lora_rng = np.random.default_rng(p["seed"] + 1)
    memory_lora: dict[str, list[Any]] = {}
    for name, t in sorted(lora.state_dict().items()):
        if "lora_" in name:
            t.set_value((0.1 * lora_rng.standard_normal(tuple(t.shape))).astype(np.float32))
            memory_lora[name] = [list(t.shape), str(t.dtype)]
    timer.lap("wrap")

    ids = rc.token_ids(spec, p["vocab_size"], p["seed"])
    x = paddle.to_tensor(ids)
    with paddle.no_grad():
        logits = lora(x).logits.astype("float32").numpy()
        lora.disable_lora()
        base_logits = lora(x).logits.astype("float32").numpy()
        lora.enable_lora()
    rc.check_finite("logits", logits)
    rc.check_finite("base_logits", base_logits)
    np.save(out / "input_ids.npy", ids)
    np.save(out / "logits.npy", logits)
    np.save(out / "base_logits.npy", base_logits)
    timer.lap("forward")

    lora.save_pretrained(str(out / "adapter"))
    timer.lap("save")

    saved: dict[str, np.ndarray] = {}
    for f in sorted((out / "adapter").glob("*.safetensors")):
        saved.update(load_file(str(f)))
    rc.write_meta(
        out,
        {
            "library": {"paddle": paddle.__version__, "paddleformers": paddleformers.__version__},
            "params": p,
            "scaling": float(p["lora_alpha"]) / int(p["r"]),
            "adapter_effect_max_abs": float(np.abs(logits - base_logits).max()),
            "adapter_files": sorted(x.name for x in (out / "adapter").iterdir()),
            "base_files": sorted(x.name for x in (out / "base").iterdir()),
            "memory_lora_keys": memory_lora,
            "saved_adapter_keys": {k: [list(v.shape), str(v.dtype)] for k, v in sorted(saved.items())},
            "timing_s": timer.laps,
        },
    )


if __name__ == "__main__":
    main()
