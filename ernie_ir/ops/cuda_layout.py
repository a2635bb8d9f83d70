"""Paddle's CUDA weight-only layout: the bytes `paddle.nn.quant.weight_quantize(w, algo, arch)` returns.

The IR keeps logical int values `q` [K, N] (= [in, out]). Paddle stores them
transposed to [N, K] (int8) or [N/2, K] (int4, two nibbles per byte, low
nibble first), biased (byte = q + 128, nibble = q + 8) and permuted for the
CUTLASS mixed-input GEMM. The permutation depends on the arch only (not on
the group size); arch 75/80/86/89/90 share one layout, 70 has its own. With
element = byte (int8) or nibble (int4), i its flat index and
`perm(x, L, t) = (x // L) * L + t[x % L]` (tests/reference/README.md, verified
bit for bit against Paddle 3.3.1's CPU kernel):

- arch 70: k = i // N, n = perm(i % N, 4, [0,2,1,3]) (int8) or
  perm(i % N, 8, [0,2,4,6,1,3,5,7]) (int4);
- arch >= 75: C = 2 (int8) or 4 (int4); j = i % 64, h = (i // 64) % C,
  t = (i // (64 C)) % (K / 64), p = i // (C K); n = p C + h,
  k = 64 t + rowperm(interleave(j)).

Shape limits (observed on Paddle's CPU kernel): N % 16 == 0 (checked by
Paddle); arch >= 75 also needs K % 64 == 0 (Paddle does not check it and
corrupts its heap otherwise). `packable` says whether a shape fits.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np

from ernie_ir.ir import ErnieIRError

CUDA_ARCHS = (70, 75, 80, 86, 89, 90)
DEFAULT_CUDA_ARCH = 80

_IL8 = np.array([0, 2, 1, 3])
_IL4 = np.array([0, 2, 4, 6, 1, 3, 5, 7])
_RP8 = np.array([0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15])
_RP4 = np.array([0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27,
                 4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23, 30, 31])


def _perm(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    n = len(table)
    return (x // n) * n + table[x % n]


def check_arch(arch: int) -> int:
    if arch not in CUDA_ARCHS:
        raise ErnieIRError(f"unknown --cuda-arch {arch}: choose one of {', '.join(map(str, CUDA_ARCHS))}")
    return arch


def packable(k: int, n: int, bits: int, arch: int) -> str | None:
    """None if a [K, N] weight packs for `arch`, else the reason it does not."""
    if n % 16:
        return f"out_features {n} is not a multiple of 16 (Paddle weight_quantize requires it)"
    if arch >= 75 and k % 64:
        return (f"in_features {k} is not a multiple of 64 (the sm{arch} CUTLASS layout tiles "
                "64 rows; --cuda-arch 70 packs it)")
    return None


@lru_cache(maxsize=64)
def position_map(k: int, n: int, bits: int, arch: int) -> np.ndarray:
    """For each stored element (byte or nibble), the flat index n * K + k of its logical value."""
    i = np.arange(k * n, dtype=np.int64)
    il, rp, c = (_IL8, _RP8, 2) if bits == 8 else (_IL4, _RP4, 4)
    if arch == 70:
        kk = i // n
        nn = _perm(i % n, il)
    else:
        j = i % 64
        h = (i // 64) % c
        t = (i // (64 * c)) % (k // 64)
        p = i // (c * k)
        nn = p * c + h
        kk = 64 * t + _perm(_perm(j, il), rp)
    out = nn * k + kk
    out.setflags(write=False)
    return out


def packed_shape(k: int, n: int, bits: int) -> tuple[int, int]:
    return (n, k) if bits == 8 else (n // 2, k)


def _row_order(bits: int) -> np.ndarray:
    """sigma: the logical row (within a tile of 64) of each stored position j of that tile."""
    il, rp = (_IL8, _RP8) if bits == 8 else (_IL4, _RP4)
    return _perm(_perm(np.arange(64), il), rp)


_WIDE = {2: np.uint16, 4: np.uint32}
_BLOCK_ROWS, _BLOCK_COLS = 64, 512  # a source block of 64 x 512 wide elements stays in L1/L2


def _transpose(a: np.ndarray) -> np.ndarray:
    """a.T of a 2-D array, copied block by block: numpy's one-shot transposing copy runs ~10x
    slower than this for matrices larger than the cache. Two threads share the columns (numpy
    releases the GIL while it copies): 1.7x on two cores."""
    rows, cols = a.shape
    out = np.empty((cols, rows), a.dtype)

    def part(c_lo: int, c_hi: int) -> None:
        for r0 in range(0, rows, _BLOCK_ROWS):
            for c0 in range(c_lo, c_hi, _BLOCK_COLS):
                c1 = min(c0 + _BLOCK_COLS, c_hi)
                out[c0:c1, r0:r0 + _BLOCK_ROWS] = a[r0:r0 + _BLOCK_ROWS, c0:c1].T

    half = (cols // 2) // _BLOCK_COLS * _BLOCK_COLS
    if half == 0 or a.size < _PARALLEL_MIN:
        part(0, cols)
        return out
    list(_pool().map(lambda bounds: part(*bounds), [(0, half), (half, cols)]))
    return out


_PARALLEL_MIN = 1 << 22  # elements: below this a second thread costs more than it saves


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="ernie-ir-pack")


def _stored_order(q: np.ndarray, bits: int, arch: int, flip: int = 0) -> np.ndarray:
    """The logical values q [K, N] (one byte each, XOR `flip`) in the order Paddle stores their
    elements (flat).

    The position map above, as copies. For arch >= 75 the stored elements run over
    [N / C, K / 64, C, 64] tiles (n = p C + h, k = 64 t + sigma(j)). The C columns of a group
    are adjacent bytes of q, so they move as one uint16/uint32: for each tile row t and a
    block of columns, the tile's 64 rows are gathered in sigma order and transposed into a
    cache-sized buffer ([columns, 64] wide elements), whose C bytes are then split into their
    rows of the output ([64, C] -> [C, 64]), XOR `flip`, in one pass. So q is read once and the
    output written once; two threads share the tile rows (numpy releases the GIL while it
    copies). For arch 70 over [K, N] with columns permuted in groups of 4 (int8) or 8 (int4).
    No per-element index array."""
    k, n = q.shape
    if arch == 70:
        il = _IL8 if bits == 8 else _IL4
        src = np.asarray(q).reshape(k, n // len(il), len(il))
        out = np.empty_like(src)
        for i, j in enumerate(il):  # one strided copy per position of the group: no index array
            if flip:
                np.bitwise_xor(src[:, :, j], np.uint8(flip), out=out[:, :, i])
            else:
                out[:, :, i] = src[:, :, j]
        return out.reshape(-1)
    c = 2 if bits == 8 else 4
    tiles, p = k // 64, n // c
    wide = np.ascontiguousarray(q).view(_WIDE[c]).reshape(k, p)
    sigma = _row_order(bits)
    out = np.empty((p, tiles, c, 64), np.uint8)

    def part(t_lo: int, t_hi: int) -> None:
        buf = np.empty((_TILE_COLS, 64), _WIDE[c])
        for t in range(t_lo, t_hi):
            rows = wide[64 * t:64 * t + 64]
            for p0 in range(0, p, _TILE_COLS):
                p1 = min(p0 + _TILE_COLS, p)
                block = buf[:p1 - p0]
                np.copyto(block, rows[sigma, p0:p1].T)  # [columns, 64]: wide element (p, j)
                split = block.view(np.uint8).reshape(p1 - p0, 64, c).transpose(0, 2, 1)
                if flip:
                    np.bitwise_xor(split, np.uint8(flip), out=out[p0:p1, t])
                else:
                    np.copyto(out[p0:p1, t], split)

    if tiles >= 2 and q.size >= _PARALLEL_MIN:
        list(_pool().map(lambda bounds: part(*bounds), [(0, tiles // 2), (tiles // 2, tiles)]))
    else:
        part(0, tiles)
    return out.reshape(-1)


_TILE_COLS = 2048  # wide elements per block of `_stored_order`: 64 x 2048 of them (256/512 KiB) fit L2


def _logical_from_stored(elems: np.ndarray, k: int, n: int, bits: int, arch: int) -> np.ndarray:
    """Inverse of `_stored_order`: q [K, N] from the stored elements."""
    if arch == 70:
        il = _IL8 if bits == 8 else _IL4
        src = elems.reshape(k, n // len(il), len(il))
        q = np.empty_like(src)
        for i, j in enumerate(il):
            q[:, :, j] = src[:, :, i]
        return q.reshape(k, n)
    c = 2 if bits == 8 else 4
    t, p = k // 64, n // c
    tiles = np.ascontiguousarray(elems.reshape(p * t, c, 64).transpose(0, 2, 1))  # [P T, 64, C] bytes
    rows = _transpose(tiles.view(_WIDE[c]).reshape(p, k)).reshape(t, 64, p)  # stored row j of each tile
    inverse = np.argsort(_row_order(bits))  # logical row m of a tile sits at stored position inverse[m]
    return rows[:, inverse, :].view(elems.dtype).reshape(k, n)


def pack(q: np.ndarray, bits: int, arch: int) -> np.ndarray:
    """Logical int values q [K, N] (in [-127, 127] / [-7, 7]) -> Paddle's int8 bytes for `arch`."""
    k, n = q.shape
    why = packable(k, n, bits, arch)
    if why:
        raise ErnieIRError(f"cannot pack a [{k}, {n}] weight for sm{arch}: {why}")
    if bits == 8:  # byte = q + 128: the sign bit flipped, as the bytes move
        stored = _stored_order(np.asarray(q, dtype=np.int8).view(np.uint8), bits, arch, flip=0x80)
        return stored.view(np.int8).reshape(n, k)
    nib = (np.asarray(q, dtype=np.int8) + np.int8(8)).view(np.uint8)  # q + 8 in [1, 15]
    elems = _stored_order(nib, bits, arch)
    return (elems[0::2] | (elems[1::2] << np.uint8(4))).view(np.int8).reshape(n // 2, k)


def unpack(packed: np.ndarray, k: int, n: int, bits: int, arch: int) -> np.ndarray:
    """Inverse of `pack`: the logical int8 values [K, N]."""
    raw = np.asarray(packed).view(np.uint8).reshape(-1)
    if bits == 8:
        elems = (raw ^ np.uint8(0x80)).view(np.int8)
    else:
        nib = np.empty(raw.size * 2, np.uint8)
        nib[0::2] = raw & 0x0F
        nib[1::2] = raw >> 4
        elems = (nib.view(np.int8) - np.int8(8))
    return np.ascontiguousarray(_logical_from_stored(elems, k, n, bits, arch), dtype=np.int8)
