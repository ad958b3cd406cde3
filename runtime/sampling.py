"""Choosing the next token from logits: greedy, or sampling with temperature, top-k, top-p."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        keep = np.searchsorted(cumulative, params.top_p) + 1  # smallest set reaching top_p
        p_top = np.zeros_like(p)
        p_top[order[:keep]] = p[order[:keep]]
        p = p_top / p_top.sum()
    return p


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        p = probabilities(logits, self.params)
        return int(self.rng.choice(p.size, p=p))
