"""Reference: a random transformers ``Ernie4_5ForCausalLM`` (PyTorch, dense ERNIE 4.5), float32 on CPU.

Runs in the ``hf`` environment (torch 2.13.0 CPU + transformers 5.x). Never
imports ernie_ir.

Usage::

    python hf_ernie_dense.py SPEC OUT_DIR

SPEC (defaults in brackets): hidden_size [64], intermediate_size [96],
num_hidden_layers [2], num_attention_heads [4], num_key_value_heads [2],
head_dim [24], vocab_size [128], tie_word_embeddings [false],
rope_theta [500000.0], rms_norm_eps [1e-5], seed [0], input_ids [seeded 2 x 7],
generate [absent]: ``{"prompts": [[ids], ...], "max_new_tokens": 8}``.
labels_loss [false]: also write ``loss.json``, the library's own ``labels=`` loss of ``input_ids``.

Every parameter is overwritten with seeded numpy values
(``_refcommon.random_param``). Writes into OUT_DIR: ``ckpt/``
(``save_pretrained``, safetensors), ``input_ids.npy``, ``logits.npy``
(float32 [batch, seq, vocab]) and ``meta.json`` (versions, config.json, saved
keys with shapes/dtypes, timings). With ``generate``: ``generated.json``
(``_refcommon.write_generated``): ``generate(do_sample=False, eos_token_id=None)``
of each prompt alone (batch 1, the default DynamicCache), checked by
``_refcommon.check_greedy`` to feed one token per step after the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _refcommon as rc
import numpy as np

DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "vocab_size": 128,
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "seed": 0,
}


def common_config(p: dict[str, Any]) -> dict[str, Any]:
    """Config keywords shared by the dense and MoE transformers classes."""
    return {
        "vocab_size": p["vocab_size"],
        "hidden_size": p["hidden_size"],
        "intermediate_size": p["intermediate_size"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": p["num_attention_heads"],
        "num_key_value_heads": p["num_key_value_heads"],
        "head_dim": p["head_dim"],
        "tie_word_embeddings": p["tie_word_embeddings"],
        "rope_parameters": {"rope_type": "default", "rope_theta": float(p["rope_theta"])},
        "rms_norm_eps": p["rms_norm_eps"],
        "max_position_embeddings": 4096,
        "use_bias": False,
    }


def run(
    model_cls: Any,
    config: Any,
    p: dict[str, Any],
    spec: dict[str, Any],
    out: Path,
    special_init: Callable[[str, tuple[int, ...], np.random.Generator], np.ndarray | None] | None = None,
    timer: rc.Timer | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Build, randomise, run and save ``model_cls(config)``; return (model, meta).

    ``special_init(name, shape, rng)`` may return a value for a parameter (None:
    use ``random_param``).
    """
    import torch
    import transformers
    from safetensors.numpy import load_file

    timer = timer or rc.Timer()
    torch.manual_seed(p["seed"])
    model = model_cls(config).to(torch.float32).eval()
    rng = np.random.default_rng(p["seed"])
    with torch.no_grad():
        for name, prm in sorted(model.named_parameters()):  # tied weights appear once
            shape = tuple(prm.shape)
            value = special_init(name, shape, rng) if special_init else None
            if value is None:
                value = rc.random_param(rng, name, shape)
            prm.copy_(torch.from_numpy(value))
    timer.lap("build")

    ids = rc.token_ids(spec, p["vocab_size"], p["seed"])
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(ids)).logits.float().numpy()
    rc.check_finite("logits", logits)
    np.save(out / "input_ids.npy", ids)
    np.save(out / "logits.npy", logits)
    if spec.get("labels_loss"):  # transformers shifts the labels itself
        with torch.no_grad():
            loss = model(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(ids)).loss
        call = "model(input_ids=x, labels=x)"
        (out / "loss.json").write_text(json.dumps({"loss": float(loss), "call": call}))
    timer.lap("forward")

    model.save_pretrained(str(out / "ckpt"))
    timer.lap("save")
    saved: dict[str, np.ndarray] = {}
    for f in sorted((out / "ckpt").glob("*.safetensors")):
        saved.update(load_file(str(f)))
    meta = {
        "library": {"torch": torch.__version__, "transformers": transformers.__version__},
        "params": p,
        "input_shape": list(ids.shape),
        "logits_shape": list(logits.shape),
        "memory_keys": {k: [list(v.shape), str(v.dtype)] for k, v in model.state_dict().items()},
        "saved_keys": {k: [list(v.shape), str(v.dtype)] for k, v in sorted(saved.items())},
        "saved_files": sorted(x.name for x in (out / "ckpt").iterdir()),
        "config_json": json.loads((out / "ckpt" / "config.json").read_text()),
        "timing_s": timer.laps,
    }
    return model, meta


def generate(
    model: Any, g: dict[str, Any], extra_hooks: Callable[[rc.StepLog], list[Any]] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Greedy generation of each prompt alone (batch 1, KV cache, no EOS); (records, how).

    ``extra_hooks(log)`` may register more hooks (MoE routers) and return their handles.
    """
    import torch

    log = rc.StepLog()

    def pre(_module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # 5.24 passes `cache=`
        pos = kwargs.get("position_ids")
        if pos is None and kwargs.get("cache_position") is not None:
            pos = kwargs["cache_position"][None]
        log.start(ids.shape[1], cache.get_seq_length() if cache is not None else 0,
                  None if pos is None else pos[0].tolist())

    def post(_module: Any, _args: tuple, _kwargs: dict[str, Any], out: Any) -> None:
        log.finish(out.logits[0, -1].float().numpy())

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
               model.register_forward_hook(post, with_kwargs=True)]
    handles += extra_hooks(log) if extra_hooks else []
    records = []
    for prompt in g["prompts"]:
        log.steps.clear()
        ids = torch.tensor([prompt], dtype=torch.int64)
        with torch.no_grad():
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=g["max_new_tokens"], eos_token_id=None, use_cache=True)
        records.append(rc.check_greedy(prompt, seq[0, len(prompt):].tolist(), log, g["max_new_tokens"]))
    for h in handles:
        h.remove()
    how = {"call": "generate(do_sample=False, eos_token_id=None, use_cache=True, attention_mask=ones)",
           "batch": 1}
    return records, how


def write_generation(model: Any, spec: dict[str, Any], p: dict[str, Any], out: Path, meta: dict[str, Any],
                     extra_hooks: Callable[[rc.StepLog], list[Any]] | None = None) -> None:
    """With the spec's ``generate``: run it and write ``generated.json``."""
    ids = np.load(out / "input_ids.npy")
    g = rc.generate_spec(spec, ids, p["vocab_size"])
    if g is None:
        return
    t = rc.Timer()
    records, how = generate(model, g, extra_hooks)
    lib = meta["library"]
    library = f"transformers {lib['transformers']} torch {lib['torch']}"
    rc.write_generated(out, records, {**how, "library": library})
    t.lap("generate")
    meta["timing_s"].update(t.laps)


def main() -> None:
    rc.quiet_env()
    spec, out = rc.parse_args()
    p = {**DEFAULTS, **{k: v for k, v in spec.items() if k in DEFAULTS}}
    timer = rc.Timer()
    from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    timer.lap("import")
    config = Ernie4_5Config(**common_config(p))
    model, meta = run(Ernie4_5ForCausalLM, config, p, spec, out, timer=timer)
    write_generation(model, spec, p, out, meta)
    rc.write_meta(out, meta)


if __name__ == "__main__":
    main()
