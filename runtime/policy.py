"""How much to speculate: the draft that maximises expected committed tokens per millisecond.

A verify of S rows costs T(S) ms (measured once per Model, then kept current from the
verifies themselves); a draft token costs d ms (the drafter's own running figure).  A
chain of k drafts commits 1 + a1 + a1*a2 + ... tokens in expectation, where a_i is the
running rate at which the i-th draft was accepted given the one before it was.  Each
step takes the k in 0..limit that maximises tokens / (k*d + T(k+1)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_DRAFT = 24  # nodes per verify, beyond which no drafter here pays
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 20, 25)  # verify sizes measured; others interpolated


class VerifyCost:
    """T(S), the target's ms per forward of S rows."""

    def __init__(self, measured: dict[int, float]):
        sizes = sorted(measured)
        self.ms = np.interp(np.arange(MAX_DRAFT + 2), sizes, [measured[s] for s in sizes])

    @classmethod
    def measure(cls, target) -> "VerifyCost":
        sizes = [s for s in COST_SIZES if s < target.capacity]
        return cls(target.measure_cost(sizes))

    def __call__(self, rows: int) -> float:
        return float(self.ms[min(rows, len(self.ms) - 1)])

    def observe(self, rows: int, ms: float) -> None:
        if rows < len(self.ms):  # a running average follows load changes on the machine
            self.ms[rows] += 0.1 * (ms - self.ms[rows])


class Acceptance:
    """Running per-depth acceptance rates of one drafter's chains (exponentially weighted).

    Depth i's rate starts from depth i-1's (and depth 1's from 0.5) and moves towards what
    is observed, so depths not tried yet are expected to do as well as the last tried one."""

    PRIOR, WEIGHT = 0.5, 2.0

    def __init__(self, decay: float = 0.97):
        self.accepted = np.zeros(MAX_DRAFT)
        self.tried = np.zeros(MAX_DRAFT)
        self.decay = decay

    def rates(self) -> np.ndarray:
        rates, prior = np.empty(MAX_DRAFT), self.PRIOR
        for depth in range(MAX_DRAFT):
            prior = rates[depth] = (self.accepted[depth] + self.WEIGHT * prior) / (self.tried[depth] + self.WEIGHT)
        return rates

    def observe(self, drafted: int, accepted: int) -> None:
        """A chain of `drafted` tokens of which the first `accepted` were taken."""
        tried = min(accepted + 1, drafted)  # depths after the first rejection were never tested
        for depth in range(tried):
            self.accepted[depth] = self.decay * self.accepted[depth] + (depth < accepted)
            self.tried[depth] = self.decay * self.tried[depth] + 1

    def reach(self, k: int) -> np.ndarray:
        """P(the first i drafts are all accepted), for i = 1..k."""
        return np.cumprod(self.rates()[:k])


@dataclass(frozen=True)
class Beside:
    """A branch already in the verify that a drafter's new branch from the root would join
    (the hybrid's copy): the verify rows it fills, root included; the tokens it is expected to
    commit, the root's own included; and the chance its first draft is rejected, the only case
    in which the target can take the new branch."""

    rows: int = 1
    tokens: float = 1.0
    share: float = 1.0


ALONE = Beside()  # nothing else in the verify: the draft is the only branch


class Policy:
    """Chooses chain lengths (and tree side branches) from the verify cost and acceptance."""

    EXPLORE_EVERY = 16  # when drafting does not pay, still try one draft token this often

    def __init__(self, cost: VerifyCost, fixed: int | None = None):
        self.cost, self.fixed = cost, fixed
        self.skipped = 0

    def chain_length(self, acceptance: Acceptance, draft_ms: float, limit: int, fixed_ms: float = 0.0,
                     beside: Beside = ALONE) -> int:
        """Drafts `draft_ms` per token and `fixed_ms` per call (when it drafts at all); `beside`:
        the branch the chain would join (0: the chain does not add enough to it to pay)."""
        limit = min(limit, MAX_DRAFT)
        if self.fixed is not None:
            return min(self.fixed, limit)
        if limit <= 0:
            return 0
        best = self.best_length(acceptance.reach(limit), draft_ms, fixed_ms, beside)
        if best == 0:  # keep the acceptance figures current, or they could never recover
            self.skipped += 1
            best = int(self.skipped % self.EXPLORE_EVERY == 0)
        return best

    def best_length(self, reach: np.ndarray, draft_ms: float = 0.0, fixed_ms: float = 0.0,
                    beside: Beside = ALONE) -> int:
        """The k in 0..len(reach) that maximises expected tokens per ms, where reach[i] is the chance
        the first i+1 drafts are all accepted."""
        k = np.arange(len(reach) + 1)
        gained = beside.tokens + beside.share * np.concatenate(([0.0], np.cumsum(reach)))
        spent = k * draft_ms + (k > 0) * fixed_ms + self.cost.ms[np.minimum(beside.rows + k, len(self.cost.ms) - 1)]
        return int(np.argmax(gained / spent))

    def rate(self, acceptance: Acceptance, k: int, draft_ms: float) -> float:
        """Expected committed tokens per ms of a chain of k."""
        return (1 + acceptance.reach(k).sum()) / (k * draft_ms + self.cost(k + 1))

    def worth_adding(self, gain: float, rows: int, rate: float) -> bool:
        """Whether one more verify row, expected to add `gain` tokens, raises tokens per ms."""
        if self.fixed is not None:
            return True
        return gain > (self.cost(rows + 1) - self.cost(rows)) * rate
