"""Reference: full-parameter AdamW training steps of a transformers ERNIE 4.5 (dense or MoE),
float32 on CPU.

Runs in the ``hf`` environment (torch + transformers). Never imports ernie_ir.

Usage::

    python hf_full_train.py SPEC OUT_DIR

SPEC (defaults in brackets):
- ``model`` ["dense"]: "dense" (``Ernie4_5ForCausalLM``, every key of ``hf_ernie_dense.py`` with
  its defaults) or "moe" (``Ernie4_5_MoeForCausalLM``, every key of ``hf_ernie_moe.py`` with its
  defaults, the non-zero score-correction bias included): built, randomised and saved exactly as
  those scripts do (``hf_ernie_dense.run``: ``ckpt/`` by ``save_pretrained``, HF layout,
  ``input_ids.npy``, ``logits.npy``).
- ``load_from`` [absent]: instead, a checkpoint folder (HF layout, e.g. paddleformers'
  ``save_pretrained``) loaded with ``AutoModelForCausalLM.from_pretrained(dir, dtype=float32)``;
  its ``save_pretrained`` must give back the folder's tensors (exit 1 otherwise); no ``ckpt/``.
- ``batches`` [required]: one batch per optimizer step, each ``{"input_ids": [[...], ...],
  "labels": [[...], ...]}`` ([rows, seq] ints; labels -100 where no loss is wanted, not shifted).
- ``lr`` [1e-3], ``beta1`` [0.9], ``beta2`` [0.999], ``eps`` [1e-8], ``weight_decay`` [0.0],
  ``clip_norm`` [1.0] (0: no clipping): ernie-ir's ``TrainOptions`` defaults.
- ``no_decay`` [[]]: name parts of parameters left undecayed (a second param group with
  ``weight_decay=0``); ``["bias", "norm"]`` is what ``Trainer`` does.

The training step is transformers' own: ``model.train()``, ``loss = model(input_ids=x, labels=y,
output_router_logits=False).loss`` (MoE; transformers shifts the labels itself and averages the
cross-entropy over the labels that are not -100; no router auxiliary loss), ``loss.backward()``,
``torch.nn.utils.clip_grad_norm_(params, clip_norm)`` (what ``Trainer`` calls with
``max_grad_norm``), ``torch.optim.AdamW(params, lr, betas, eps, weight_decay).step()``,
``zero_grad()``. ``params``: every parameter with ``requires_grad``: all of them but the MoE
``e_score_correction_bias`` (a ``requires_grad=False`` parameter in transformers, kept as saved),
each one decayed unless ``no_decay`` says otherwise (``Trainer`` exempts biases and norm
weights; ernie-ir's AdamW decays every trainable param, and the default follows ernie-ir).
Library facts that matter when comparing: ``nn.Embedding(padding_idx=pad_token_id)`` gives the
pad token's embedding row no gradient (paddleformers' embedding has no padding_idx), and the
experts run transformers' default experts implementation (recorded in meta.json).

Writes into OUT_DIR: ``losses.json`` (``losses``: the loss of each step, computed before its
update; ``grad_norms``: the global gradient norm before clipping; ``call``), ``trained.npz``
(every tensor after the last step, in the checkpoint's own names and layout: the keys
``save_pretrained`` writes, per-expert weights for MoE), ``meta.json``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import _refcommon as rc
import numpy as np
from hf_ernie_dense import DEFAULTS as DENSE_DEFAULTS
from hf_ernie_dense import common_config, run
from hf_ernie_moe import DEFAULTS as MOE_DEFAULTS


def saved_tensors(model: Any, folder: Path) -> dict[str, np.ndarray]:
    """What ``model.save_pretrained`` writes (the checkpoint's names and layout), read back; the
    folder is removed afterwards."""
    from safetensors.numpy import load_file

    model.save_pretrained(str(folder))
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    shutil.rmtree(folder)
    return tensors


def build(kind: str, spec: dict[str, Any], out: Path, timer: rc.Timer) -> tuple[Any, dict[str, Any]]:
    """A random model of ``kind``, saved to ``out/ckpt`` as hf_ernie_dense / hf_ernie_moe do it."""
    defaults = DENSE_DEFAULTS if kind == "dense" else MOE_DEFAULTS
    p = {**defaults, **{k: v for k, v in spec.items() if k in defaults}}
    if kind == "dense":
        from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

        return run(Ernie4_5ForCausalLM, Ernie4_5Config(**common_config(p)), p, spec, out, timer=timer)
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    config = Ernie4_5_MoeConfig(
        **common_config(p), moe_intermediate_size=p["moe_intermediate_size"],
        moe_num_experts=p["moe_num_experts"], moe_k=p["moe_k"],
        moe_num_shared_experts=p["moe_num_shared_experts"],
        moe_layer_start_index=p["moe_layer_start_index"], moe_layer_end_index=p["moe_layer_end_index"],
        moe_layer_interval=p["moe_layer_interval"])

    def bias_init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray | None:
        if name.endswith("e_score_correction_bias"):  # as hf_ernie_moe.py
            return (p["bias_scale"] * rng.standard_normal(shape)).astype(np.float32)
        return None

    return run(Ernie4_5_MoeForCausalLM, config, p, spec, out, special_init=bias_init, timer=timer)


def load(folder: Path, out: Path) -> tuple[Any, dict[str, Any]]:
    """``AutoModelForCausalLM.from_pretrained(folder)`` in float32, checked to hold the folder's tensors."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    files: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        files.update(load_file(str(f)))
    back = saved_tensors(model, out / "reloaded_ckpt")
    if set(back) != set(files):
        raise SystemExit(f"{folder}: transformers holds {sorted(set(back) ^ set(files))[:4]} differently")
    for k in sorted(files):
        if not np.array_equal(back[k], files[k].astype(np.float32)):
            raise SystemExit(f"{folder}: after loading, {k} differs from the file's tensor")
    meta = {"library": {"torch": torch.__version__, "transformers": transformers.__version__},
            "loaded_from": str(folder),
            "load_call": "AutoModelForCausalLM.from_pretrained(dir, dtype=float32)",
            "class": type(model).__name__, "state_equal_file": True}
    return model, meta


def main() -> None:
    rc.quiet_env()
    spec, out = rc.parse_args()
    kind = spec.get("model", "dense")
    if kind not in ("dense", "moe"):
        raise SystemExit(f"model must be 'dense' or 'moe', got {kind!r}")
    o = rc.train_options(spec)
    batches = rc.train_batches(spec)
    timer = rc.Timer()
    import torch
    import transformers  # noqa: F401  (import time counted here)

    timer.lap("import")
    torch.set_num_threads(1)  # the summation order of every reduction stays put
    if spec.get("load_from"):
        model, meta = load(Path(spec["load_from"]), out)
        timer.lap("load")
    else:
        model, meta = build(kind, spec, out, timer)
    is_moe = any(hasattr(layer.mlp, "experts") for layer in model.model.layers)

    model.train()
    named = [(n, prm) for n, prm in model.named_parameters() if prm.requires_grad]
    params = [prm for _, prm in named]
    frozen = sorted(n for n, prm in model.named_parameters() if not prm.requires_grad)
    exempt = rc.no_decay(spec)
    undecayed = sorted(n for n, _ in named if any(x in n for x in exempt))
    groups = [{"params": [prm for n, prm in named if n not in undecayed]},
              {"params": [prm for n, prm in named if n in undecayed], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=float(o["lr"]),
                            betas=(float(o["beta1"]), float(o["beta2"])), eps=float(o["eps"]),
                            weight_decay=float(o["weight_decay"]))
    extra = {"output_router_logits": False} if is_moe else {}
    losses: list[float] = []
    norms: list[float] = []
    for ids, labels in batches:
        loss = model(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels), **extra).loss
        loss.backward()
        if o["clip_norm"]:
            norm = torch.nn.utils.clip_grad_norm_(params, float(o["clip_norm"]))
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.grad) for g in params]))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        norms.append(float(norm))
    rc.check_finite("losses", np.asarray(losses))
    timer.lap("train")

    trained = saved_tensors(model, out / "trained_ckpt")
    for k, v in trained.items():
        rc.check_finite(k, v)
    np.savez(out / "trained.npz", **trained)
    call = (f"model(input_ids=x, labels=y{', output_router_logits=False' if extra else ''}).loss; "
            "backward; clip_grad_norm_; torch.optim.AdamW.step; zero_grad")
    (out / "losses.json").write_text(json.dumps({"losses": losses, "grad_norms": norms, "call": call}))
    timer.lap("save_trained")
    meta.update({"model": "moe" if is_moe else "dense", "optim": o, "steps": len(batches),
                 "frozen_params": frozen, "not_decayed": undecayed, "pad_token_id": model.config.pad_token_id,
                 "attn_implementation": model.config._attn_implementation,
                 "experts_implementation": getattr(model.config, "_experts_implementation", None),
                 "trained_keys": {k: [list(v.shape), str(v.dtype)] for k, v in sorted(trained.items())},
                 "timing_s": timer.laps})
    if is_moe:
        meta["moe_layers"] = [i for i, layer in enumerate(model.model.layers)
                              if hasattr(layer.mlp, "experts")]
    rc.write_meta(out, meta)


if __name__ == "__main__":
    main()
