"""Choosing the next token from logits: greedy, or sampling with temperature, top-k, top-p.

Sampling runs once per generated token (and per node of a speculative sampled step), next to
an int4 target step of ~4 ms, so it avoids full sorts of the vocabulary: top-p sorts only the
tokens above a partition threshold, and the draw skips `Generator.choice`'s checks of p.  Both
give exactly what the full sort and `Generator.choice(p=...)` give, draw for draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOP_P_CANDIDATES = 1024  # tokens sorted for top-p before falling back to the whole vocabulary


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
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1:
        kept = _nucleus(p, params.top_p)
        p_top = np.zeros_like(p)
        p_top[kept] = p[kept]
        p = p_top / p_top.sum()
    return p


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest set of most probable tokens whose mass reaches `top_p`, ties taken in id
    order (as a stable sort of the whole vocabulary would).  Sorts only the tokens at or above
    the TOP_P_CANDIDATES-th probability, which hold the set unless the distribution is very flat."""
    candidates = np.arange(p.size)
    if p.size > TOP_P_CANDIDATES:
        threshold = np.partition(p, -TOP_P_CANDIDATES)[-TOP_P_CANDIDATES]
        candidates = np.flatnonzero(p >= threshold)  # every tie of the threshold too, in id order
    order = candidates[np.argsort(-p[candidates], kind="stable")]
    cumulative = np.cumsum(p[order])
    if cumulative[-1] < top_p and order.size < p.size:  # a flat distribution: sort it all
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
    return order[: np.searchsorted(cumulative, top_p) + 1]


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        p = probabilities(logits, self.params)
        cdf = np.cumsum(p)  # what Generator.choice(p.size, p=p) does, without its checks on p
        return int(np.searchsorted(cdf / cdf[-1], self.rng.random(), side="right"))
