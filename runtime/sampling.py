"""Choosing the next token from logits: greedy, or sampling with temperature, top-k, top-p.

Sampling runs once per generated token (and per node of a speculative sampled step), next to
an int4 target step of ~4 ms, so it avoids full sorts of the vocabulary: top-p sorts only the
tokens above a partition threshold (1024 of them, then 8192 when those hold too little mass),
and the draw inverts the CDF of the kept tokens alone, skipping `Generator.choice`'s checks of p.
Both give what the full sort and `Generator.choice(p=...)` give, draw for draw (the CDF sums the
same terms in the same order; only its normalization may round differently, by an ulp).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOP_P_CANDIDATES = (1024, 8192)  # tokens sorted for top-p, in turn, before sorting the whole vocabulary


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy); got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off); got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from, after temperature, top-k and top-p (float64)."""
    kept, p = _support(logits, params)
    if kept is None:
        return p
    out = np.zeros_like(p)
    out[kept] = p[kept] / p[kept].sum()
    return out


def _support(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
    """(the ids top-p keeps in increasing order, or None for every id; the probabilities after
    temperature and top-k, before top-p renormalizes them)."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p >= 1:
        return None, p
    return np.sort(_nucleus(p, params.top_p)), p


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest set of most probable tokens whose mass reaches `top_p`, ties taken in id
    order (as a stable sort of the whole vocabulary would).  Sorts only the tokens at or above
    the n-th probability (n in TOP_P_CANDIDATES), which hold the set unless the distribution is
    flatter than n tokens can cover; then the whole vocabulary."""
    for n in (*(n for n in TOP_P_CANDIDATES if n < p.size), p.size):
        candidates = np.arange(p.size)
        if n < p.size:
            threshold = np.partition(p, -n)[-n]
            candidates = np.flatnonzero(p >= threshold)  # every tie of the threshold too, in id order
        order = candidates[np.argsort(-p[candidates], kind="stable")]
        cumulative = np.cumsum(p[order])
        if cumulative[-1] >= top_p or order.size == p.size:
            return order[: np.searchsorted(cumulative, top_p) + 1]


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        kept, p = _support(logits, self.params)
        # What Generator.choice(p.size, p=p) does, without its checks on p: the CDF in id order.
        # Tokens outside the kept set add zeros to it, so the kept ones' CDF draws the same token.
        cdf = np.cumsum(p if kept is None else p[kept])
        index = int(np.searchsorted(cdf / cdf[-1], self.rng.random(), side="right"))
        return index if kept is None else int(kept[index])
