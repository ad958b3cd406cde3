"""Speculative decoding: propose a tree of draft tokens, verify it in one target call, accept.

A draft is a tree below the root, the last committed token (which is not cached yet).
Its nodes are listed parents-first; node i sits in verify row i + 1 at position
past + depth, and attends to the cache and to its ancestors (the tree mask).  A chain
is the tree where every node's parent is the one before it.

Acceptance walks down from the root: at each row the target picks its token (argmax, or
a sample from its distribution), and the walk moves to the child holding that token, or
stops there.  The picked tokens are the output, so it is exactly the target's own greedy
decoding, and for sampling exactly distributed as plain sampling (sample-and-match: each
token is drawn from the target's distribution given a prefix of target-drawn tokens).
The accepted path's K/V rows then move together, so the cache holds only committed rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .target import MAX_ROWS


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # parent node index; -1 is the root

    @classmethod
    def chain(cls, tokens: list[int]) -> "Draft":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def tree_inputs(self) -> tuple[np.ndarray, np.ndarray]:
        """Depth of each verify row (root first) and the mask: row r sees row c iff c is r or an ancestor."""
        n = len(self.tokens) + 1
        depth = np.zeros(n, np.int64)
        mask = np.eye(n, dtype=np.bool_)
        mask[:, 0] = True
        for node, parent in enumerate(self.parents):
            row, parent_row = node + 1, parent + 1
            if not 0 <= parent_row < row:
                raise ValueError(f"draft node {node} has parent {parent}: parents must come first")
            mask[row] |= mask[parent_row]
            depth[row] = depth[parent_row] + 1
        return depth, mask


def accept(draft: Draft, logits: np.ndarray, pick) -> tuple[list[int], list[int]]:
    """Walk the verified tree: returns the accepted rows (root first) and the new tokens
    (the accepted drafts, then the target's own token after them)."""
    children: dict[tuple[int, int], int] = {}
    for node, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
        children.setdefault((parent + 1, token), node + 1)
    rows, new, row = [0], [], 0
    while True:
        token = pick(logits[row])
        new.append(token)
        row = children.get((row, token))
        if row is None:
            return rows, new
        rows.append(row)


def accepted_along(rows: list[int], nodes: list[int]) -> int:
    """How many of `nodes` (a path from the root, as node indices) the accepted `rows` took."""
    taken = 0
    while taken < len(nodes) and taken + 1 < len(rows) and rows[taken + 1] == nodes[taken] + 1:
        taken += 1
    return taken


def speculative_steps(target, drafter, history: list[int], pick, stats) -> Iterator[list[int]]:
    """After prefill (and `drafter.begin()` before it): `history` is the prompt plus the
    first token, which is not yet cached.  Yields the tokens committed by each verify."""
    history = list(history)
    past = len(history) - 1
    while True:
        # nodes that fit after the root's row: in the cache, and in one target call
        room = min(target.capacity - past, MAX_ROWS) - 1
        start = time.perf_counter()
        draft = drafter.propose(history, room) if room > 0 else Draft()
        drafted = time.perf_counter()
        depth, mask = draft.tree_inputs()
        logits = target.forward([history[-1]] + draft.tokens, past + depth, mask, past)
        rows, new = accept(draft, logits, pick)
        if drafter.wants_taps:  # before keep_rows: taps are per verify row, not per cache row
            drafter.add_context(target.taps(len(draft) + 1)[rows])
        target.keep_rows(past, rows)
        verified = time.perf_counter()
        drafter.observe(draft, rows, (drafted - start) * 1e3, (verified - drafted) * 1e3)
        stats.record_step(len(rows) - 1, (drafted - start) * 1e3, (verified - drafted) * 1e3)
        past += len(rows)
        history += new
        yield new
