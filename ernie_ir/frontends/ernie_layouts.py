"""The two weight layouts of ERNIE 4.5 checkpoints, detected and mapped to one set of params.

The graph's params are named and shaped as in the published Paddle
checkpoints (REFERENCE 1.2), whatever layout came in:

    ernie.embed_tokens.weight                         [V, H]
    ernie.layers.{i}.input_layernorm.weight           [H]
    ernie.layers.{i}.self_attn.qkv_proj.weight        [H, (nh + 2 nkv) hd]   [q | k | v]
    ernie.layers.{i}.self_attn.o_proj.weight          [nh hd, H]
    ernie.layers.{i}.post_attention_layernorm.weight  [H]
    ernie.layers.{i}.mlp.up_gate_proj.weight          [H, 2 I]               [gate | up]
    ernie.layers.{i}.mlp.down_proj.weight             [I, H]
    ernie.layers.{i}.mlp.gate.weight                  [H, E]                 (MoE router, f32)
    ernie.layers.{i}.mlp.moe_statics.e_score_correction_bias  [1, E]          (f32)
    ernie.layers.{i}.mlp.experts.up_gate_proj.weight  [E, H, 2 Ie]           (experts stacked)
    ernie.layers.{i}.mlp.experts.down_proj.weight     [E, Ie, H]
    ernie.layers.{i}.mlp.shared_experts.{up_gate_proj,down_proj}.weight
    ernie.norm.weight                                 [H]
    lm_head.weight                                    [H, V]                 (untied only)

(`.bias` [out] beside each linear when `use_bias`.)

- Paddle layout (`ernie.` or `model.` prefix, fused `qkv_proj`/`up_gate_proj`,
  [in, out]): tensors are taken as they are. The fused qkv of a GQA model is
  plain [q | k | v]; of an MHA model per head [q0 k0 v0 | q1 ...] (ERNIEKit's
  reading, REFERENCE 1.2), which the graph splits per head. Per-expert
  tensors `experts.{e}.*` are stacked lazily. `lm_head.weight` may be [H, V]
  (published) or [V, H] (paddleformers' in-memory state): read by its shape.
- HF layout (`model.` prefix, split q/k/v/gate/up, [out, in]): each param is
  derived lazily: transposed, concatenated in the Paddle column order, and
  for experts stacked (per-expert `experts.{e}.gate_proj.weight` as saved on
  disk, or transformers' in-memory stacked `experts.gate_up_proj`).

A checkpoint with both fused and split tensors, or both prefixes, is refused.
"""

from __future__ import annotations

import re

from ernie_ir.ir.weights import ConcatSource, SlicedSource, StackSource, TransposedSource, WeightSource

from .checkpoint import TensorStore
from .config import Ernie45Config
from .errors import CheckpointError
from .params import CheckpointWeights, Layout

CANON = "ernie."
MTP = re.compile(r"(^|\.)mtp_")
_PADDLE_MARK = re.compile(r"\.(qkv_proj|up_gate_proj)\.")
_HF_MARK = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.|\.experts\.gate_up_proj$")


def detect_ernie_layout(store: TensorStore, cfg: Ernie45Config) -> ErnieLayout:
    """The layout of an ERNIE 4.5 checkpoint, from its key names (no data read)."""
    keys = [k for k in store if not MTP.search(k)]
    prefixes = {p: next((k for k in keys if k.startswith(p)), None) for p in ("ernie.", "model.")}
    if prefixes["ernie."] and prefixes["model."]:
        raise CheckpointError(
            f"{store.folder}: the checkpoint mixes prefixes 'ernie.' ({prefixes['ernie.']}) and 'model.' "
            f"({prefixes['model.']}): re-export it with one naming scheme"
        )
    prefix = "ernie." if prefixes["ernie."] else "model."
    paddle = next((k for k in keys if _PADDLE_MARK.search(k)), None)
    hf = next((k for k in keys if _HF_MARK.search(k)), None)
    if paddle and hf:
        raise CheckpointError(
            f"{store.folder}: the checkpoint mixes both weight layouts: Paddle fused tensors ({paddle}) "
            f"and HF split tensors ({hf}): re-export it in one layout"
        )
    if not paddle and not hf:
        raise CheckpointError(
            f"{store.folder}: cannot tell the weight layout: no qkv_proj (Paddle) or q_proj (HF) "
            f"tensors under {prefix!r}; is this an ERNIE 4.5 checkpoint?"
        )
    return ErnieLayout("paddle" if paddle else "hf", prefix, cfg)


