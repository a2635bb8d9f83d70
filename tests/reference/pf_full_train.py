"""Reference: full-parameter AdamW training steps of a random paddleformers dense ERNIE 4.5
(``Ernie4_5ForCausalLM``), float32 on CPU.

Runs in the ``pf`` environment (paddlepaddle + paddleformers). Never imports ernie_ir.

Usage::

    python pf_full_train.py SPEC OUT_DIR

SPEC (defaults in brackets): every key of ``pf_ernie_dense.py`` (same defaults: the model is
built, randomised and saved as that script does it: ``ckpt/`` by ``save_pretrained``), plus
- ``batches`` [required]: one batch per optimizer step, each ``{"input_ids": [[...], ...],
  "labels": [[...], ...]}`` ([rows, seq] ints; labels -100 where no loss is wanted, not shifted);
- ``lr`` [1e-3], ``beta1`` [0.9], ``beta2`` [0.999], ``eps`` [1e-8], ``weight_decay`` [0.0],
  ``clip_norm`` [1.0] (0: no clipping): ernie-ir's ``TrainOptions`` defaults;
- ``no_decay`` [[]]: name parts of parameters left undecayed (``apply_decay_param_fun``, as
  PaddleNLP's Trainer builds it); ``["bias", "norm"]`` is the Trainer's choice.

The training step is paddleformers' own loss with Paddle's optimizer: ``model.train()``,
``loss = model(input_ids=x[:, :-1], labels=y[:, 1:]).loss`` (paddleformers does not shift the
labels; its criterion averages the cross-entropy over the labels that are not -100),
``loss.backward()``, ``paddle.optimizer.AdamW(learning_rate, parameters, beta1, beta2, epsilon,
weight_decay, grad_clip=paddle.nn.ClipGradByGlobalNorm(clip_norm)).step()``, ``clear_grad()``.
``parameters``: every parameter that is not ``stop_gradient`` (all of them), every one decayed
unless ``no_decay`` says otherwise (PaddleNLP's Trainer exempts biases and norm weights; ernie-ir's
AdamW decays every trainable param, and the default follows ernie-ir).

Writes into OUT_DIR: ``ckpt/`` (the model before training), ``input_ids.npy``, ``logits.npy``
(``input_ids`` as ``pf_ernie_dense.py``), ``losses.json`` (``losses``: the loss of each step,
computed before its update; ``grad_norms``: the global gradient norm before clipping;
``call``), ``trained.npz`` (every tensor after the last step in the checkpoint's own names and
layout: what ``save_pretrained`` writes, HF layout), ``meta.json``.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import _refcommon as rc
import numpy as np
from pf_ernie_dense import DEFAULTS, build_model


def main() -> None:
    rc.quiet_env()
    spec, out = rc.parse_args()
    p = {**DEFAULTS, **{k: v for k, v in spec.items() if k in DEFAULTS}}
    o = rc.train_options(spec)
    batches = rc.train_batches(spec)
    timer = rc.Timer()

    import paddle
    import paddleformers
    from safetensors.numpy import load_file

    timer.lap("import")
    paddle.set_device("cpu")
    paddle.base.core.set_num_threads(1)  # the summation order of every reduction stays put
    paddle.seed(p["seed"])
    model = build_model(p)
    ids = rc.token_ids(spec, p["vocab_size"], p["seed"])
    with paddle.no_grad():
        logits = model(paddle.to_tensor(ids)).logits.astype("float32").numpy()
    rc.check_finite("logits", logits)
    np.save(out / "input_ids.npy", ids)
    np.save(out / "logits.npy", logits)
    model.save_pretrained(str(out / "ckpt"))
    timer.lap("build")

    model.train()
    named = [(n, prm) for n, prm in model.named_parameters() if not prm.stop_gradient]
    params = [prm for _, prm in named]
    exempt = rc.no_decay(spec)
    undecayed = sorted(n for n, _ in named if any(x in n for x in exempt))
    decayed = {prm.name for n, prm in named if n not in undecayed}  # Paddle's names, as the Trainer
    clip = paddle.nn.ClipGradByGlobalNorm(float(o["clip_norm"])) if o["clip_norm"] else None
    opt = paddle.optimizer.AdamW(learning_rate=float(o["lr"]), parameters=params, beta1=float(o["beta1"]),
                                 beta2=float(o["beta2"]), epsilon=float(o["eps"]),
                                 weight_decay=float(o["weight_decay"]), grad_clip=clip,
                                 apply_decay_param_fun=(lambda name: name in decayed) if exempt else None)
    losses: list[float] = []
    norms: list[float] = []
    for x, y in batches:
        loss = model(input_ids=paddle.to_tensor(x[:, :-1]), labels=paddle.to_tensor(y[:, 1:])).loss
        loss.backward()
        norms.append(float(np.sqrt(sum(float((prm.grad.astype("float64") ** 2).sum()) for prm in params
                                       if prm.grad is not None))))
        opt.step()
        opt.clear_grad()
        losses.append(float(loss.numpy()))
    rc.check_finite("losses", np.asarray(losses))
    timer.lap("train")

    trained_dir = out / "trained_ckpt"  # save_pretrained gives the checkpoint's own names and layout
    model.save_pretrained(str(trained_dir))
    trained: dict[str, np.ndarray] = {}
    for f in sorted(trained_dir.glob("*.safetensors")):
        trained.update(load_file(str(f)))
    shutil.rmtree(trained_dir)
    for k, v in trained.items():
        rc.check_finite(k, v)
    np.savez(out / "trained.npz", **trained)
    call = ("model(input_ids=x[:, :-1], labels=y[:, 1:]).loss; backward; paddle.optimizer.AdamW("
            "grad_clip=ClipGradByGlobalNorm).step; clear_grad")
    (out / "losses.json").write_text(json.dumps({"losses": losses, "grad_norms": norms, "call": call}))
    timer.lap("save_trained")
    meta: dict[str, Any] = {
        "library": {"paddle": paddle.__version__, "paddleformers": paddleformers.__version__},
        "params": p, "optim": o, "steps": len(batches),
        "not_decayed": undecayed,
        "trainable": sorted(n for n, prm in model.named_parameters() if not prm.stop_gradient),
        "trained_keys": {k: [list(v.shape), str(v.dtype)] for k, v in sorted(trained.items())},
        "config_json": json.loads((out / "ckpt" / "config.json").read_text()),
        "timing_s": timer.laps,
    }
    rc.write_meta(out, meta)


if __name__ == "__main__":
    main()
