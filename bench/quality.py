"""`dflash-bench quality`: what a precision costs.  Per bundle: perplexity on a text, how often its
next-token choice agrees with the first bundle's (teacher-forced, position by position), and a
sample greedy answer."""

from __future__ import annotations

import numpy as np

from dflash.runtime.target import MAX_ROWS, causal_mask

SAMPLE_PROMPT = "Write a haiku about CPUs."


def score(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(log-probability of each next token, the argmax at each position) over `ids`, teacher-forced
    through the bundle's own target graph in chunks of MAX_ROWS rows."""
    logprobs, argmax = [], []
    for start in range(0, len(ids) - 1, MAX_ROWS):
        chunk = ids[start: min(start + MAX_ROWS, len(ids) - 1)]
        logits = model.target.forward(chunk, np.arange(start, start + len(chunk)), causal_mask(len(chunk)), start)
        logits = logits.astype(np.float64)
        top = logits.max(-1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
        following = ids[start + 1: start + 1 + len(chunk)]
        logprobs.append(logits[np.arange(len(chunk)), following] - log_z)
        argmax.append(logits.argmax(-1))
    return np.concatenate(logprobs), np.concatenate(argmax)


def quality(bundles: list[str], text: str, threads: int | None = None) -> list[dict]:
    """One row per bundle: perplexity, agreement with the first bundle, a sample answer."""
    from dflash.runtime import Model

    rows, reference = [], None
    for bundle in bundles:
        model = Model(bundle, threads=threads)
        ids = model.encode(prompt=text)[: model.capacity]
        logprobs, argmax = score(model, ids)
        if reference is None:
            reference = argmax
        n = min(len(argmax), len(reference))
        answer = model.generate(messages=[{"role": "user", "content": SAMPLE_PROMPT}], max_new_tokens=48).text
        rows.append({"bundle": str(bundle), "dtype": model.bundle.graphs["target"]["dtype"], "tokens": len(ids),
                     "perplexity": float(np.exp(-logprobs.mean())),
                     "agreement": float((argmax[:n] == reference[:n]).mean()),
                     "sample_prompt": SAMPLE_PROMPT, "sample": answer})
    return rows
