"""Reference: transformers' ``AutoModelForCausalLM.from_pretrained`` of a checkpoint folder
(ERNIE 4.5 dense or MoE, the -PT layout: what ``ernie-ir export --layout pt`` writes), and its
logits on CPU.

Runs in the ``hf`` environment (torch + transformers). Never imports ernie_ir.

Usage::

    python hf_load_export.py SPEC OUT_DIR

SPEC: ``load_from`` [required]: the folder; ``input_ids`` [seeded random 2 x 7]; ``seed`` [0].

The load is the plain call, ``AutoModelForCausalLM.from_pretrained(dir)`` (transformers picks
the class from config.json's ``model_type`` and the dtype from its ``torch_dtype``/``dtype``:
``loaded_dtype`` in meta.json). The model is then widened to float32 (``model.float()``: exact
for bf16) and run in float32 (``logits.npy``), so the comparison with ernie-ir measures the
weights, not bf16 arithmetic. Every tensor must have been loaded from the file: the float model's
``save_pretrained`` (transformers reverses its own conversion, e.g. MoE experts back to one key
per expert) must give back exactly the file's keys and values (widened to float32), else exit 1
naming the first difference; a key transformers dropped or re-initialised cannot pass.

Writes: ``input_ids.npy``, ``logits.npy`` (float32 [batch, seq, vocab]), ``meta.json``
(versions, ``class``, ``loaded_dtype``, ``load_call``, ``file_keys`` with stored dtypes,
``state_equal_file``, timings).
"""

from __future__ import annotations

from pathlib import Path

import _refcommon as rc
import numpy as np
from _st_f32 import check_resaved, read_folder_f32


def main() -> None:
    rc.quiet_env()
    spec, out = rc.parse_args()
    folder = Path(spec["load_from"])
    timer = rc.Timer()
    import torch
    import transformers

    timer.lap("import")
    torch.manual_seed(int(spec.get("seed", 0)))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    loaded_dtype = str(model.dtype)
    model = model.float()
    timer.lap("load")
    files, stored = read_folder_f32(folder)
    check_resaved(model, folder, files, out, "transformers")
    timer.lap("state check")
    ids = rc.token_ids(spec, model.config.vocab_size, int(spec.get("seed", 0)))
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(ids)).logits.float().numpy()
    rc.check_finite("logits", logits)
    np.save(out / "input_ids.npy", ids)
    np.save(out / "logits.npy", logits)
    timer.lap("forward")
    rc.write_meta(out, {
        "library": {"torch": torch.__version__, "transformers": transformers.__version__},
        "loaded_from": str(folder), "class": type(model).__name__, "loaded_dtype": loaded_dtype,
        "load_call": "AutoModelForCausalLM.from_pretrained(dir), then .float() for the forward",
        "file_keys": {k: [list(v.shape), stored[k]] for k, v in sorted(files.items())},
        "state_equal_file": True, "logits_shape": list(logits.shape), "timing_s": timer.laps})


if __name__ == "__main__":
    main()
