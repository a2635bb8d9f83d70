"""The KV cache's ops: append a step's keys/values to the past ones, and the keep mask of padding.

A decoder graph (the `kv-cache` pass) reads the past keys and values of every attention as graph
inputs [B, KV, P, D] (optimum's and onnxruntime-genai's layout) and returns the present ones
[B, KV, T, D], T = P + S, T being the length of the `attention_mask` input [B, T]. The mask says
which of the T slots hold a real token (1) and which a pad (0), so rows of unequal length share
one batch, padded on either side or with holes in the middle.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, need_float, need_int, need_rank, same_dim


class KvCacheAppendAttrs(OpAttrs):
    pass


@register_op
class KvCacheAppend(OpDef):
    """present = concat(past, transpose(new, [0, 2, 1, 3]), axis=2)

    past: float or u8 (a C8 cache) [B, KV, P, D]; new: [B, S, KV, D] of past's dtype (the keys
    or values one attention computes for this step's S tokens); attention_mask: integer [B, T], only its shape
    is read: T = P + S (checked at run time), so present is [B, KV, T, D], typed with the
    mask's length. The dtype is the cache's: a graph that keeps its cache in another dtype than
    the attention computes casts `new` first.
    """

    name = "kv_cache_append"
    inputs = (Input("past"), Input("new"), Input("attention_mask"))
    Attrs = KvCacheAppendAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: KvCacheAppendAttrs) -> list[TensorType]:
        past = need(types[0], self.name, "past")
        new = need(types[1], self.name, "new")
        mask = need(types[2], self.name, "attention_mask")
        if past.dtype != DType.U8:  # u8: a C8 cache (ernie_ir/ops/kv_cache_int8.py)
            need_float(past, self.name, "past")
        need_rank(past, 4, self.name, "past")
        need_rank(new, 4, self.name, "new")
        need_int(mask, self.name, "attention_mask")
        need_rank(mask, 2, self.name, "attention_mask")
        if new.dtype != past.dtype:
            raise OpError(f"kv_cache_append: new is {new.dtype} but the cache is {past.dtype}: cast it first")
        same_dim(past.shape[0], new.shape[0], self.name, "batch of past and new")
        same_dim(past.shape[0], mask.shape[0], self.name, "batch of past and attention_mask")
        same_dim(past.shape[1], new.shape[2], self.name, "kv heads of past and new")
        same_dim(past.shape[3], new.shape[3], self.name, "head dims of past and new")
        b, kv, _, d = past.shape
        return [TensorType(past.dtype, (b, kv, mask.shape[1], d))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: KvCacheAppendAttrs) -> list[np.ndarray]:
        past, new, mask = args[0], args[1], args[2]
        assert past is not None and new is not None and mask is not None
        p, s, t = past.shape[2], new.shape[1], mask.shape[1]
        if p + s != t:
            raise OpError(f"kv_cache_append: past length {p} + {s} new tokens = {p + s}, but the "
                          f"attention_mask covers {t}: the mask must cover the past and the new tokens")
        return [np.concatenate([past, new.transpose(0, 2, 1, 3)], axis=2)]


class KeyPaddingMaskAttrs(OpAttrs):
    pass


@register_op
class KeyPaddingMask(OpDef):
    """keep[b, 0, 0, t] = attention_mask[b, t] != 0

    attention_mask: integer [B, T] (1: a real token, 0: a pad); keep: bool [B, 1, 1, T], which
    broadcasts over attention's [B, H, S, T] scores (a query never attends to a pad).
    """

    name = "key_padding_mask"
    inputs = (Input("attention_mask"),)
    Attrs = KeyPaddingMaskAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: KeyPaddingMaskAttrs) -> list[TensorType]:
        mask = need(types[0], self.name, "attention_mask")
        need_int(mask, self.name, "attention_mask")
        need_rank(mask, 2, self.name, "attention_mask")
        return [TensorType(DType.BOOL, (mask.shape[0], 1, 1, mask.shape[1]))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: KeyPaddingMaskAttrs) -> list[np.ndarray]:
        mask = args[0]
        assert mask is not None
        return [(mask != 0)[:, None, None, :]]
