"""Drafting from a corpus of the target's earlier answers (SuffixDecoding / REST).

Where prompt lookup finds nothing to copy, the `suffix` drafter looks the last 8, 6, 4, 3 or 2
tokens up in a corpus of answers the target itself wrote (for the default model: the drafter
campaign's answers, shipped in the bundle as `suffix_corpus.npy`) and drafts the continuation most
of their latest occurrences share, token by token. Drafts are verified like any other, so the
output stays the target's own; the corpus only decides how often a draft is right.

The index is numpy only: per suffix length, a hash of every window that has a continuation,
sorted, looked up with searchsorted, and every hit checked against the tokens (a hash collision
never drafts from a wrong place).
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np

ORDERS = (8, 6, 4, 3, 2)  # suffix lengths tried, longest first
KEEP = 64                 # latest occurrences of a suffix that vote on its continuation
DRAFT = 8                 # longest continuation drafted from the corpus
RECITE = 16               # ... from the answer memory, whose matches usually repeat a whole answer
END = -1                  # separates answers in the corpus: no continuation runs past it
_MULT = np.uint64(0x9E3779B97F4A7C15)
_MULT_INT, _MASK64 = 0x9E3779B97F4A7C15, (1 << 64) - 1


def _hash(windows: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of `windows` [n, order] (int64 token ids)."""
    h = np.zeros(len(windows), np.uint64)
    for column in windows.T:
        h = (h ^ column.astype(np.uint64)) * _MULT
    return h


def _hash_one(window: list[int]) -> np.uint64:
    """_hash of one window, in Python integers: on a handful of ids numpy's per-call overhead
    dominates, and with it a draft's lookups took 68 us instead of 44."""
    h = 0
    for token in window:
        h = ((h ^ token) * _MULT_INT) & _MASK64
    return np.uint64(h)


class SuffixIndex:
    """Every 2..8-token window of `tokens` (answers separated by -1) that some token follows;
    continuations up to `longest` tokens."""

    def __init__(self, tokens: np.ndarray, longest: int = DRAFT):
        self.tokens = np.asarray(tokens, np.int64)
        self.longest = longest
        self.keys: dict[int, np.ndarray] = {}
        self.ends: dict[int, np.ndarray] = {}
        ended = np.concatenate([[0], np.cumsum(self.tokens == END)])  # separators before each index
        for n in ORDERS:
            end = np.arange(n, len(self.tokens))  # window tokens[end-n:end], continuation tokens[end]
            ok = (ended[end] == ended[end - n]) & (self.tokens[end] != END)
            end = end[ok]
            windows = self.tokens[end[:, None] - n + np.arange(n)]
            keys = _hash(windows)
            order = np.argsort(keys, kind="stable")  # equal keys stay oldest first
            self.keys[n], self.ends[n] = keys[order], end[order]

    @classmethod
    def from_answers(cls, answers: list[list[int]], longest: int = DRAFT) -> "SuffixIndex":
        flat = [t for answer in answers for t in [*answer, END]]
        return cls(np.array(flat, np.int64), longest)

    def draft(self, history: list[int]) -> list[int]:
        """The continuation of the longest suffix of `history` found, followed token by token
        along its most common next token among the latest KEEP occurrences; [] if none."""
        return self.match(history)[0]

    def match(self, history: list[int]) -> tuple[list[int], int]:
        """draft's continuation and the length of the suffix it continues ([], 0 if none)."""
        for n in ORDERS:
            if len(history) < n:
                continue
            tail = np.array(history[-n:], np.int64)
            key = _hash_one(history[-n:])
            keys = self.keys[n]
            ends = self.ends[n][np.searchsorted(keys, key, "left"):np.searchsorted(keys, key, "right")]
            ends = ends[(self.tokens[ends[:, None] - n + np.arange(n)] == tail).all(axis=1)]
            if len(ends):
                return self._vote([self._continuation(int(e)) for e in ends[-KEEP:]]), n
        return [], 0

    def _continuation(self, end: int) -> list[int]:
        following = self.tokens[end:end + self.longest].tolist()
        return following[:following.index(END)] if END in following else following

    def _vote(self, candidates: list[list[int]]) -> list[int]:
        out = []
        for depth in range(self.longest):
            counts = Counter(c[depth] for c in candidates if len(c) > depth)
            if not counts:
                break
            token = counts.most_common(1)[0][0]  # ties: the first seen, as Counter keeps insertion order
            out.append(token)
            candidates = [c for c in candidates if len(c) > depth and c[depth] == token]
        return out


class AnswerMemory:
    """The latest answers this drafter helped write, up to `capacity` tokens (the oldest go first),
    indexed like the corpus (SuffixDecoding's online cache): a request that repeats an earlier
    one, or a regenerated answer, is drafted from what the target wrote last time.  The index is
    rebuilt after each answer (~1 ms per thousand tokens held)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"answer memory must hold at least 1 token; got {capacity}")
        self.capacity = capacity
        self.answers: deque[list[int]] = deque()
        self.held = 0
        self.index: SuffixIndex | None = None

    def add(self, answer: list[int]) -> None:
        answer = list(answer)[-self.capacity:]
        if len(answer) < 2:  # nothing a suffix of 2+ tokens could continue
            return
        self.answers.append(answer)
        self.held += len(answer)
        while self.held > self.capacity:
            self.held -= len(self.answers.popleft())
        self.index = SuffixIndex.from_answers(list(self.answers), RECITE)

    def match(self, history: list[int]) -> tuple[list[int], int]:
        return self.index.match(history) if self.index else ([], 0)

    def clear(self) -> None:
        self.answers.clear()
        self.held, self.index = 0, None
