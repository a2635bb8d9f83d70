"""Reference: a random paddleformers ``Ernie4_5ForCausalLM`` (dense ERNIE 4.5), float32 on CPU.

Runs in the ``pf`` environment (paddlepaddle 3.3.1 + paddleformers 1.2.x).
Never imports ernie_ir.

Usage::

    python pf_ernie_dense.py SPEC OUT_DIR

SPEC (JSON object or path; defaults in brackets): hidden_size [64],
intermediate_size [96], num_hidden_layers [2], num_attention_heads [4],
num_key_value_heads [2], head_dim [24], vocab_size [128],
tie_word_embeddings [false], rope_theta [500000.0], rms_norm_eps [1e-5],
seed [0], input_ids [seeded random 2 x 7], save_memory_state [true],
generate [absent]: ``{"prompts": [[ids], ...], "max_new_tokens": 8}``.
labels_loss [false]: also write ``loss.json``, the library's own ``labels=`` loss of ``input_ids``.
load_from [absent]: a checkpoint folder to load with ``from_pretrained`` instead of building a
random model (``load_checkpoint``); only ``input_ids``, ``seed``, ``labels_loss`` and
``generate`` then apply, and ``ckpt/`` and ``memory_state.safetensors`` are not written.

Every parameter is overwritten with seeded numpy values (see
``_refcommon.random_param``; RMSNorm weights are 1 + 0.1 N(0,1), not ones) so
the result does not depend on the library's initialiser.

Writes into OUT_DIR:
- ``ckpt/``: ``save_pretrained`` output (HF layout safetensors + index + config.json
  + ``saved_signal_0``);
- ``memory_state.safetensors``: the in-memory Paddle state dict, as is;
- ``input_ids.npy`` (int64) and ``logits.npy`` (float32, [batch, seq, vocab]);
- ``meta.json``: versions, config, key names/shapes of both layouts, the
  observed qkv column order, timings;
- with ``generate``: ``generated.json`` (``_refcommon.write_generated``): greedy
  ``generate`` of each prompt alone (batch 1), KV cache on (a ``DynamicCache``:
  without one paddleformers recomputes the whole sequence every step), explicit
  position ids, an explicit all-ones attention mask, EOS disabled (``eos_token_id=-1``);
  checked by ``_refcommon.check_greedy`` to feed one token per step after the prompt.
"""

from __future__ import annotations

import json
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


def qkv_layout(fused: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, nkv: int) -> str:
    """Name the column order of an [in, out] fused qkv weight, given HF [out, in] q, k, v.

    "per_kv_group": [q heads of group 0 | k_0 | v_0 | q heads of group 1 | ...];
    "plain": [all q | all k | all v]. For MHA per_kv_group means per head.
    """
    qt, kt, vt = q.T, k.T, v.T
    plain = np.array_equal(fused, np.concatenate([qt, kt, vt], axis=1))
    qg, kg, vg = (np.split(a, nkv, axis=1) for a in (qt, kt, vt))
    grouped = np.concatenate([np.concatenate([qg[g], kg[g], vg[g]], axis=1) for g in range(nkv)], axis=1)
    per_group = np.array_equal(fused, grouped)
    if plain and per_group:
        return "plain == per_kv_group (nkv == 1)"
    return "plain" if plain else "per_kv_group" if per_group else "unknown"


