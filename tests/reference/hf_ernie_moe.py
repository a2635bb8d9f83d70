"""Reference: a random transformers ``Ernie4_5_MoeForCausalLM`` (PyTorch), float32 on CPU.

Runs in the ``hf`` environment. Never imports ernie_ir.

Usage::

    python hf_ernie_moe.py SPEC OUT_DIR

SPEC (defaults in brackets): hidden_size [64], intermediate_size [128],
moe_intermediate_size [32], num_hidden_layers [3], num_attention_heads [4],
num_key_value_heads [2], head_dim [16], vocab_size [128], moe_num_experts [8],
moe_k [2], moe_num_shared_experts [1], moe_layer_start_index [1],
moe_layer_end_index [-1], moe_layer_interval [1], tie_word_embeddings [false],
rope_theta [500000.0], rms_norm_eps [1e-5], seed [0], bias_scale [0.1],
input_ids [seeded 2 x 7], generate [absent] (as in ``hf_ernie_dense.py``).

All parameters are seeded numpy values; ``e_score_correction_bias`` is
``bias_scale * N(0, 1)`` (non-zero, so it changes which experts are chosen).
Writes into OUT_DIR: ``ckpt/`` (``save_pretrained``, safetensors),
``input_ids.npy``, ``logits.npy`` (float32), ``nobias_logits.npy`` (same model
with the correction bias zeroed) and ``meta.json`` (versions, config.json,
MoE layer indices, saved keys with shapes/dtypes, timings). With ``generate``:
``generated.json`` as ``hf_ernie_dense.py`` writes it (with the correction bias in
place), plus per step ``route_gap``: the smallest gap, over every MoE layer and
token of that forward call, between the k-th and (k+1)-th biased routing score
(softmax + e_score_correction_bias), i.e. how close top-k routing came to a tie.
"""

from __future__ import annotations

from typing import Any

import _refcommon as rc
import numpy as np
from hf_ernie_dense import common_config, run, write_generation

DEFAULTS: dict[str, Any] = {
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
    "bias_scale": 0.1,
}


def main() -> None:
    rc.quiet_env()
    spec, out = rc.parse_args()
    p = {**DEFAULTS, **{k: v for k, v in spec.items() if k in DEFAULTS}}
    timer = rc.Timer()
    import torch
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    timer.lap("import")
    config = Ernie4_5_MoeConfig(
        **common_config(p),
        moe_intermediate_size=p["moe_intermediate_size"],
        moe_num_experts=p["moe_num_experts"],
        moe_k=p["moe_k"],
        moe_num_shared_experts=p["moe_num_shared_experts"],
        moe_layer_start_index=p["moe_layer_start_index"],
        moe_layer_end_index=p["moe_layer_end_index"],
        moe_layer_interval=p["moe_layer_interval"],
    )

    def bias_init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray | None:
        if name.endswith("e_score_correction_bias"):
            return (p["bias_scale"] * rng.standard_normal(shape)).astype(np.float32)
        return None

    model, meta = run(Ernie4_5_MoeForCausalLM, config, p, spec, out, special_init=bias_init, timer=timer)

    def router_hooks(log: rc.StepLog) -> list[Any]:
        """Record how close each router's top-k choice came to a tie (its scores as the router ranks them)."""

        def hook(router: Any, _args: tuple, out: tuple) -> None:
            probs = torch.softmax(out[0].float(), dim=-1)
            scores = router.moe_statics(probs)  # + e_score_correction_bias
            log.route_gap(rc.topk_gap(scores.detach().numpy(), router.top_k))

        return [layer.mlp.gate.register_forward_hook(hook)
                for layer in model.model.layers if hasattr(layer.mlp, "experts")]

    write_generation(model, spec, p, out, meta, router_hooks)

    ids = torch.from_numpy(np.load(out / "input_ids.npy"))
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                prm.zero_()
        nobias = model(input_ids=ids).logits.float().numpy()
    np.save(out / "nobias_logits.npy", nobias)
    logits = np.load(out / "logits.npy")
    meta["bias_effect_max_abs"] = float(np.abs(logits - nobias).max())
    meta["moe_layers"] = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    rc.write_meta(out, meta)


if __name__ == "__main__":
    main()
