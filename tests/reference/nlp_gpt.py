"""Reference: a random PaddleNLP ``GPTForCausalLM`` (GPT-3 family), float32 on CPU.

Runs in the ``nlp`` environment (paddlepaddle 3.3.1 + paddlenlp 3.0.0b4).
Never imports ernie_ir.

Usage::

    python nlp_gpt.py SPEC OUT_DIR

SPEC (defaults in brackets): vocab_size [128], hidden_size [64],
num_hidden_layers [2], num_attention_heads [4], intermediate_size [256],
max_position_embeddings [64], fuse_attention_qkv [false], seed [0],
input_ids [seeded 2 x 7], generate [absent]:
``{"prompts": [[ids], ...], "max_new_tokens": 8}``.

Every parameter is overwritten with seeded numpy values
(``_refcommon.random_param``; LayerNorm weights 1 + 0.1 N, biases 0.1 N).
Dropout is 0 and the model is in eval mode.

Writes into OUT_DIR: ``ckpt/`` (``save_pretrained``: model_state.pdparams +
config.json + generation_config.json), ``ckpt_safetensors/``
(``save_pretrained(safe_serialization=True)``), ``input_ids.npy``,
``logits.npy`` (float32 [batch, seq, vocab]) and ``meta.json`` (versions,
config.json, the pickle's keys with Python types, shapes and dtypes, timings).
With ``generate``: ``generated.json`` (``_refcommon.write_generated``): greedy
``generate`` of each prompt alone (batch 1, its own tuple KV cache, default
positions), EOS disabled (``eos_token_id=-1``), checked by
``_refcommon.check_greedy`` to feed one token per step after the prompt.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import _refcommon as rc
import numpy as np

DEFAULTS: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "max_position_embeddings": 64,
    "fuse_attention_qkv": False,
    "seed": 0,
}


def describe(value: Any) -> list[Any]:
    """[python type, shape, dtype] of a pickled entry (shape/dtype None if not an array)."""
    if isinstance(value, np.ndarray):
        return [type(value).__name__, list(value.shape), str(value.dtype)]
    return [type(value).__name__, None, None]


def generate(model: Any, g: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Greedy generation of each prompt alone (batch 1, KV cache, no EOS); (records, how)."""
    import paddle

    log = rc.StepLog()

    def pre(_layer: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        cache = kwargs.get("past_key_values")  # per layer (k, v), [batch, seq, heads, head_dim]
        cache_len = cache[0][0].shape[1] if cache is not None and cache[0] is not None else 0
        pos = kwargs.get("position_ids")
        log.start(ids.shape[1], cache_len, None if pos is None else pos.numpy()[0].tolist())

    def post(_layer: Any, _args: tuple, _kwargs: dict[str, Any], out: Any) -> None:
        logits = out if isinstance(out, paddle.Tensor) else out[0]
        log.finish(logits[0, -1].astype("float32").numpy())

    hooks = [model.register_forward_pre_hook(pre, with_kwargs=True),
             model.register_forward_post_hook(post, with_kwargs=True)]
    records = []
    for prompt in g["prompts"]:
        log.steps.clear()
        with paddle.no_grad():
            new, _ = model.generate(
                input_ids=paddle.to_tensor([prompt], dtype="int64"),
                decode_strategy="greedy_search",
                max_new_tokens=g["max_new_tokens"],
                eos_token_id=-1,  # None falls back to config.eos_token_id (7)
                use_cache=True,
            )
        records.append(rc.check_greedy(prompt, new.numpy()[0].tolist(), log, g["max_new_tokens"]))
    for h in hooks:
        h.remove()
    return records, {"call": "generate(decode_strategy='greedy_search', eos_token_id=-1, use_cache=True)",
                     "batch": 1}


def main() -> None:
    rc.quiet_env()
    spec, out = rc.parse_args()
    p = {**DEFAULTS, **{k: v for k, v in spec.items() if k in DEFAULTS}}
    timer = rc.Timer()

    import paddle
    import paddlenlp
    from paddlenlp.transformers import GPTConfig, GPTForCausalLM
    from safetensors.numpy import load_file

    timer.lap("import")
    paddle.set_device("cpu")
    paddle.seed(p["seed"])
    cfg = GPTConfig(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden_size"],
        num_hidden_layers=p["num_hidden_layers"],
        num_attention_heads=p["num_attention_heads"],
        intermediate_size=p["intermediate_size"],
        max_position_embeddings=p["max_position_embeddings"],
        seq_length=p["max_position_embeddings"],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        fuse_attention_qkv=bool(p["fuse_attention_qkv"]),
    )
    model = GPTForCausalLM(cfg)
    model.eval()
    rng = np.random.default_rng(p["seed"])
    state = model.state_dict()
    for name in sorted(state):
        state[name].set_value(rc.random_param(rng, name, tuple(state[name].shape)))
    timer.lap("build")

    ids = rc.token_ids(spec, p["vocab_size"], p["seed"])
    with paddle.no_grad():
        out_t = model(paddle.to_tensor(ids))
    logits_t = out_t if isinstance(out_t, paddle.Tensor) else out_t[0]
    logits = logits_t.astype("float32").numpy()
    rc.check_finite("logits", logits)
    np.save(out / "input_ids.npy", ids)
    np.save(out / "logits.npy", logits)
    timer.lap("forward")

    model.save_pretrained(str(out / "ckpt"))
    model.save_pretrained(str(out / "ckpt_safetensors"), safe_serialization=True)
    timer.lap("save")

    g = rc.generate_spec(spec, ids, p["vocab_size"])
    if g is not None:
        records, how = generate(model, g)
        rc.write_generated(out, records, {**how, "library": f"paddlenlp {paddlenlp.__version__}"})
        timer.lap("generate")

    with open(out / "ckpt" / "model_state.pdparams", "rb") as f:
        pickled = pickle.load(f)
    st: dict[str, np.ndarray] = {}
    for f in sorted((out / "ckpt_safetensors").glob("*.safetensors")):
        st.update(load_file(str(f)))
    same = all(np.array_equal(st[k], pickled[k]) for k in st if k in pickled)
    rc.write_meta(
        out,
        {
            "library": {"paddle": paddle.__version__, "paddlenlp": paddlenlp.__version__},
            "params": p,
            "input_shape": list(ids.shape),
            "logits_shape": list(logits.shape),
            "pdparams_entries": {k: describe(v) for k, v in pickled.items()},
            "safetensors_keys": {k: [list(v.shape), str(v.dtype)] for k, v in sorted(st.items())},
            "safetensors_equal_pdparams": bool(same and set(st) <= set(pickled)),
            "saved_files": sorted(x.name for x in (out / "ckpt").iterdir()),
            "saved_files_safetensors": sorted(x.name for x in (out / "ckpt_safetensors").iterdir()),
            "config_json": json.loads((out / "ckpt" / "config.json").read_text()),
            "timing_s": timer.laps,
        },
    )


if __name__ == "__main__":
    main()
