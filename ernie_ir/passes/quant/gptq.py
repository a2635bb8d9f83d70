"""GPTQ on FastDeploy's weight-only grid: one linear's int codes from its weight and Hessian.

Frantar et al. 2022 (Algorithm 1), for a weight W [K, N] (ours: [in, out]) and the Hessian
H = 2 X^T X / n [K, K] of its calibration inputs X [n, K]:

- dead inputs (H_kk == 0: the channel was always zero) get H_kk = 1 and their weight row 0
  (the paper's reference code does the same: nothing can be learnt about them);
- optional act-order: input rows are visited in order of decreasing H_kk;
- dampening: H += damp * mean(diag H) * I; then U = the upper Cholesky factor of H^-1;
- input rows are quantized one at a time in blocks of `block_size`; each row's rounding error,
  divided by U_kk, is spread over the rows not yet quantized (inside the block at once, onto the
  later blocks once per block), which is what makes X W_q track X W.

The grid is the one `weight_quantize` (RTN) writes, so the result loads wherever RTN's does:
symmetric per output channel, scale [N] in the weight's dtype, codes in [-127, 127] (int8) or
[-7, 7] (int4), `round_half_away(w / scale)`. The scale is chosen before the sweep, from the
original weight, exactly as RTN chooses it (abs-max / bound per output channel): the updated
weights may outgrow it and are clipped there, as every GPTQ implementation with a static
per-channel scale does.
"""

from __future__ import annotations

import numpy as np

from ernie_ir.ir import ErnieIRError
from ernie_ir.ops.quant_numerics import INT_BOUND, weight_scales

DAMP = 0.01
"""Default dampening, as a fraction of the mean Hessian diagonal (the GPTQ paper, PaddleSlim's
`fasterquant(percdamp=.01)`, llm-compressor and GPTQModel; docs/quantization.md section 4.7)."""
BLOCK_SIZE = 128
"""Input rows updated together (the paper's B; every implementation's default)."""


class GptqError(ErnieIRError):
    """A linear GPTQ cannot quantize (its Hessian stays singular after dampening)."""


SINGULAR = 1e-12
"""A Cholesky pivot^2 below this fraction of the largest diagonal entry: H is singular in float64
(the factorization may still finish, on rounding noise, and GPTQ's updates would blow up)."""


def _lower_inverse(m: np.ndarray) -> np.ndarray:
    """The inverse of a lower-triangular matrix, by 2x2 blocks (matmuls: about K^3 / 3 flops, a
    third of a general inverse)."""
    k = m.shape[0]
    if k <= 128:
        return np.linalg.inv(m)
    h = k // 2
    a, c = _lower_inverse(m[:h, :h]), _lower_inverse(m[h:, h:])
    out = np.zeros_like(m)
    out[:h, :h], out[h:, h:] = a, c
    out[h:, :h] = -c @ m[h:, :h] @ a
    return out


def _upper_inverse_cholesky(h: np.ndarray, name: str, damp: float) -> np.ndarray:
    """U upper with U^T U = H^-1 (the upper Cholesky factor of H^-1), without forming H^-1: with J
    the reversal, J H J = M M^T gives H^-1 = J M^-T M^-1 J, so U = J M^-1 J."""
    try:
        lower = np.linalg.cholesky(h[::-1, ::-1])
        if float(np.min(np.diag(lower))) ** 2 <= SINGULAR * float(np.max(np.diag(h))):
            raise np.linalg.LinAlgError("singular")
    except np.linalg.LinAlgError:
        more = max(DAMP, damp * 10) if damp > 0 else DAMP
        raise GptqError(f"gptq: the Hessian of {name} is singular after dampening (damp={damp:g}); "
                        f"calibrate on more tokens or raise damp (try damp={more:g})") from None
    return np.ascontiguousarray(_lower_inverse(lower)[::-1, ::-1])


def gptq_quantize(w: np.ndarray, hessian: np.ndarray, bits: int, *, damp: float = DAMP,
                  block_size: int = BLOCK_SIZE, actorder: bool = False,
                  name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [K, N], scale [N] in `weight_scales`' dtype) for `w` [K, N] and `hessian`
    [K, K] (any positive multiple of X^T X). GptqError names `name` when H stays singular."""
    bound = INT_BOUND[bits]
    scale = weight_scales(w, bits, -1, name=name)  # RTN's scale; NaN/Inf weights refused here
    s = scale.astype(np.float64)
    s = np.where(s == 0, 1.0, s)  # an all-zero channel: codes 0, as RTN
    k = w.shape[0]
    h = np.array(hessian, np.float64, copy=True)
    work = np.asarray(w, np.float64).copy()
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    work[dead, :] = 0.0
    order = np.argsort(-np.diag(h), kind="stable") if actorder else np.arange(k)
    work, h = work[order], h[np.ix_(order, order)]
    h[np.diag_indices(k)] += damp * float(np.mean(np.diag(h)))
    u = _upper_inverse_cholesky(h, name, damp)
    codes = np.zeros((k, w.shape[1]), np.int8)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        block = work[i1:i2]  # a view: updates inside the block land in `work`
        err = np.zeros_like(block)
        for i in range(i2 - i1):
            row = block[i]
            t = row / s
            q = np.clip(np.copysign(np.floor(np.abs(t) + 0.5), t), -bound, bound)  # half away
            codes[i1 + i] = q.astype(np.int8)
            e = (row - q * s) / u[i1 + i, i1 + i]
            block[i:] -= np.outer(u[i1 + i, i1 + i:i2], e)
            err[i] = e
        work[i2:] -= u[i1:i2, i2:].T @ err
    out = np.empty_like(codes)
    out[order] = codes
    return out, scale
