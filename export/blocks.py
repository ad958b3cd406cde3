"""Block-quantized weights and the quantizers that make them.

A `BlockWeight` is a [K, N] weight as MatMulQ4 (4 bits) or MatMulQ8 (8 bits) store it: per block
of 32 rows along K and per column a code u, a scale and, for asymmetric blocks, an offset:
W = (u - zero) * scale (symmetric, zero 8 or 128) or W = u * scale + offset.

Quantizers, from plain to searched:
- `symmetric` round-to-nearest (the scale maps a block's largest-magnitude weight to the lowest
  level): int8 weights, and drafters, whose rounding need not match anything;
- `searched` asymmetric blocks: per block, the (scale, offset) pair that minimises the weighted
  squared error over a range of candidate grids, each refit by least squares (as llama.cpp's
  `make_qkx3_quants` does for Q4_1 with an importance matrix), stored as float16 as Q4_1 is.
  The weights are an importance
  matrix (E[a^2] of the activations each input row multiplies) where one was measured, else the
  weights' own magnitudes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash.ops.reference import (Q4_BLOCK, ZERO, minmax_codes, symmetric_codes, tile_codes, tile_params)


@dataclass
class BlockWeight:
    bits: int                   # 4: MatMulQ4, 8: MatMulQ8
    codes: np.ndarray           # uint8 [K, N]
    scales: np.ndarray          # float32 [K/32, N]
    offsets: np.ndarray | None  # float32 [K/32, N]; None: symmetric, zero point ZERO[bits]
    exact: bool = False         # the source's own quantization, kept exactly

    def dequantized(self) -> np.ndarray:
        """W [K, N] in float32, each value rounded once, as GGUF dequantizes."""
        scales = np.repeat(self.scales, Q4_BLOCK, axis=0)
        if self.offsets is None:
            return ((self.codes.astype(np.int32) - ZERO[self.bits]).astype(np.float32) * scales).astype(np.float32)
        return (self.codes.astype(np.float32) * scales + np.repeat(self.offsets, Q4_BLOCK, axis=0)).astype(np.float32)

    def packed(self) -> list[np.ndarray]:
        """The op's inputs after `a`: weight, scales and (asymmetric) offsets, tiled; the
        parameters as float16 where that holds them exactly (GGUF's own d and m, and the searched
        blocks, which are rounded to it): half the bytes of float."""
        N = self.codes.shape[1]
        pad = 0 if self.offsets is not None else ZERO[self.bits]
        params = [self.scales] + ([] if self.offsets is None else [self.offsets])
        if all(fits_half(p) for p in params):
            params = [p.astype(np.float16) for p in params]
        return [tile_codes(self.codes, self.bits, pad)] + [tile_params(p, N).astype(p.dtype) for p in params]

    def widened(self, bits: int, asymmetric: bool) -> "BlockWeight":
        """The same values in a format at least this wide: 4-bit codes fit the 8-bit op, and a
        symmetric block is the asymmetric one with offset -zero * scale."""
        codes, offsets, zero = self.codes, self.offsets, ZERO[self.bits]
        if bits == 8 and self.bits == 4 and offsets is None and not asymmetric:
            codes = (codes.astype(np.int32) - zero + ZERO[8]).astype(np.uint8)
        if asymmetric and offsets is None:
            offsets = (np.float32(-zero) * self.scales).astype(np.float32)  # zero is a power of 2: exact
        return BlockWeight(max(bits, self.bits), codes, self.scales, offsets, self.exact)


def fits_half(p: np.ndarray) -> bool:
    """Whether float16 holds every value of p exactly."""
    with np.errstate(over="ignore"):
        return bool(np.array_equal(p.astype(np.float16).astype(np.float32), p))


def symmetric(w: np.ndarray, bits: int, half: bool = False) -> BlockWeight:
    """Symmetric round-to-nearest; `half`: the scales rounded to float16 first (as GGUF's Q8_0 /
    Q4_0 store them) and the codes rounded against those."""
    return BlockWeight(bits, *symmetric_codes(w, bits, half), None)


def minmax(w: np.ndarray, bits: int) -> BlockWeight:
    """Asymmetric round-to-nearest from each block's min and max (GGUF's reference Q4_1)."""
    return BlockWeight(bits, *minmax_codes(w, bits))


def error_weights(w: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    """Per-weight weights [K, N] of the squared error the search minimises. With an importance
    matrix (E[a_k^2] per input row k): importance_k * sqrt(sigma^2 + w^2), sigma^2 the column's mean
    square, llama.cpp's imatrix weighting; without: the block's rms + |w| (its Q4_K reference)."""
    if importance is not None:
        sigma2 = np.mean(w * w, axis=0, keepdims=True)
        return np.asarray(importance, np.float32)[:, None] * np.sqrt(sigma2 + w * w)
    K, N = w.shape
    blocks = w.reshape(K // Q4_BLOCK, Q4_BLOCK, N)
    rms = np.sqrt(np.mean(blocks * blocks, axis=1, keepdims=True))
    return (rms + np.abs(blocks)).reshape(K, N)


def searched(w: np.ndarray, bits: int = 4, importance: np.ndarray | None = None, rmin: float = -0.9,
             rdelta: float = 0.05, steps: int = 36) -> BlockWeight:
    """Asymmetric blocks with the (scale, offset) of least weighted squared error: for each of
    steps + 1 candidate grids (levels spread over the block's range, slightly wider or narrower)
    round, then refit scale and offset by weighted least squares; the min/max grid is a candidate
    too, so the result is never worse than `minmax` under the weighted error.

    In torch, a few thousand blocks at a time (they stay in cache; ~0.1 s per million weights on
    two cores, so an 8B model's search takes minutes, not the hour numpy's temporaries take)."""
    import torch

    w = np.asarray(w, dtype=np.float32)
    K, N = w.shape
    nmax = 2 ** bits - 1
    as_blocks = lambda a: torch.from_numpy(
        np.ascontiguousarray(a.reshape(K // Q4_BLOCK, Q4_BLOCK, N).transpose(0, 2, 1)).reshape(-1, Q4_BLOCK))
    x_all, wt_all = as_blocks(w), as_blocks(error_weights(w, importance))
    fits = [_search_blocks(x_all[i:i + SEARCH_CHUNK], wt_all[i:i + SEARCH_CHUNK], nmax, rmin, rdelta, steps)
            for i in range(0, x_all.shape[0], SEARCH_CHUNK)]
    # stored as float16 (as GGUF's Q4_1 stores d and m): the codes are rounded against those values
    scale, offset = (torch.cat(p).to(torch.float16).float().numpy() for p in zip(*fits))
    x = x_all.numpy()
    codes = np.clip(np.rint((x - offset) / np.where(scale > 0, scale, 1)), 0, nmax)
    flat = lambda a: a.reshape(K // Q4_BLOCK, N, -1)
    codes = flat(codes).transpose(0, 2, 1).reshape(K, N).astype(np.uint8)
    return BlockWeight(bits, codes, flat(scale)[..., 0], flat(offset)[..., 0])


SEARCH_CHUNK = 8192  # blocks searched at once: [8192, 32] float32 tensors fit in L2


def _search_blocks(x, wt, nmax, rmin, rdelta, steps):
    """(scale, offset) [n, 1] of least weighted error for blocks x [n, 32] with error weights wt.
    A grid's error comes from the block's weighted sums (float64: the terms cancel), so each
    candidate costs one pass over its levels."""
    import torch

    wt = wt + 1e-30  # an all-zero weight block still has a defined fit
    low, high = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    span = torch.where(high > low, high - low, torch.ones_like(low))
    wx = wt * x
    total = lambda a: a.sum(1, keepdim=True).double()
    sw, sx, sxx = total(wt), total(wx), total(wx * x)

    def sums(levels):
        wl = wt * levels
        return total(wl), total(wl * levels), total(wx * levels)

    def error(sl, sll, sxl, scale, offset):  # sum wt (scale*l + offset - x)^2
        return scale * scale * sll + 2 * scale * offset * sl + offset * offset * sw - 2 * scale * sxl \
            - 2 * offset * sx + sxx

    scale, offset = (span / nmax).double(), low.double()
    best = error(*sums(torch.clamp(torch.round((x - low) / span * nmax), 0, nmax)), scale, offset)
    for step in range(steps + 1):
        levels = torch.clamp(torch.round((x - low) * ((rmin + rdelta * step + nmax) / span)), 0, nmax)
        sl, sll, sxl = sums(levels)
        # the least-squares (scale, offset) through these levels (a 2x2 solve per block); blocks
        # whose levels are all equal keep scale 0 and the weighted mean
        det = sw * sll - sl * sl
        ok = det > 1e-12 * sw * sll
        safe = torch.where(ok, det, torch.ones_like(det))
        s = torch.where(ok, (sw * sxl - sx * sl) / safe, torch.zeros_like(det))
        o = torch.where(ok, (sll * sx - sl * sxl) / safe, sx / sw)
        err = error(sl, sll, sxl, s, o)
        take = err < best
        scale, offset, best = torch.where(take, s, scale), torch.where(take, o, offset), torch.where(take, err, best)
    return scale.float(), offset.float()
