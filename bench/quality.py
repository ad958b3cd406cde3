"""`dflash-bench quality`: what a precision costs.  Per bundle: perplexity on a text, how often its
next-token choice agrees with the first bundle's (teacher-forced, position by position), and a
sample greedy answer.

    dflash-bench quality --bundle bundles/smollm2 --bundle bundles/smollm2-int4 --json quality.json
"""

from __future__ import annotations

import click
import numpy as np

from dflash.runtime.target import MAX_ROWS, causal_mask

SAMPLE_PROMPT = "Write a haiku about CPUs."
SAMPLE_TOKENS = 48
# Tokens scored with one fill of the cache; a longer text is scored in windows of this many, each
# from an empty cache.  Fixed (not each bundle's capacity) so that every bundle scores the same
# windows and the agreement compares like with like.
WINDOW = 1024


def score(model, ids: list[int], window: int = WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """(log-probability of each next token, the argmax at each position) over `ids`, teacher-forced
    through the bundle's own target graph.  Windows overlap by one token, so every next token is
    scored exactly once."""
    window = min(window, model.capacity)
    logprobs, argmax = [], []
    for start in range(0, len(ids) - 1, window - 1):
        lp, am = score_window(model.target, ids[start: start + window])
        logprobs.append(lp)
        argmax.append(am)
    return np.concatenate(logprobs), np.concatenate(argmax)


def score_window(target, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Like `score`, for ids that fit the cache: causal forwards of at most MAX_ROWS rows from past 0."""
    logprobs, argmax = [], []
    for start in range(0, len(ids) - 1, MAX_ROWS):
        chunk = ids[start: min(start + MAX_ROWS, len(ids) - 1)]
        logits = target.forward(chunk, np.arange(start, start + len(chunk)), causal_mask(len(chunk)), start)
        logits = logits.astype(np.float64)
        top = logits.max(-1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
        following = ids[start + 1: start + 1 + len(chunk)]
        logprobs.append(logits[np.arange(len(chunk)), following] - log_z)
        argmax.append(logits.argmax(-1))
    return np.concatenate(logprobs), np.concatenate(argmax)


def quality(bundles: list[str], text: str, threads: int | None = None, window: int = WINDOW) -> list[dict]:
    """One row per bundle: perplexity, agreement with the first bundle, a sample answer."""
    from dflash.runtime import Model

    rows, reference = [], None
    for bundle in bundles:
        model = Model(bundle, threads=threads)  # one at a time: only one model's weights in memory
        ids = model.encode(prompt=text)
        if len(ids) < 2:
            raise ValueError("the text needs at least two tokens")
        logprobs, argmax = score(model, ids, window)
        if reference is None:
            reference = argmax
        n = min(len(argmax), len(reference))  # equal unless the bundles' tokenizers differ
        answer = model.generate(messages=[{"role": "user", "content": SAMPLE_PROMPT}],
                                max_new_tokens=SAMPLE_TOKENS).text
        rows.append({"bundle": str(bundle), "dtype": model.bundle.graphs["target"]["dtype"], "tokens": len(ids),
                     "window": min(window, model.capacity), "perplexity": float(np.exp(-logprobs.mean())),
                     "agreement": float((argmax[:n] == reference[:n]).mean()),
                     "sample_prompt": SAMPLE_PROMPT, "sample": answer})
    return rows


def print_table(rows: list[dict]) -> None:
    width = max(len("bundle"), *(len(r["bundle"]) for r in rows))
    click.echo(f"{'bundle':{width}s} {'dtype':5s} {'tokens':>6s} {'perplexity':>10s} {'agrees with first':>17s}")
    for r in rows:
        click.echo(f"{r['bundle']:{width}s} {r['dtype']:5s} {r['tokens']:6d} {r['perplexity']:10.2f} "
                   f"{r['agreement']:17.1%}")
    for r in rows:
        click.echo(f"\n{r['bundle']} ({r['dtype']}) answers {r['sample_prompt']!r}:\n{r['sample']}")
