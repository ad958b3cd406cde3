"""Does copying from the target's earlier answers pay?  Measured by simulation before anything is
built into the runtime (SuffixDecoding / REST retrieve drafts from a corpus of earlier outputs);
the runtime's `suffix` drafter now drafts with the same index (runtime/suffix.py).

Free drafting of up to 8 tokens a step against the target's greedy answers to held-out prompts:
- `lookup`: prompt lookup, as the runtime's `lookup` drafter does it;
- `lookup+suffix`: where prompt lookup matches fewer than 2 tokens, the continuation that most
  often followed the longest matching suffix (2-8 tokens) in the corpus of the campaign's answers
  (as the runtime's `suffix` drafter).
tau = answer tokens / steps (every step commits the accepted drafts and the target's own token).
"""

from __future__ import annotations

from dflash.runtime.drafters import lookup_draft
from dflash.runtime.suffix import DRAFT, SuffixIndex


def simulate(prompt: list[int], answer: list[int], corpus: SuffixIndex | None) -> int:
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


def measure(held_out: list[dict], corpus: SuffixIndex) -> dict:
    """{kind: {"lookup": tau, "lookup+suffix": tau}} over rows {kind, prompt, answer} (token ids)."""
    totals: dict[str, list[int]] = {}
    for row in held_out:
        t = totals.setdefault(row["kind"], [0, 0, 0])
        t[0] += len(row["answer"])
        t[1] += simulate(row["prompt"], row["answer"], None)
        t[2] += simulate(row["prompt"], row["answer"], corpus)
    totals["all"] = [sum(t[k] for t in totals.values()) for k in range(3)]
    return {kind: {"lookup": t[0] / t[1], "lookup+suffix": t[0] / t[2]} for kind, t in totals.items()}