class ErnieLayout(Layout):
    """`paddle` or `hf`, with the checkpoint's prefix (`ernie.` or `model.`)."""

    def __init__(self, name: str, prefix: str, cfg: Ernie45Config) -> None:
        self.name = name
        self.prefix = prefix
        self.cfg = cfg

    # -- names ---------------------------------------------------------------------------

    def key(self, canonical: str) -> str:
        """The checkpoint key of a canonical name that maps one-to-one."""
        return self.prefix + canonical[len(CANON):] if canonical.startswith(CANON) else canonical

    def _bias_keys(self, module: str) -> list[str]:
        m = self.key(module)
        return [f"{m}.moe_statics.e_score_correction_bias", f"{m}.gate.moe_statics.e_score_correction_bias"]

    def available(self, store: TensorStore, name: str) -> bool:
        if name.endswith(".moe_statics.e_score_correction_bias"):
            module = name.rsplit(".moe_statics.", 1)[0]
            return any(k in store for k in self._bias_keys(module))
        return self.key(name) in store

    # -- resolution ----------------------------------------------------------------------------

    def resolve(self, cw: CheckpointWeights, name: str, shape: tuple[int, ...]) -> WeightSource | None:
        if name.endswith(".moe_statics.e_score_correction_bias"):
            module = name.rsplit(".moe_statics.", 1)[0]
            keys = self._bias_keys(module)
            return cw.take(next((k for k in keys if cw.has(k)), keys[0]), shape)
        if name == "lm_head.weight":
            if self.name == "paddle":
                return cw.take(name, shape, transposable=True)
            return _t(cw.take(name, shape[::-1]))
        if ".experts." in name:
            return self._experts(cw, name, shape)
        if self.name == "paddle" or not _is_linear(name):
            return cw.take(self.key(name), shape)
        return self._hf_linear(cw, name, shape)

    def _experts(self, cw: CheckpointWeights, name: str, shape: tuple[int, ...]) -> WeightSource | None:
        """Stacked [E, ...] expert weights from per-expert (or HF stacked) tensors."""
        module, proj = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]  # ...mlp.experts, up_gate_proj
        base = self.key(module)
        experts, inner = shape[0], shape[1:]
        if self.name == "paddle":
            parts = [cw.take(f"{base}.{e}.{proj}.weight", inner) for e in range(experts)]
        elif proj == "up_gate_proj" and cw.has(f"{base}.gate_up_proj"):
            # transformers' in-memory form: [E, 2I, H] with rows [gate | up]
            src = cw.take(f"{base}.gate_up_proj", (experts, inner[1], inner[0]))
            return None if src is None else TransposedSource(src, (0, 2, 1))
        elif proj == "down_proj" and cw.has(f"{base}.down_proj"):
            src = cw.take(f"{base}.down_proj", (experts, inner[1], inner[0]))
            return None if src is None else TransposedSource(src, (0, 2, 1))
        elif proj == "up_gate_proj":
            parts = [self._gate_up(cw, f"{base}.{e}", inner, ".weight") for e in range(experts)]
        else:
            parts = [_t(cw.take(f"{base}.{e}.down_proj.weight", inner[::-1])) for e in range(experts)]
        if any(p is None for p in parts):
            return None
        return StackSource(parts)  # type: ignore[arg-type]

    def _gate_up(self, cw: CheckpointWeights, module: str, shape: tuple[int, ...],
                 leaf: str) -> WeightSource | None:
        """[gate | up] columns ([in, 2I]) or bias ([2I]) from HF gate_proj and up_proj."""
        if leaf == ".bias":
            half = (shape[0] // 2,)
            g, u = cw.take(f"{module}.gate_proj.bias", half), cw.take(f"{module}.up_proj.bias", half)
            return None if g is None or u is None else ConcatSource([g, u], 0)
        half_t = (shape[1] // 2, shape[0])
        g = _t(cw.take(f"{module}.gate_proj.weight", half_t))
        u = _t(cw.take(f"{module}.up_proj.weight", half_t))
        return None if g is None or u is None else ConcatSource([g, u], 1)

    def _hf_linear(self, cw: CheckpointWeights, name: str, shape: tuple[int, ...]) -> WeightSource | None:
        module, proj, leaf = _split_linear(name)
        hf_module = self.key(module)
        if proj == "qkv_proj":
            return self._qkv(cw, hf_module, shape, leaf)
        if proj == "up_gate_proj":
            return self._gate_up(cw, hf_module, shape, leaf)
        key = f"{hf_module}.{proj}{leaf}"
        if leaf == ".bias":
            return cw.take(key, shape)
        return _t(cw.take(key, shape[::-1]))  # o_proj, down_proj, gate (router) are [out, in] in HF

    def _qkv(self, cw: CheckpointWeights, module: str, shape: tuple[int, ...],
             leaf: str) -> WeightSource | None:
        cfg = self.cfg
        nh, nkv, hd = cfg.num_attention_heads, cfg.kv_heads, cfg.dim_per_head
        hidden = cfg.hidden_size
        if leaf == ".bias":
            q = cw.take(f"{module}.q_proj.bias", (nh * hd,))
            k = cw.take(f"{module}.k_proj.bias", (nkv * hd,))
            v = cw.take(f"{module}.v_proj.bias", (nkv * hd,))
            axis, transpose = 0, False
        else:
            q = cw.take(f"{module}.q_proj.weight", (nh * hd, hidden))
            k = cw.take(f"{module}.k_proj.weight", (nkv * hd, hidden))
            v = cw.take(f"{module}.v_proj.weight", (nkv * hd, hidden))
            axis, transpose = 1, True
        if q is None or k is None or v is None:
            return None
        if nkv != nh:  # GQA: [all q | all k | all v]
            parts = [q, k, v]
        else:  # MHA: per head [q0 k0 v0 | q1 k1 v1 | ...]
            parts = [SlicedSource(t, 0, h * hd, (h + 1) * hd) for h in range(nh) for t in (q, k, v)]
        if transpose:  # [out, in] rows -> [in, out] columns
            parts = [TransposedSource(p) for p in parts]
        return ConcatSource(parts, axis)


def _t(src: WeightSource | None) -> WeightSource | None:
    return None if src is None else TransposedSource(src)


_LINEARS = ("qkv_proj", "o_proj", "up_gate_proj", "down_proj", "gate")


def _split_linear(name: str) -> tuple[str, str, str]:
    """`a.b.qkv_proj.weight` -> (`a.b`, `qkv_proj`, `.weight`)."""
    stem, leaf = name.rsplit(".", 1)
    module, proj = stem.rsplit(".", 1)
    return module, proj, "." + leaf


def _is_linear(name: str) -> bool:
    return _split_linear(name)[1] in _LINEARS if name.count(".") >= 2 else False
