"""WINT2 encoder: float weights -> FastDeploy's WINT2 (CCQ, 2-bit convolutional-code) tensors.

No open-source tool writes this format (FastDeploy only decodes it; REFERENCE section 14), so
the method is ours. The decoder is `ernie_ir.ops.wint2` (`wint2_dequantize`): per output
channel n, a codebook of 256 four-row vectors q(c) - 32 (c = 0..255, the four 6-bit windows
of word(c) = floor(c * code_scale[n] + code_zp[n] + 0.5)), scaled per group of 64 rows by
s4 * super_scales[n] (s4 = 0..15). For a weight W [..., K, N] (K a multiple of 128), each 2-D
slice (e.g. one expert) is encoded on its own:

1. **Codebook** (code_scale, code_zp): chosen per slice from `DEFAULT_CODEBOOKS`, written to
   every channel. A codebook is good when its 256 points, scaled, quantize 4-vectors of
   weights well; the candidates are the best of a one-off offline search whose script is not
   kept in the repository (20,000 random exact codebooks scored on unit Gaussian 4-vectors at
   their best scale, the best 300 rescored on 65,536 vectors, then a local search;
   `benchmarks/wint2.py` re-measures the candidates' mean squared errors). The best
   reached a mean squared error of 0.1096 per unit-variance weight on the search's sample
   (0.1107 on fresh vectors), against 0.1187 (0.1194) for the uniform 4-level scalar
   quantizer ({-1.5, -0.5, 0.5, 1.5} steps, the plain 2-bit grid, at its best step): the
   overlapping windows act as a 4-dimensional vector quantizer. The search
   keeps only *exact* codebooks (`exact_codebook`: multiples of 2^-5, words < 2^19), whose words
   are the same with or without FMA. Which candidate (and which scale ratio alpha, below) suits
   a slice best is decided on `sample_columns` of its columns (candidates differ by ~1-2% on
   heavy-tailed data, alpha by ~10% between Gaussian and Laplace-like weights).
2. **Scales**: group scale S = alpha * rms(group of 64 rows); super_scales[n] =
   bf16(max_g S / 15); s4 = clip(rint(S / super_scale), 1, 15) (0 for an all-zero group).
3. **Codes**: for each 4-row vector v of a group with decode scale s = f32(s4) * super_scale,
   the code minimising |v / s - (q(c) - 32)|^2, searched exhaustively over all 256 codes (one
   float32 matmul against the codebook plus an argmin; exact up to float32 near-ties).
4. **Refinement** (`refine` rounds): the least-squares scale of each group given its codes,
   rounded to s4, codes searched again for the groups whose s4 changed; a group keeps the new
   (s4, codes) only if its error went down, so the error never rises.

`Wint2Encoded.sq_error` is the squared error of the decoded weights (the op's float32 kernel)
against the input, per channel; benchmarks/wint2.py measures speed and error against plain
2-bit and wint4 (docs/quantization.md, "WINT2").
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ernie_ir.ops.quant_numerics import nonfinite_weight_error
from ernie_ir.ops.wint2 import (
    GROUP_ROWS,
    ROWS_PER_SCALE_BYTE,
    exact_codebook,
    pack_group_scales,
    wint2_codebook,
    wint2_dequantize,
)

DEFAULT_CODEBOOKS: tuple[tuple[float, float], ...] = (
    (119.9375, 1006.3125),
    (176.4375, 10513.96875),
    (362.75, 7178.875),
    (137.0625, 17816.875),
)
"""(code_scale, code_zp) candidates, best first (unit Gaussian MSE 0.1096, 0.1114, 0.1114,
0.1113; on Student-t(4) data 0.1999, 0.1986, 0.2006, 0.2010). All exact codebooks."""

GAUSSIAN_ALPHA = 0.0616
"""Group scale / group rms that minimises the first codebook's error on Gaussian weights."""
ALPHAS = (0.95, 1.0, 1.06, 1.13)
"""Multiples of GAUSSIAN_ALPHA tried per slice (heavy tails want larger scales)."""

_CHUNK = 256
"""4-row vectors per search step. Small on purpose: the [chunk, 256] float32 scores (256 KiB)
stay in L2, and OpenBLAS runs a matmul this small on the calling thread (larger ones wake its
thread pool, which costs ~8x here when the cores are busy); our threads share the chunks."""


class Wint2EncodeError(ValueError):
    """A weight the WINT2 encoder cannot encode (shape, NaN/Inf)."""


