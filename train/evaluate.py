"""Acceptance of a bundle's drafter through the real runtime: a full block is verified every
step, so every block position is tested; tau overall, per block position and per prompt kind."""

from __future__ import annotations

import random
from pathlib import Path


def add_counts(total: list[int], counts: list[int]) -> list[int]:
    """Element-wise sum of two histograms of accepted drafts per step."""
    total = total + [0] * (len(counts) - len(total))
    return [t + (counts[k] if k < len(counts) else 0) for k, t in enumerate(total)]


def tau(hist: list[int]) -> float:
    """Tokens committed per step: the accepted drafts plus the target's own token."""
    return 1 + sum(k * c for k, c in enumerate(hist)) / max(1, sum(hist))


def position_rates(hist: list[int], block: int) -> list[float | None]:
    """For block positions 1..B-1: how often a draft there was accepted once it was reached."""
    rates = []
    for position in range(1, block):
        reached = sum(hist[position - 1:])
        rates.append(sum(hist[position:]) / reached if reached else None)
    return rates


def evaluate(bundle, rows: list[dict], max_new_tokens: int, drafter: str) -> dict:
    """{block, hist, by_kind: {kind: hist}} from generating every prompt row with `drafter`."""
    from dflash.runtime import Model

    model = Model(bundle)
    block = model.bundle.manifest["dflash"]["block_size"]
    hist, by_kind = [], {}
    for row in rows:
        kwargs = {"messages": row["messages"]} if "messages" in row else {"prompt": row["prompt"]}
        s = model.generate(max_new_tokens=max_new_tokens, drafter=drafter, draft_len=block - 1, **kwargs).stats
        hist = add_counts(hist, s.accept_hist)
        kind = row.get("kind", "all")
        by_kind[kind] = add_counts(by_kind.get(kind, []), s.accept_hist)
    return {"block": block, "hist": hist, "by_kind": by_kind}


def shard_prompts(shard: Path, per_source: int = 9, seed: int = 0) -> list[dict]:
    """Up to `per_source` one-turn requests of each source in a data shard, as prompt rows of
    kind "source-kind": acceptance on the data job's own sources, to set beside the held-out
    benchmark's (use a round the drafter did not train on).  Template requests recur verbatim in
    other rounds and seeds: a drafter trained on greedy answers to them recites them, so
    the self-written, passage and word kinds are the ones that measure drafting."""
    from . import shards

    rows = [r for r in shards.read(Path(shard)) if "messages" in r]
    rng, picked = random.Random(seed), []
    for source in sorted({r["source"] for r in rows}):
        of_source = [r for r in rows if r["source"] == source]
        for r in rng.sample(of_source, min(per_source, len(of_source))):
            picked.append({"id": r["id"], "kind": f"{source}-{r['kind']}", "messages": r["messages"]})
    return picked
