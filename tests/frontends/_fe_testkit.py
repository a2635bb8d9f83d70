"""Shared helpers of the frontend tests (imported as a plain module: tests/frontends has no package).

- Reference runs: `run_reference(env, script, spec, out)` runs a script of
  tests/reference with the Python of a reference environment
  ($ERNIE_IR_REFENVS/<env>; unset: /work/refenvs, else ~/.cache/ernie-ir/refenvs).
  Without the environment the test is skipped locally, but fails when
  ERNIE_IR_REFENVS is set (CI installs the environments and sets it, so
  cross-checks never skip there).
- Checkpoint writers: `write_checkpoint` writes config.json + safetensors
  (single or sharded with an index); `hf_to_paddle` converts HF-layout
  ERNIE 4.5 tensors into the published Paddle layout, written here from
  REFERENCE.md 1.2 independently of the frontend's reader.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ernie_ir.ir.weights import SafetensorsFile, write_safetensors

REPO = Path(__file__).resolve().parents[2]
REFERENCE_DIR = REPO / "tests" / "reference"


def refenvs_root() -> Path:
    """$ERNIE_IR_REFENVS, else /work/refenvs if present, else scripts/test.sh's default."""
    if "ERNIE_IR_REFENVS" in os.environ:
        return Path(os.environ["ERNIE_IR_REFENVS"])
    local = Path("/work/refenvs")
    return local if local.is_dir() else Path.home() / ".cache" / "ernie-ir" / "refenvs"


def ref_python(env: str) -> Path:
    """The Python of reference environment `env`; skip (locally) or fail (CI) if absent."""
    py = refenvs_root() / env / "bin" / "python"
    if py.is_file():
        return py
    why = (f"reference environment {env!r} not found at {py.parent.parent} "
           "(install it with tests/reference/install_envs.sh)")
    if "ERNIE_IR_REFENVS" in os.environ:
        pytest.fail(why + "; ERNIE_IR_REFENVS is set, so cross-checks must run")
    pytest.skip(why)


def run_reference(env: str, script: str, spec: Mapping[str, Any], out: Path, timeout: int = 600) -> Path:
    """Run tests/reference/<script> SPEC OUT in environment `env`; returns OUT."""
    py = ref_python(env)
    path = REFERENCE_DIR / script
    if not path.is_file():
        pytest.fail(f"reference script {path} is missing")
    proc = subprocess.run(
        [str(py), str(path), json.dumps(dict(spec)), str(out)],
        cwd=REFERENCE_DIR, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REFERENCE_DIR)},
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-3000:]
        pytest.fail(f"{script} {json.dumps(dict(spec))} failed ({proc.returncode}):\n{tail}")
    return out


def errors(out: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max abs error, max abs error / max |ref|)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    diff = float(np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64))))
    return diff, diff / float(np.max(np.abs(ref)))


