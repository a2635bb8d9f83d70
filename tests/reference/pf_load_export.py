"""Reference: paddleformers' ``AutoModelForCausalLM.from_pretrained`` of a checkpoint folder (ERNIE
4.5 dense or MoE, as ``ernie-ir export`` writes it: the published Paddle layout or, with
``--layout pt``, the -PT one), float32 on CPU, and its logits.

Runs in the ``pf`` environment (paddlepaddle 3.3.1 + paddleformers 1.2.x). Never imports ernie_ir.

Usage::

    python pf_load_export.py SPEC OUT_DIR

SPEC: ``load_from`` [required]: the folder (copied into ``OUT_DIR/loaded_ckpt`` first:
``from_pretrained`` writes ``flex-ckpt.auto_generated.metadata`` into the folder it reads);
``input_ids`` [seeded random 2 x 7]; ``seed`` [0]; ``forward`` [true]: also run the model.

Config: ``AutoConfig.from_pretrained(dir)`` with ``fuse_rms_norm = False`` (its default True
needs the GPU-only ``fused_rms_norm_ext`` kernel). Loading:

- -PT layout (``model.`` keys, split q/k/v and gate/up, [out, in]): the plain
  ``AutoModelForCausalLM.from_pretrained(dir, config=cfg, dtype="float32")`` (paddleformers'
  default flex_checkpoint loader converts that layout). Checked: the model's own
  ``save_pretrained`` (the same layout) gives back exactly the file's keys and values (widened
  to float32), else exit 1 naming the first difference.
- Published Paddle layout (``ernie.`` keys, fused, [in, out]): the plain call fails in
  paddleformers 1.2 ("model.embed_tokens.weight should be assigned before!": its flex_checkpoint
  rules read the HF layout only; recorded as ``plain_call_error``), so the folder is loaded with
  its name-matching loader, ``from_pretrained(dir, config=cfg, dtype="float32",
  load_checkpoint_format="safetensors", convert_from_hf=False, key_mapping={"^ernie\\.": ""})``,
  as pf_ernie_dense.py's ``load_from`` does and with its limits (``num_key_value_heads`` 1 or =
  heads, tied head; others exit 1). Checked: every model tensor equals the file's.

``forward``: the logits of ``input_ids`` (float32). paddleformers 1.2's MoE cannot run on a CPU
(``expand_modality_expert_id`` has no CPU kernel): pass ``forward: false`` for MoE folders.

Writes: ``input_ids.npy``; with ``forward`` ``logits.npy``; ``meta.json`` (versions, ``class``,
``layout``, ``load_call``, ``plain_call_error``, ``file_keys``, ``state_equal_file``, timings).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import _refcommon as rc
import numpy as np
from _st_f32 import check_resaved, read_folder_f32


def check_paddle_state(model: Any, files: dict[str, np.ndarray], cfg: Any, folder: Path) -> None:
    state = {k: v.numpy().astype(np.float32) for k, v in model.state_dict().items()}
    wanted = {"model." + k[len("ernie."):] if k.startswith("ernie.") else k: v for k, v in files.items()}
    if cfg.tie_word_embeddings:
        wanted["lm_head.weight"] = wanted["model.embed_tokens.weight"]
    if set(state) != set(wanted):
        raise SystemExit(f"{folder}: the model's tensors {sorted(set(state) ^ set(wanted))[:4]} have no file "
                         "tensor (or the other way round)")
    for k, v in sorted(wanted.items()):
        if state[k].shape != v.shape or not np.array_equal(state[k], v):
            raise SystemExit(f"{folder}: after loading, {k} differs from the file's tensor")


def main() -> None:
    rc.quiet_env()
    spec, out = rc.parse_args()
    folder = Path(spec["load_from"])
    timer = rc.Timer()
    import paddle
    import paddleformers
    from paddleformers.transformers import AutoConfig, AutoModelForCausalLM

    timer.lap("import")
    paddle.set_device("cpu")
    paddle.seed(int(spec.get("seed", 0)))
    ckpt = out / "loaded_ckpt"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    shutil.copytree(folder, ckpt)
    files, stored = read_folder_f32(ckpt)
    cfg = AutoConfig.from_pretrained(str(ckpt))
    cfg.fuse_rms_norm = False  # the fused kernel is GPU-only
    paddle_layout = any(k.startswith("ernie.") for k in files)
    plain_error = None
    if paddle_layout:
        try:
            AutoModelForCausalLM.from_pretrained(str(ckpt), config=cfg, dtype="float32")
        except Exception as e:  # recorded: paddleformers 1.2 reads the HF layout only
            plain_error = f"{type(e).__name__}: {e}"[:300]
        else:
            raise SystemExit(f"{folder}: the plain call loaded a Paddle-layout folder: this script's facts "
                             "are out of date")
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
        if nkv not in (1, nh) or "lm_head.weight" in files:
            raise SystemExit(f"{folder}: Paddle layout with {nkv} of {nh} kv heads or an untied head: "
                             "paddleformers' name-only loader cannot load it")
        how = ("AutoModelForCausalLM.from_pretrained(dir, config=cfg(fuse_rms_norm=False), dtype='float32', "
               "load_checkpoint_format='safetensors', convert_from_hf=False, key_mapping={'^ernie\\.': ''})")
        shutil.rmtree(ckpt)
        shutil.copytree(folder, ckpt)
        model = AutoModelForCausalLM.from_pretrained(str(ckpt), config=cfg, dtype="float32",
                                                     load_checkpoint_format="safetensors",
                                                     convert_from_hf=False, key_mapping={"^ernie\\.": ""})
        timer.lap("load")
        check_paddle_state(model, files, cfg, folder)
    else:
        how = "AutoModelForCausalLM.from_pretrained(dir, config=cfg(fuse_rms_norm=False), dtype='float32')"
        model = AutoModelForCausalLM.from_pretrained(str(ckpt), config=cfg, dtype="float32")
        timer.lap("load")
        check_resaved(model, folder, files, out, "paddleformers")
    timer.lap("state check")
    model.eval()
    ids = rc.token_ids(spec, cfg.vocab_size, int(spec.get("seed", 0)))
    np.save(out / "input_ids.npy", ids)
    shape = None
    if spec.get("forward", True):
        with paddle.no_grad():
            logits = model(paddle.to_tensor(ids)).logits.astype("float32").numpy()
        rc.check_finite("logits", logits)
        np.save(out / "logits.npy", logits)
        shape = list(logits.shape)
        timer.lap("forward")
    shutil.rmtree(ckpt)
    rc.write_meta(out, {
        "library": {"paddle": paddle.__version__, "paddleformers": paddleformers.__version__},
        "loaded_from": str(folder), "class": type(model).__name__,
        "layout": "paddle" if paddle_layout else "pt", "load_call": how, "plain_call_error": plain_error,
        "file_keys": {k: [list(v.shape), stored[k]] for k, v in sorted(files.items())},
        "state_equal_file": True, "logits_shape": shape, "timing_s": timer.laps})


if __name__ == "__main__":
    main()