@dataclass
class Wint2Encoded:
    """The five WINT2 tensors of a weight [..., K, N] and the squared error of their decode."""

    quant_weight: np.ndarray
    """u8 [..., K/4, N]"""
    weight_scale: np.ndarray
    """u8 [..., K/128, N]"""
    super_scales: np.ndarray
    """bf16 [..., N]"""
    code_scale: np.ndarray
    """f32 [..., N]"""
    code_zp: np.ndarray
    """f32 [..., N]"""
    sq_error: np.ndarray
    """f64 [..., N]: sum over k of (decode - w)^2, decode = the op's float32 kernel."""
    sq_norm: np.ndarray
    """f64 [..., N]: sum over k of w^2."""

    def decode(self) -> np.ndarray:
        """The float32 weight [..., K, N] the op's kernel computes from these tensors."""
        return wint2_dequantize(self.quant_weight, self.weight_scale, self.super_scales, self.code_scale,
                                self.code_zp)

    @property
    def relative_error(self) -> float:
        """||decode - w||_F / ||w||_F over the whole weight."""
        total = float(self.sq_norm.sum())
        return math.sqrt(float(self.sq_error.sum()) / total) if total else 0.0

    def tensors(self) -> dict[str, np.ndarray]:
        """The checkpoint tensors by FastDeploy's key suffix."""
        return {"quant_weight": self.quant_weight, "weight_scale": self.weight_scale,
                "super_scales": self.super_scales, "code_scale": self.code_scale, "code_zp": self.code_zp}