def report(label: str, out: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """Print and return the errors (shown with `pytest -s`; kept for the cross-check table)."""
    abs_err, rel_err = errors(out, ref)
    top1 = float(np.mean(out.argmax(-1) == ref.argmax(-1)))
    print(f"\n[cross-check] {label}: max abs {abs_err:.3g}, rel {rel_err:.3g}, top-1 agreement {top1:.3f}")
    return abs_err, rel_err


# -- checkpoints ------------------------------------------------------------------------------------


def read_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors files in `folder` (in memory, as stored)."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        st = SafetensorsFile(f)
        out.update({k: np.array(st.read(k)) for k in st.entries})
    return out


def write_checkpoint(folder: Path, config: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                     *, shards: int = 1) -> Path:
    """config.json + model.safetensors, or `shards` files with model.safetensors.index.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(config), indent=1))
    keys = list(tensors)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", [(k, tensors[k]) for k in keys])
        return folder
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        write_safetensors(folder / name, [(k, tensors[k]) for k in part])
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=1))
    return folder


def hf_to_paddle(hf: Mapping[str, np.ndarray], cfg: Mapping[str, Any],
                 prefix: str = "ernie.") -> dict[str, np.ndarray]:
    """ERNIE 4.5 tensors from the HF layout ([out, in], split) to the published Paddle layout.

    Paddle layout (REFERENCE 1.2): [in, out]; qkv_proj fused [all q | all k | all v]
    for GQA, per head [q0 k0 v0 | q1 ...] for MHA; up_gate_proj = [gate | up];
    router gate.weight [H, E]; experts per expert `experts.{e}.up_gate_proj` [H, 2I];
    lm_head [H, V] (absent when tied); prefix `ernie.` (lm_head has none).
    """
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    out: dict[str, np.ndarray] = {}

    def key(k: str) -> str:
        return prefix + k[len("model."):] if k.startswith("model.") else k

    done: set[str] = set()
    for k in hf:
        if k in done:
            continue
        if k.endswith("self_attn.q_proj.weight") or k.endswith("self_attn.q_proj.bias"):
            base, leaf = k.rsplit(".q_proj.", 1)
            q, kk, v = (hf[f"{base}.{n}_proj.{leaf}"] for n in "qkv")
            done.update(f"{base}.{n}_proj.{leaf}" for n in "qkv")
            if nkv == nh:
                qs, ks, vs = (np.split(a, nh, axis=0) for a in (q, kk, v))
                fused = np.concatenate([p for h in range(nh) for p in (qs[h], ks[h], vs[h])], axis=0)
            else:
                fused = np.concatenate([q, kk, v], axis=0)
            out[key(f"{base}.qkv_proj.{leaf}")] = fused.T.copy() if leaf == "weight" else fused
        elif k.endswith("gate_proj.weight") or k.endswith("gate_proj.bias"):
            base, leaf = k.rsplit(".gate_proj.", 1)
            g, u = hf[k], hf[f"{base}.up_proj.{leaf}"]
            done.update({k, f"{base}.up_proj.{leaf}"})
            fused = np.concatenate([g, u], axis=0)
            out[key(f"{base}.up_gate_proj.{leaf}")] = fused.T.copy() if leaf == "weight" else fused
        elif k.endswith((".o_proj.weight", ".down_proj.weight", ".mlp.gate.weight")) or k == "lm_head.weight":
            out[key(k)] = hf[k].T.copy()
        elif k.endswith(".experts.gate_up_proj"):  # transformers' stacked [E, 2I, H], rows [gate | up]
            for e in range(hf[k].shape[0]):
                out[key(f"{k[: -len('gate_up_proj')]}{e}.up_gate_proj.weight")] = hf[k][e].T.copy()
        elif k.endswith(".experts.down_proj"):  # [E, H, I]
            for e in range(hf[k].shape[0]):
                out[key(f"{k[: -len('down_proj')]}{e}.down_proj.weight")] = hf[k][e].T.copy()
        elif k.endswith("moe_statics.e_score_correction_bias"):
            out[key(k.replace(".gate.moe_statics.", ".moe_statics."))] = hf[k]
        elif not re.search(r"\.(k_proj|v_proj|up_proj)\.(weight|bias)$", k):  # consumed with q / gate
            out[key(k)] = hf[k]
    return out


def random_hf_ernie(cfg: Mapping[str, Any], seed: int = 0, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Random ERNIE 4.5 (dense or MoE) tensors in the HF layout, for a config dict."""
    rng = np.random.default_rng(seed)
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hidden, vocab, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    moe = "moe_num_experts" in cfg
    hd = cfg.get("head_dim") or (hidden // nh if moe else 128)
    t: dict[str, np.ndarray] = {}

    def mat(name: str, *shape: int, std: float | None = None) -> None:
        scale = std if std is not None else shape[-1] ** -0.5
        t[name] = (scale * rng.standard_normal(shape)).astype(dtype)
        if cfg.get("use_bias") and name.endswith("_proj.weight"):
            t[name[: -len("weight")] + "bias"] = (0.1 * rng.standard_normal(shape[0])).astype(dtype)

    def norm(name: str) -> None:
        t[name] = (1 + 0.1 * rng.standard_normal(hidden)).astype(dtype)

    def mlp(pre: str, width: int) -> None:
        mat(pre + "gate_proj.weight", width, hidden)
        mat(pre + "up_proj.weight", width, hidden)
        mat(pre + "down_proj.weight", hidden, width)

    mat("model.embed_tokens.weight", vocab, hidden, std=1.0)
    layers = cfg["num_hidden_layers"]
    end = cfg.get("moe_layer_end_index", -1)
    end = layers - 1 if end == -1 else end
    for i in range(layers):
        pre = f"model.layers.{i}."
        norm(pre + "input_layernorm.weight")
        norm(pre + "post_attention_layernorm.weight")
        mat(pre + "self_attn.q_proj.weight", nh * hd, hidden)
        mat(pre + "self_attn.k_proj.weight", nkv * hd, hidden)
        mat(pre + "self_attn.v_proj.weight", nkv * hd, hidden)
        mat(pre + "self_attn.o_proj.weight", hidden, nh * hd)
        is_moe = moe and (i + 1) % cfg.get("moe_layer_interval", 1) == 0 and \
            cfg.get("moe_layer_start_index", 1) <= i <= end
        if not is_moe:
            mlp(pre + "mlp.", inter)
            continue
        experts, ie = cfg["moe_num_experts"], cfg["moe_intermediate_size"]
        t[pre + "mlp.gate.weight"] = rng.standard_normal((experts, hidden)).astype(np.float32)
        t[pre + "mlp.moe_statics.e_score_correction_bias"] = (
            0.05 * rng.standard_normal((1, experts))).astype(np.float32)
        for e in range(experts):
            mlp(f"{pre}mlp.experts.{e}.", ie)
        if cfg.get("moe_num_shared_experts", 2):
            mlp(pre + "mlp.shared_experts.", ie * cfg.get("moe_num_shared_experts", 2))
    norm("model.norm.weight")
    if not cfg.get("tie_word_embeddings", True):
        mat("lm_head.weight", vocab, hidden)
    return t
