"""Speculative decoding, greedy, with a chain of drafted tokens verified in one target call.

Each step feeds [last committed token, d1..dk] at positions past..past+k with a causal mask.
The target's own choice after each prefix decides: the longest run of drafts equal to the
target's argmax is accepted, plus the target's token after it (the bonus).  Rows written
for rejected drafts lie at or beyond the new past length, which attention never reads, so a
chain needs no cache compaction.  (Trees, sampling and adaptive lengths: issue 4.)
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .target import causal_mask


def lookup_draft(tokens: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier match of the last n tokens."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def greedy_chain(target, history: list[int], draft_fn, k: int, stats) -> Iterator[list[int]]:
    """After prefill: `history` is the prompt plus the first token, which is not yet cached.
    Yields the committed tokens of each step (1 to k+1 at a time)."""
    history = list(history)
    last, past = history[-1], len(history) - 1
    while True:
        room = target.capacity - past - 1  # rows left after `last`
        draft = draft_fn(history, min(k, room)) if room > 0 else []
        rows = [last] + draft
        logits = target.forward(rows, np.arange(past, past + len(rows)), causal_mask(len(rows)), past)
        choices = logits.argmax(axis=-1)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == choices[accepted]:
            accepted += 1
        new = draft[:accepted] + [int(choices[accepted])]
        stats.steps += 1
        past += accepted + 1
        last = new[-1]
        history += new
        yield new