def wint2_encode(w: np.ndarray, *, codebooks: Sequence[tuple[float, float]] = DEFAULT_CODEBOOKS,
                 alphas: Sequence[float] = ALPHAS, refine: int = 1, sample_columns: int = 32,
                 threads: int | None = None, name: str = "weight") -> Wint2Encoded:
    """Encode `w` [..., K, N] (float; K a multiple of 128) as WINT2 (module docstring: the method).

    codebooks: (code_scale, code_zp) candidates, each exact (`exact_codebook`); alphas:
    multiples of GAUSSIAN_ALPHA tried; both are chosen per 2-D slice on `sample_columns`
    evenly spaced columns (all columns if fewer). refine: least-squares scale rounds.
    threads: search threads (default min(2, cores)). Raises Wint2EncodeError for a bad shape
    and NonFiniteWeightError (naming `name`) for NaN/Inf."""
    arr = np.asarray(w)
    if arr.ndim < 2 or arr.shape[-2] % ROWS_PER_SCALE_BYTE or arr.shape[-2] == 0:
        raise Wint2EncodeError(f"{name}: WINT2 needs a weight [..., K, N] with K a positive multiple of "
                               f"{ROWS_PER_SCALE_BYTE}, got shape {list(arr.shape)}")
    if not codebooks or not alphas:
        raise Wint2EncodeError("wint2_encode needs at least one codebook and one alpha")
    cbs = np.asarray(codebooks, dtype=np.float32).reshape(-1, 2)
    if not exact_codebook(cbs[:, 0], cbs[:, 1]).all():
        raise Wint2EncodeError(f"codebooks must be exact (multiples of 2^-5, words < 2^19): {codebooks}")
    *lead, k, n = arr.shape
    slices = arr.reshape(-1, k, n)
    e = slices.shape[0]
    out = Wint2Encoded(
        quant_weight=np.empty((e, k // 4, n), np.uint8),
        weight_scale=np.empty((e, k // ROWS_PER_SCALE_BYTE, n), np.uint8),
        super_scales=np.empty((e, n), ml_dtypes.bfloat16),
        code_scale=np.empty((e, n), np.float32),
        code_zp=np.empty((e, n), np.float32),
        sq_error=np.empty((e, n), np.float64),
        sq_norm=np.empty((e, n), np.float64),
    )
    books = [_Book(float(cs), float(zp)) for cs, zp in cbs]
    scaled = [GAUSSIAN_ALPHA * a for a in alphas]
    nthreads = _threads(threads)
    # several slices (experts): one per thread, each searching alone; one slice: threads share it
    inner = 1 if e > 1 and nthreads > 1 else nthreads

    def encode(indices: list[int]) -> None:
        for i in indices:
            w32 = slices[i].astype(np.float32)
            if not np.isfinite(w32).all():
                raise nonfinite_weight_error(arr, name)
            book, alpha = _choose(w32, books, scaled, sample_columns, inner)
            codes, s4, ss = _encode_slice(w32, book, alpha, refine, inner)
            out.quant_weight[i] = codes
            out.weight_scale[i] = pack_group_scales(s4)
            out.super_scales[i] = ss.astype(ml_dtypes.bfloat16)
            out.code_scale[i] = np.float32(book.code_scale)
            out.code_zp[i] = np.float32(book.code_zp)
            dec = wint2_dequantize(out.quant_weight[i], out.weight_scale[i], out.super_scales[i],
                                   out.code_scale[i], out.code_zp[i])
            out.sq_error[i] = np.square(dec - w32).sum(axis=0, dtype=np.float64)
            out.sq_norm[i] = np.square(w32).sum(axis=0, dtype=np.float64)

    _run(encode, list(range(e)), nthreads if inner == 1 else 1)
    for f in ("quant_weight", "weight_scale", "super_scales", "code_scale", "code_zp", "sq_error", "sq_norm"):
        a = getattr(out, f)
        setattr(out, f, a.reshape(*lead, *a.shape[1:]))
    return out


class _Book:
    """One codebook: its decoded points p (f32 [256, 4], q - 32) and the search matrix
    [-2 p^T; |p|^2] ([5, 256]): [u, 1] @ it = |u - p|^2 - |u|^2 for every code."""

    def __init__(self, code_scale: float, code_zp: float) -> None:
        self.code_scale, self.code_zp = code_scale, code_zp
        self.points = wint2_codebook(np.float32(code_scale), np.float32(code_zp)).astype(np.float32)
        norms = np.square(self.points).sum(1)[None]
        self.search = np.concatenate([-2 * self.points.T, norms]).astype(np.float32)


def _threads(threads: int | None) -> int:
    return max(1, threads or min(2, os.cpu_count() or 1))


def _run(fn: Callable[[list[Any]], Any], tasks: list[Any], threads: int | None) -> None:
    """fn over `threads` interleaved shares of tasks (numpy releases the GIL in its loops)."""
    nthreads = min(_threads(threads), len(tasks))
    if nthreads <= 1:
        fn(tasks)
        return
    with ThreadPoolExecutor(nthreads) as pool:
        list(pool.map(fn, [tasks[i::nthreads] for i in range(nthreads)]))


def nearest_codes(u: np.ndarray, book: Any, threads: int | None = None) -> np.ndarray:
    """argmin_c |u - points[c]|^2 for each row of u (f32 [m, 4]): u8 [m] (exhaustive, 256 codes).

    `book`: a (code_scale, code_zp) pair or an encoder codebook."""
    if not isinstance(book, _Book):
        book = _Book(*book)
    u = np.ascontiguousarray(u, dtype=np.float32).reshape(-1, 4)
    codes = np.empty(u.shape[0], np.uint8)
    _search_into(codes, u, None, book, threads)
    return codes


def _search_into(codes: np.ndarray, v: np.ndarray, inv: np.ndarray | None, book: _Book,
                 threads: int | None) -> None:
    """codes[i] = the nearest code to v[i] * inv[i] (inv None: 1), for v f32 [m, 4]."""
    m = v.shape[0]
    idx = np.empty(m, np.intp)  # argmin's output type; narrowed to u8 at the end

    def run(starts: list[int]) -> None:
        u = np.empty((_CHUNK, 5), np.float32)
        u[:, 4] = 1
        scores = np.empty((_CHUNK, 256), np.float32)
        for i in starts:
            j = min(m, i + _CHUNK)
            if inv is None:
                u[: j - i, :4] = v[i:j]
            else:
                np.multiply(v[i:j], inv[i:j, None], out=u[: j - i, :4])
            np.matmul(u[: j - i], book.search, out=scores[: j - i])
            np.argmin(scores[: j - i], axis=1, out=idx[i:j])

    _run(run, list(range(0, m, _CHUNK)), threads)
    codes[:] = idx


def _vectors(w32: np.ndarray) -> np.ndarray:
    """The 4-row vectors of w [K, N] as f32 [K/4, N, 4] (vector j of column n: rows 4j..4j+3)."""
    k, n = w32.shape
    return np.ascontiguousarray(w32.reshape(k // 4, 4, n).transpose(0, 2, 1))


def _fit_scales(w32: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(s4 u8 [G, N], super_scale f32 [N] (a bf16 value), nonzero bool [G, N]) for w [K, N]."""
    k, n = w32.shape
    ms = np.square(w32).reshape(k // GROUP_ROWS, GROUP_ROWS, n).mean(axis=1, dtype=np.float64)
    target = np.float64(alpha) * np.sqrt(ms)  # [G, N]
    ss = (target.max(axis=0) / 15).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    nonzero = ms > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        s4 = np.where(nonzero & (ss > 0), np.clip(np.rint(target / ss), 1, 15), 0).astype(np.uint8)
    return s4, ss, nonzero


def _decode_scale(s4: np.ndarray, ss: np.ndarray) -> np.ndarray:
    """f32(s4) * f32(super_scale): the op's group scale [G, N]."""
    return s4.astype(np.float32) * ss[None, :]


def _inverse_per_vector(scale: np.ndarray) -> np.ndarray:
    """1 / scale (0 where scale is 0) per 4-row vector: f32 [K/4 * N]."""
    with np.errstate(divide="ignore"):
        inv = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    return np.repeat(inv, GROUP_ROWS // 4, axis=0).reshape(-1)


def _group_errors(vec: np.ndarray, codes: np.ndarray, scale: np.ndarray, book: _Book) -> np.ndarray:
    """Squared error per group [G, N] of codes [K/4, N] at scale [G, N] (float32 decode)."""
    g, n = scale.shape
    p = book.points[codes]  # [K/4, N, 4]
    d = p.reshape(g, GROUP_ROWS // 4, n, 4) * scale[:, None, :, None] - vec.reshape(g, GROUP_ROWS // 4, n, 4)
    return np.einsum("gjnd,gjnd->gn", d, d)


def _encode_slice(w32: np.ndarray, book: _Book, alpha: float, refine: int,
                  threads: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes u8 [K/4, N], s4 u8 [K/64, N], super_scale f32 [N]) for one slice w [K, N]."""
    k, n = w32.shape
    g = k // GROUP_ROWS
    vec = _vectors(w32)
    flat = vec.reshape(-1, 4)
    s4, ss, nonzero = _fit_scales(w32, alpha)
    codes = np.empty(flat.shape[0], np.uint8)
    _search_into(codes, flat, _inverse_per_vector(_decode_scale(s4, ss)), book, threads)
    codes = codes.reshape(k // 4, n)
    if refine <= 0:
        return codes, s4, ss
    per = GROUP_ROWS // 4
    v = vec.reshape(g, per, n, 4)
    err = np.empty((g, n), np.float32)
    for r in range(refine):
        p = book.points[codes].reshape(g, per, n, 4)
        if r == 0:
            d = p * _decode_scale(s4, ss)[:, None, :, None] - v
            err = np.einsum("gjnd,gjnd->gn", d, d)
        num = np.einsum("gjnd,gjnd->gn", p, v)
        den = np.einsum("gjnd,gjnd->gn", p, p)
        with np.errstate(divide="ignore", invalid="ignore"):
            best = np.where(den > 0, num / den, 0) / ss[None, :]
        rounded = np.clip(np.rint(np.nan_to_num(best)), 1, 15)
        new_s4 = np.where(nonzero & (ss > 0), rounded, 0).astype(np.uint8)
        changed = new_s4 != s4  # [G, N]
        if not changed.any():
            break
        gi, ni = np.nonzero(changed)
        # the changed groups' vectors: rows gi * 16 + r of column ni, r = 0..15
        rows = (gi[:, None] * per + np.arange(per)[None, :]).reshape(-1)
        cols = np.repeat(ni, per)
        sub = vec[rows, cols]  # [c * 16, 4]
        new_scale = _decode_scale(new_s4, ss)[gi, ni]  # [c]
        inv = np.repeat(np.where(new_scale > 0, 1 / new_scale, 0).astype(np.float32), per)
        sub_codes = np.empty(sub.shape[0], np.uint8)
        _search_into(sub_codes, sub, inv, book, threads)
        dec = book.points[sub_codes] * np.repeat(new_scale, per)[:, None]
        new_err = np.square(dec - sub).reshape(-1, per * 4).sum(axis=1)
        better = new_err < err[gi, ni]
        if not better.any():
            break
        gb, nb = gi[better], ni[better]
        s4[gb, nb] = new_s4[gb, nb]
        err[gb, nb] = new_err[better]
        keep = np.repeat(better, per)
        codes[rows[keep], cols[keep]] = sub_codes[keep]
    return codes, s4, ss


def _choose(w32: np.ndarray, books: list[_Book], alphas: list[float], sample_columns: int,
            threads: int | None) -> tuple[_Book, float]:
    """The (codebook, alpha) with the least error on `sample_columns` evenly spaced columns."""
    if len(books) == 1 and len(alphas) == 1:
        return books[0], alphas[0]
    n = w32.shape[1]
    cols = np.unique(np.linspace(0, n - 1, min(n, max(1, sample_columns))).round().astype(int))
    sample = np.ascontiguousarray(w32[:, cols])
    vec = _vectors(sample)
    best: tuple[float, _Book, float] | None = None
    for alpha in alphas:
        s4, ss, _ = _fit_scales(sample, alpha)
        scale = _decode_scale(s4, ss)
        inv = _inverse_per_vector(scale)
        for book in books:
            codes = np.empty(vec.shape[0] * vec.shape[1], np.uint8)
            _search_into(codes, vec.reshape(-1, 4), inv, book, threads)
            err = float(_group_errors(vec, codes.reshape(vec.shape[:2]), scale, book).sum())
            if best is None or err < best[0]:
                best = (err, book, alpha)
    assert best is not None
    return best[1], best[2]


# -- baselines (for measuring the encoder) ----------------------------------------------------------


def plain2_sym(w: np.ndarray, refine: int = 1) -> np.ndarray:
    """Plain 2-bit with WINT2's scale format, as a baseline: f32 [..., K, N].

    Per group of 64 rows and channel: levels {-1.5, -0.5, 0.5, 1.5} * s (symmetric uniform
    4-level, round to nearest), s = s4 * super_scale stored exactly as WINT2 stores it (s4 4-bit,
    super_scale bf16 per channel), fitted the same way (s = alpha * rms with the best alpha per
    slice from a grid, then `refine` least-squares rounds). The same bits per weight as WINT2."""
    arr = np.asarray(w)
    *lead, k, n = arr.shape
    out = np.empty((int(np.prod(lead, dtype=np.int64)), k, n), np.float32)
    for i, sl in enumerate(arr.reshape(-1, k, n)):
        w32 = sl.astype(np.float32)
        best: tuple[float, np.ndarray] | None = None
        for a in (0.80, 0.88, 0.96, 1.04, 1.12):  # step / rms; 0.996 is optimal for Gaussian weights
            s4, ss, nonzero = _fit_scales(w32, a)
            for _ in range(refine + 1):
                rec, lv = _sym2_round(w32, _decode_scale(s4, ss))
                num = (lv * w32).reshape(k // GROUP_ROWS, GROUP_ROWS, n).sum(1, dtype=np.float64)
                den = np.square(lv).reshape(k // GROUP_ROWS, GROUP_ROWS, n).sum(1, dtype=np.float64)
                with np.errstate(divide="ignore", invalid="ignore"):
                    fit = np.nan_to_num(np.where(den > 0, num / den, 0) / ss[None, :])
                new = np.where(nonzero & (ss > 0), np.clip(np.rint(fit), 1, 15), 0).astype(np.uint8)
                rec2, _ = _sym2_round(w32, _decode_scale(new, ss))
                e1 = np.square(rec - w32).reshape(k // GROUP_ROWS, GROUP_ROWS, n).sum(1)
                e2 = np.square(rec2 - w32).reshape(k // GROUP_ROWS, GROUP_ROWS, n).sum(1)
                s4 = np.where(e2 < e1, new, s4)
            rec, _ = _sym2_round(w32, _decode_scale(s4, ss))
            err = float(np.square((rec - w32).astype(np.float64)).sum())
            if best is None or err < best[0]:
                best = (err, rec)
        assert best is not None
        out[i] = best[1]
    return out.reshape(arr.shape)


def _sym2_round(w32: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(reconstruction, level in units of the scale) of the 4-level symmetric quantizer."""
    s = np.repeat(scale, GROUP_ROWS, axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(s > 0, w32 / s, 0)
    lv = np.clip(np.floor(t), -2, 1) + np.float32(0.5)
    return (lv * s).astype(np.float32), lv.astype(np.float32)


def rtn2_asym(w: np.ndarray, group: int = 64) -> np.ndarray:
    """Round-to-nearest asymmetric 2-bit per group of `group` rows, as a baseline: f32 [..., K, N].

    levels min + j (max - min) / 3, j = 0..3, from each group's min and max (GPTQ's RTN
    baseline; it stores a scale and a zero point per group, 0.5 more bits per weight at 16-bit)."""
    w32 = np.asarray(w).astype(np.float32)
    *lead, k, n = w32.shape
    g = w32.reshape(*lead, k // group, group, n)
    lo, hi = g.min(axis=-2, keepdims=True), g.max(axis=-2, keepdims=True)
    step = (hi - lo) / 3
    with np.errstate(divide="ignore", invalid="ignore"):
        j = np.where(step > 0, np.clip(np.rint((g - lo) / step), 0, 3), 0)
    return (lo + j * step).reshape(w32.shape).astype(np.float32)
