"""Reference side of benchmarks/train_throughput.py: paddleformers `LoRAModel` + AdamW steps, or
(SPEC "full": true) full-parameter AdamW steps.

Runs inside the `pf` reference environment ($ERNIE_IR_REFENVS/pf, tests/reference/README.md) as a
subprocess of benchmarks/train_throughput.py, and never imports ernie_ir:

    pf/bin/python benchmarks/_train_ref.py CHECKPOINT_FOLDER BATCHES.npz SPEC_JSON OUT_JSON

- the model: paddleformers `Ernie4_5ForCausalLM.from_pretrained(folder, config=cfg,
  dtype="float32")` of the transformers-layout float32 folder (`cfg.fuse_rms_norm = False`: the
  fused kernel is GPU-only), in train mode;
- the adapters: `LoRAModel(model, LoRAConfig(target_modules=..., r=..., lora_alpha=...,
  dtype="float32"))`, ERNIEKit's four target patterns; paddleformers freezes the base;
- full-parameter ("full": true): no adapters; every param of the model trains (paddleformers
  leaves them all trainable; a tied embedding is one param), as ERNIEKit's `fine_tuning: Full`;
- the optimizer: `paddle.optimizer.AdamW(learning_rate, parameters=the trainable ones, beta1,
  beta2, epsilon, weight_decay, grad_clip=ClipGradByGlobalNorm(clip))` (ours: the same call);
  with weight decay, `apply_decay_param_fun` skips the params whose structured name holds "bias"
  or "norm" (PaddleNLP's Trainer; ernie-ir's NO_DECAY);
- the loss: the mean cross-entropy of logits[:, :-1] against labels[:, 1:] over the labels that
  are not -100 (what ernie-ir's training loop computes), `backward`, `step`, `clear_grad`.

SPEC: {"steps", "threads", "full", "r", "lora_alpha", "targets", "lr", "beta1", "beta2", "eps",
"weight_decay", "clip"}. BATCHES.npz holds ids0, labels0, ids1, labels1, ... (cycled). OUT_JSON:
{"step_s": [wall seconds of each step], "losses": [...], "versions": {...}, "load_s": ...}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    folder, batches_path, spec_text, out_path = sys.argv[1:5]
    spec = json.loads(spec_text)
    import numpy as np
    import paddle
    import paddleformers
    from paddleformers.peft import LoRAConfig, LoRAModel
    from paddleformers.transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    t0 = time.perf_counter()
    paddle.set_device("cpu")
    paddle.base.core.set_num_threads(int(spec["threads"]))
    paddle.seed(0)
    cfg = Ernie4_5Config.from_pretrained(folder)
    cfg.fuse_rms_norm = False
    model = Ernie4_5ForCausalLM.from_pretrained(folder, config=cfg, dtype="float32")
    if spec.get("full"):
        lora = model
    else:
        lora = LoRAModel(model, LoRAConfig(target_modules=list(spec["targets"]), r=int(spec["r"]),
                                           lora_alpha=spec["lora_alpha"], dtype="float32"))
    lora.train()
    named = [(n, p) for n, p in lora.named_parameters() if not p.stop_gradient]
    params = [p for _, p in named]
    decayed = {p.name for n, p in named if not any(s in n for s in ("bias", "norm"))}
    opt = paddle.optimizer.AdamW(
        learning_rate=float(spec["lr"]), parameters=params, beta1=spec["beta1"], beta2=spec["beta2"],
        epsilon=spec["eps"], weight_decay=spec["weight_decay"],
        apply_decay_param_fun=decayed.__contains__ if spec["weight_decay"] else None,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(spec["clip"]) if spec["clip"] else None)
    data = np.load(batches_path)
    batches = [(data[f"ids{i}"], data[f"labels{i}"]) for i in range(len(data.files) // 2)]
    load_s = time.perf_counter() - t0

    step_s: list[float] = []
    losses: list[float] = []
    for step in range(int(spec["steps"])):
        ids, labels = batches[step % len(batches)]
        t = time.perf_counter()
        logits = lora(input_ids=paddle.to_tensor(ids)).logits
        v = logits.shape[-1]
        target = labels[:, 1:].reshape(-1)
        keep = target != -100
        per_token = paddle.nn.functional.cross_entropy(
            logits[:, :-1].reshape([-1, v]), paddle.to_tensor(np.where(keep, target, 0)), reduction="none")
        mask = paddle.to_tensor(keep.astype(np.float32))
        loss = paddle.sum(per_token.reshape([-1]) * mask) / int(keep.sum())
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss.numpy()))
        step_s.append(time.perf_counter() - t)
    Path(out_path).write_text(json.dumps({
        "step_s": step_s, "losses": losses, "load_s": load_s, "trainable": int(sum(p.size for p in params)),
        "decayed": len(decayed), "undecayed": len(params) - len(decayed),
        "versions": {"paddle": paddle.__version__, "paddleformers": paddleformers.__version__}}))


if __name__ == "__main__":
    main()