def generate(model: Any, g: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Greedy, incremental (DynamicCache) generation of each prompt alone; (records, how)."""
    import paddle
    from paddleformers.transformers.cache_utils import DynamicCache

    log = rc.StepLog()

    def pre(_layer: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        cache = kwargs.get("past_key_values")
        pos = kwargs.get("position_ids")
        log.start(ids.shape[1], cache.get_seq_length() if cache is not None else 0,
                  None if pos is None else pos.numpy()[0].tolist())

    def post(_layer: Any, _args: tuple, _kwargs: dict[str, Any], out: Any) -> None:
        log.finish(out.logits[0, -1].astype("float32").numpy())

    hooks = [model.register_forward_pre_hook(pre, with_kwargs=True),
             model.register_forward_post_hook(post, with_kwargs=True)]
    records = []
    for prompt in g["prompts"]:
        log.steps.clear()
        n = len(prompt)
        with paddle.no_grad():
            new, _ = model.generate(
                input_ids=paddle.to_tensor([prompt], dtype="int64"),
                # an explicit mask: the default one masks every prompt token equal to pad_token_id (0)
                attention_mask=paddle.ones([1, n], dtype="int64"),
                position_ids=paddle.arange(n, dtype="int64").unsqueeze(0),
                past_key_values=DynamicCache(config=model.config),
                use_cache=True,
                decode_strategy="greedy_search",
                max_new_tokens=g["max_new_tokens"],
                eos_token_id=-1,  # None would fall back to config.eos_token_id
            )
        records.append(rc.check_greedy(prompt, new.numpy()[0].tolist(), log, g["max_new_tokens"]))
    for h in hooks:
        h.remove()
    how = {"call": "generate(decode_strategy='greedy_search', past_key_values=DynamicCache(config), "
                   "position_ids=arange, attention_mask=ones, eos_token_id=-1, use_cache=True)",
           "batch": 1}
    return records, how


def load_checkpoint(folder: Path, out: Path) -> tuple[Any, dict[str, Any]]:
    """``Ernie4_5ForCausalLM.from_pretrained`` of (a copy of) ``folder``, float32 on CPU; (model, meta).

    An HF-layout folder (``model.`` keys, q/k/v split, [out, in]: what ``save_pretrained`` writes)
    goes through the default loader (flex_checkpoint, whose conversion rules read that layout).
    The published Paddle layout (``ernie.`` keys, fused, [in, out]) is loaded with paddleformers'
    name-matching loader (``load_checkpoint_format`` other than flex_checkpoint,
    ``convert_from_hf=False``) with ``key_mapping={"^ernie\\.": ""}`` (keys relative to the base
    model). That loader maps names only, so it holds the file's tensors as they are, and the
    published layout equals paddleformers' in-memory one only where REFERENCE.md 1.2 says so:
    qkv is per KV group in memory (equal to plain [Q | K | V] for nkv == 1 or nkv == heads) and
    lm_head is [V, H] in memory ([H, V] in the file): other GQA or untied checkpoints exit 1.
    After loading, every tensor of the model must equal the file's (exit 1 naming the first
    that does not), so a silently re-initialised weight cannot pass.
    """
    import shutil

    from paddleformers.transformers import Ernie4_5Config, Ernie4_5ForCausalLM
    from safetensors.numpy import load_file

    ckpt = out / "loaded_ckpt"  # from_pretrained writes flex-ckpt metadata into the folder it loads
    if ckpt.exists():
        shutil.rmtree(ckpt)
    shutil.copytree(folder, ckpt)
    files: dict[str, np.ndarray] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        files.update(load_file(str(f)))
    cfg = Ernie4_5Config.from_pretrained(str(ckpt))
    cfg.fuse_rms_norm = False  # the fused kernel is GPU-only
    paddle_layout = any(k.startswith("ernie.") for k in files)
    if paddle_layout:
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
        if nkv not in (1, nh):
            raise SystemExit(f"{folder}: Paddle layout with {nkv} of {nh} kv heads: paddleformers holds qkv "
                             "per KV group, the file plain [Q | K | V]; its name-only loader cannot load it")
        if "lm_head.weight" in files:
            raise SystemExit(f"{folder}: untied Paddle layout: lm_head.weight is [H, V] in the file and "
                             "[V, H] in paddleformers' memory; its name-only loader cannot load it")
        how = ("from_pretrained(dir, config=cfg(fuse_rms_norm=False), dtype='float32', "
               "load_checkpoint_format='safetensors', convert_from_hf=False, key_mapping={'^ernie\\.': ''})")
        model = Ernie4_5ForCausalLM.from_pretrained(str(ckpt), config=cfg, dtype="float32",
                                                    load_checkpoint_format="safetensors",
                                                    convert_from_hf=False, key_mapping={"^ernie\\.": ""})
        state = {k: v.numpy() for k, v in model.state_dict().items()}
        wanted = {"model." + k[len("ernie."):] if k.startswith("ernie.") else k: v for k, v in files.items()}
        if cfg.tie_word_embeddings:
            wanted["lm_head.weight"] = wanted["model.embed_tokens.weight"]
        if set(state) != set(wanted):
            raise SystemExit(f"{folder}: the model's tensors {sorted(set(state) ^ set(wanted))[:4]} have no "
                             "file tensor (or the other way round)")
        for k, v in sorted(wanted.items()):
            if state[k].shape != v.shape or not np.array_equal(state[k], v.astype(np.float32)):
                raise SystemExit(f"{folder}: after loading, {k} differs from the file's tensor")
    else:
        how = "from_pretrained(dir, config=cfg(fuse_rms_norm=False), dtype='float32')"
        model = Ernie4_5ForCausalLM.from_pretrained(str(ckpt), config=cfg, dtype="float32")
    model.eval()
    meta = {"loaded_from": str(folder), "layout": "paddle" if paddle_layout else "hf", "load_call": how,
            "file_keys": {k: [list(v.shape), str(v.dtype)] for k, v in sorted(files.items())},
            "state_equal_file": paddle_layout or None}
    return model, meta


def build_model(p: dict[str, Any]) -> Any:
    """paddleformers' dense ERNIE 4.5 of the spec `p` (DEFAULTS' keys), float32, eval mode, every
    param drawn by `rc.random_param` in name order from a generator seeded with `p["seed"]`."""
    from paddleformers.transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    cfg = Ernie4_5Config(
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
    )
    model = Ernie4_5ForCausalLM(cfg)
    model.eval()
    rng = np.random.default_rng(p["seed"])
    state = model.state_dict()
    for name in sorted(state):
        state[name].set_value(rc.random_param(rng, name, tuple(state[name].shape)))
    return model


def main() -> None:
    rc.quiet_env()
    spec, out = rc.parse_args()
    if spec.get("load_from"):
        return main_loaded(spec, out)
    p = {**DEFAULTS, **{k: v for k, v in spec.items() if k in DEFAULTS}}
    timer = rc.Timer()

    import paddle
    import paddleformers
    from safetensors.numpy import load_file, save_file

    timer.lap("import")
    paddle.set_device("cpu")
    paddle.seed(p["seed"])
    model = build_model(p)
    timer.lap("build")

    ids = rc.token_ids(spec, p["vocab_size"], p["seed"])
    with paddle.no_grad():
        logits = model(paddle.to_tensor(ids)).logits.astype("float32").numpy()
    rc.check_finite("logits", logits)
    np.save(out / "input_ids.npy", ids)
    np.save(out / "logits.npy", logits)
    if spec.get("labels_loss"):  # paddleformers does not shift labels (REFERENCE.md 9.4)
        with paddle.no_grad():
            loss = model(input_ids=paddle.to_tensor(ids[:, :-1]), labels=paddle.to_tensor(ids[:, 1:])).loss
        (out / "loss.json").write_text(json.dumps({"loss": float(loss),
                                                   "call": "model(input_ids=x[:, :-1], labels=x[:, 1:])"}))
    timer.lap("forward")

    memory = {k: v.numpy() for k, v in model.state_dict().items()}
    if spec.get("save_memory_state", True):
        save_file(memory, str(out / "memory_state.safetensors"))
    model.save_pretrained(str(out / "ckpt"))
    timer.lap("save")

    g = rc.generate_spec(spec, ids, p["vocab_size"])
    if g is not None:
        records, how = generate(model, g)
        rc.write_generated(out, records, {**how, "library": f"paddleformers {paddleformers.__version__}"})
        timer.lap("generate")

    saved: dict[str, np.ndarray] = {}
    for f in sorted((out / "ckpt").glob("*.safetensors")):
        saved.update(load_file(str(f)))
    a0 = "model.layers.0.self_attn."
    layout = qkv_layout(
        memory[a0 + "qkv_proj.weight"],
        saved[a0 + "q_proj.weight"],
        saved[a0 + "k_proj.weight"],
        saved[a0 + "v_proj.weight"],
        p["num_key_value_heads"],
    )
    m0 = "model.layers.0.mlp."
    up_gate_is_gate_then_up = bool(
        np.array_equal(
            memory[m0 + "up_gate_proj.weight"],
            np.concatenate([saved[m0 + "gate_proj.weight"].T, saved[m0 + "up_proj.weight"].T], axis=1),
        )
    )
    rc.write_meta(
        out,
        {
            "library": {"paddle": paddle.__version__, "paddleformers": paddleformers.__version__},
            "params": p,
            "input_shape": list(ids.shape),
            "logits_shape": list(logits.shape),
            "memory_keys": {k: [list(v.shape), str(v.dtype)] for k, v in memory.items()},
            "saved_keys": {k: [list(v.shape), str(v.dtype)] for k, v in sorted(saved.items())},
            "saved_files": sorted(x.name for x in (out / "ckpt").iterdir()),
            "memory_qkv_layout": layout,
            "memory_up_gate_is_gate_then_up": up_gate_is_gate_then_up,
            "timing_s": timer.laps,
        },
    )


def main_loaded(spec: dict[str, Any], out: Path) -> None:
    """``load_from``: logits (and loss, generation) of a checkpoint folder as paddleformers loads it."""
    timer = rc.Timer()
    import paddle
    import paddleformers

    timer.lap("import")
    paddle.set_device("cpu")
    paddle.seed(int(spec.get("seed", 0)))
    model, meta = load_checkpoint(Path(spec["load_from"]), out)
    timer.lap("load")
    ids = rc.token_ids(spec, model.config.vocab_size, int(spec.get("seed", 0)))
    with paddle.no_grad():
        logits = model(paddle.to_tensor(ids)).logits.astype("float32").numpy()
    rc.check_finite("logits", logits)
    np.save(out / "input_ids.npy", ids)
    np.save(out / "logits.npy", logits)
    if spec.get("labels_loss"):
        with paddle.no_grad():
            loss = model(input_ids=paddle.to_tensor(ids[:, :-1]), labels=paddle.to_tensor(ids[:, 1:])).loss
        (out / "loss.json").write_text(json.dumps({"loss": float(loss),
                                                   "call": "model(input_ids=x[:, :-1], labels=x[:, 1:])"}))
    timer.lap("forward")
    g = rc.generate_spec(spec, ids, model.config.vocab_size)
    if g is not None:
        records, how = generate(model, g)
        rc.write_generated(out, records, {**how, "library": f"paddleformers {paddleformers.__version__}"})
        timer.lap("generate")
    rc.write_meta(out, {"library": {"paddle": paddle.__version__, "paddleformers": paddleformers.__version__},
                        **meta, "input_shape": list(ids.shape), "logits_shape": list(logits.shape),
                        "timing_s": timer.laps})


if __name__ == "__main__":
    main()
