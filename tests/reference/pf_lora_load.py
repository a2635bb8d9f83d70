"""Reference: paddleformers ``LoRAModel.from_pretrained`` of an adapter folder onto a base checkpoint.

Runs in the ``pf`` environment, float32 on CPU. Never imports ernie_ir.

Usage::

    python pf_lora_load.py SPEC OUT_DIR

Two steps, as a user runs them: build (and save) a random base model, then
load a base checkpoint plus an adapter folder that someone else wrote.

SPEC:
- ``base`` [absent]: a checkpoint folder to load (paddleformers or
  transformers layout; ``config.json``'s ``model_type`` picks
  ``Ernie4_5ForCausalLM`` or ``Ernie4_5_MoeForCausalLM``). Absent: a random
  ``model`` is built (every parameter from ``_refcommon.random_param``),
  saved with ``save_pretrained`` into ``OUT_DIR/base/`` and loaded from there.
- ``model`` ["dense"] or "moe" (only when building): dense takes every key
  of ``pf_ernie_dense.py`` (same defaults); moe takes ``MOE_DEFAULTS`` below
  (the defaults of ``hf_ernie_moe.py``, no MTP layers).
- ``adapter`` [absent]: an adapter folder (lora_config.json + weights). It is
  copied into ``OUT_DIR/adapter/`` and loaded from the copy with
  ``LoRAModel.from_pretrained(model, folder)`` (the default flex-checkpoint
  loader, which rewrites a metadata file in the folder it loads).
- ``forward`` [true for dense, false for moe]: run the model on
  ``input_ids``. paddleformers 1.2.0's MoE layer needs the GPU-only kernel
  ``expand_modality_expert_id`` (no CPU kernel is registered), so a MoE
  forward fails on CPU.
- ``seed`` [0], ``input_ids`` [seeded random 2 x 7].

Writes into OUT_DIR:
- ``base/`` (built or copied), ``input_ids.npy``;
- with ``forward``: ``base_logits.npy`` (no adapter, or the adapter
  disabled) and, with an adapter, ``logits.npy`` (adapter on), float32;
- with an adapter: ``lora_state.safetensors`` (every lora_A / lora_B of the
  LoRA model as loaded, keys as in the adapter file: the wrapper's ``model.``
  prefix removed) and ``merged_state.safetensors`` (paddleformers'
  ``get_merge_state_dict``, W + A @ B * scaling in its in-memory layout, for
  the weights that have an adapter; taken after the forward);
- ``meta.json``: versions, parameters, the loaded LoRAConfig (r, lora_alpha,
  scaling, target_modules, dtype), the adapted layers, ``keys_not_in_file``
  (adapters paddleformers created that the file did not fill: they keep
  their init values), ``file_keys_not_loaded``, ``values_differ_from_file``
  (keys whose loaded value differs from the file's), timings.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import _refcommon as rc
import numpy as np
from pf_ernie_dense import DEFAULTS

MOE_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "moe_num_experts": 8,
    "moe_k": 2,
    "moe_num_shared_experts": 1,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": -1,
    "moe_layer_interval": 1,
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "seed": 0,
}


def classes(model_type: str) -> tuple[Any, Any]:
    from paddleformers.transformers import (
        Ernie4_5_MoeConfig,
        Ernie4_5_MoeForCausalLM,
        Ernie4_5Config,
        Ernie4_5ForCausalLM,
    )

    if model_type == "ernie4_5_moe":
        return Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM
    if model_type == "ernie4_5":
        return Ernie4_5Config, Ernie4_5ForCausalLM
    raise SystemExit(f"model_type {model_type!r} is neither ernie4_5 nor ernie4_5_moe")


def build(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """A random model saved to out/base; returns the effective parameters."""
    import paddle

    moe = spec.get("model", "dense") == "moe"
    p: dict[str, Any] = dict(MOE_DEFAULTS if moe else DEFAULTS)
    p.update({k: v for k, v in spec.items() if k in p})
    config_cls, model_cls = classes("ernie4_5_moe" if moe else "ernie4_5")
    extra = {k: p[k] for k in MOE_DEFAULTS if k.startswith("moe_")} if moe else {}
    if moe:
        extra["num_nextn_predict_layers"] = 0
    cfg = config_cls(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_hidden_layers"],
        num_attention_heads=p["num_attention_heads"],
        num_key_value_heads=p["num_key_value_heads"],
        head_dim=p["head_dim"],
        tie_word_embeddings=p["tie_word_embeddings"],
        rope_theta=float(p["rope_theta"]),
        rms_norm_eps=p["rms_norm_eps"],
        max_position_embeddings=4096,
        fuse_rms_norm=False,
        dtype="float32",
        **extra,
    )
    paddle.seed(p["seed"])
    model = model_cls(cfg)
    rng = np.random.default_rng(p["seed"])
    state = model.state_dict()
    for name in sorted(state):
        state[name].set_value(rc.random_param(rng, name, tuple(state[name].shape)))
    model.save_pretrained(str(out / "base"))
    return p


def main() -> None:
    rc.quiet_env()
    spec, out = rc.parse_args()
    timer = rc.Timer()

    import paddle
    import paddleformers
    from paddleformers.peft import LoRAModel
    from safetensors.numpy import load_file, save_file

    timer.lap("import")
    paddle.set_device("cpu")
    params: dict[str, Any] = {}
    if spec.get("base") is None:
        params = build(spec, out)
        timer.lap("build_base")
    else:
        shutil.copytree(spec["base"], out / "base")  # from_pretrained writes into the folder it reads
    config = json.loads((out / "base" / "config.json").read_text())
    config_cls, model_cls = classes(str(config.get("model_type")))
    cfg = config_cls.from_pretrained(str(out / "base"))
    cfg.fuse_rms_norm = False  # a config.json without it fails on CPU (no fused_rms_norm_ext kernel)
    model = model_cls.from_pretrained(str(out / "base"), config=cfg, dtype="float32")
    model.eval()
    timer.lap("load_base")

    moe = config.get("model_type") == "ernie4_5_moe"
    forward = bool(spec.get("forward", not moe))
    vocab = int(config["vocab_size"])
    ids = rc.token_ids(spec, vocab, int(spec.get("seed", 0)))
    np.save(out / "input_ids.npy", ids)
    x = paddle.to_tensor(ids)
    meta: dict[str, Any] = {
        "library": {"paddle": paddle.__version__, "paddleformers": paddleformers.__version__},
        "params": params,
        "model_class": model_cls.__name__,
        "forward": forward,
    }
    if spec.get("adapter") is None:
        if forward:
            with paddle.no_grad():
                base_logits = model(x).logits.astype("float32").numpy()
            rc.check_finite("base_logits", base_logits)
            np.save(out / "base_logits.npy", base_logits)
            timer.lap("forward")
        meta["timing_s"] = timer.laps
        rc.write_meta(out, meta)
        return

    shutil.copytree(spec["adapter"], out / "adapter")
    files_before = sorted(f.name for f in (out / "adapter").iterdir())
    lora = LoRAModel.from_pretrained(model, str(out / "adapter"))
    lora.eval()
    timer.lap("load_adapter")

    file_tensors: dict[str, np.ndarray] = {}
    for f in sorted((out / "adapter").glob("*.safetensors")):
        file_tensors.update(load_file(str(f)))
    loaded: dict[str, np.ndarray] = {}
    for name, t in lora.state_dict().items():
        if "lora_" in name:
            key = name[len("model."):] if name.startswith("model.") else name
            loaded[key] = np.ascontiguousarray(t.astype("float32").numpy())
    save_file(loaded, str(out / "lora_state.safetensors"))
    differ = sorted(k for k in loaded if k in file_tensors and not np.array_equal(
        loaded[k], file_tensors[k].astype(np.float32)))

    if forward:
        with paddle.no_grad():
            logits = lora(x).logits.astype("float32").numpy()
            lora.disable_lora()
            base_logits = lora(x).logits.astype("float32").numpy()
            lora.enable_lora()
        rc.check_finite("logits", logits)
        rc.check_finite("base_logits", base_logits)
        np.save(out / "logits.npy", logits)
        np.save(out / "base_logits.npy", base_logits)
        timer.lap("forward")

    adapted = sorted({k.rsplit(".", 1)[0] for k in loaded})
    weights = {f"{m}.weight" for m in adapted}
    merged = lora.get_merge_state_dict(offload=False)  # adds A @ B * scaling into the weights in place
    kept = {k: np.ascontiguousarray(v.astype("float32").numpy()) for k, v in merged.items() if k in weights}
    save_file(kept, str(out / "merged_state.safetensors"))
    timer.lap("merge")

    lc = lora.lora_config
    meta.update({
        "lora_config": {"r": lc.r, "lora_alpha": lc.lora_alpha, "scaling": lc.scaling, "rslora": lc.rslora,
                        "target_modules": lc.target_modules, "dtype": lc.dtype,
                        "tensor_model_parallel_size": lc.tensor_model_parallel_size},
        "adapted_layers": adapted,
        "loaded_keys": {k: list(v.shape) for k, v in sorted(loaded.items())},
        "keys_not_in_file": sorted(set(loaded) - set(file_tensors)),
        "file_keys_not_loaded": sorted(set(file_tensors) - set(loaded)),
        "values_differ_from_file": differ,
        "adapter_files_before_load": files_before,
        "adapter_files_after_load": sorted(f.name for f in (out / "adapter").iterdir()),
        "timing_s": timer.laps,
    })
    if forward:
        meta["adapter_effect_max_abs"] = float(np.abs(logits - base_logits).max())
    rc.write_meta(out, meta)


if __name__ == "__main__":
    main()
