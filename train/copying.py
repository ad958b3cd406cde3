"""Does copying from the target's earlier answers pay?  Measured by simulation before anything is
built into the runtime (SuffixDecoding / REST retrieve drafts from a corpus of earlier outputs).

Free drafting of up to 8 tokens a step against the target's greedy answers to held-out prompts:
- `lookup`: prompt lookup, as the runtime's `lookup` drafter does it;
- `lookup+suffix`: where prompt lookup matches fewer than 2 tokens, the continuation that most
  often followed the longest matching suffix (2-8 tokens) in the corpus of the campaign's answers.
tau = answer tokens / steps (every step commits the accepted drafts and the target's own token).
"""

from __future__ import annotations

from collections import Counter

from dflash.runtime.drafters import lookup_draft

DRAFT = 8
ORDERS = (8, 6, 4, 3, 2)
KEEP = 64  # latest occurrences kept per suffix


class SuffixCorpus:
    """Every 2..8-token suffix of a corpus of answers -> where it occurred (latest KEEP)."""

    def __init__(self, answers: list[list[int]]):
        self.flat: list[int] = []
        self.where: dict[tuple, list[int]] = {}
        for answer in answers:
            start = len(self.flat)
            self.flat += answer + [-1]  # -1 ends an answer: no continuation runs past it
            for end in range(start + 1, len(self.flat) - 1):
                for n in ORDERS:
                    if end - n >= start:
                        places = self.where.setdefault(tuple(self.flat[end - n:end]), [])
                        places.append(end)
                        if len(places) > KEEP:
                            del places[0]

    def draft(self, history: list[int]) -> list[int]:
        """The majority continuation of the longest suffix of `history` seen in the corpus."""
        for n in ORDERS:
            places = self.where.get(tuple(history[-n:])) if len(history) >= n else None
            if places:
                candidates = [self.flat[p:p + DRAFT] for p in places]
                candidates = [c[: c.index(-1)] if -1 in c else c for c in candidates]
                out = []
                for depth in range(DRAFT):  # follow the most common token, depth by depth
                    counts = Counter(c[depth] for c in candidates if len(c) > depth)
                    if not counts:
                        break
                    token = counts.most_common(1)[0][0]
                    out.append(token)
                    candidates = [c for c in candidates if len(c) > depth and c[depth] == token]
                return out
        return []


def simulate(prompt: list[int], answer: list[int], corpus: SuffixCorpus | None) -> int:
    """Steps needed to commit `answer` after `prompt` with free drafting of up to 8 tokens."""
    steps, i = 0, 0
    while i < len(answer):
        history = prompt + answer[:i]
        draft, match = lookup_draft(history, DRAFT)
        if corpus is not None and match < 2:
            draft = corpus.draft(history) or draft
        accepted = 0
        while accepted < len(draft) and i + accepted < len(answer) and draft[accepted] == answer[i + accepted]:
            accepted += 1
        i += accepted + 1
        steps += 1
    return steps


def measure(held_out: list[dict], corpus: SuffixCorpus) -> dict:
    """{kind: {"lookup": tau, "lookup+suffix": tau}} over rows {kind, prompt, answer} (token ids)."""
    totals: dict[str, list[int]] = {}
    for row in held_out:
        t = totals.setdefault(row["kind"], [0, 0, 0])
        t[0] += len(row["answer"])
        t[1] += simulate(row["prompt"], row["answer"], None)
        t[2] += simulate(row["prompt"], row["answer"], corpus)
    totals["all"] = [sum(t[k] for t in totals.values()) for k in range(3)]
    return {kind: {"lookup": t[0] / t[1], "lookup+suffix": t[0] / t[2]} for kind, t in totals.items()}
