"""`dflash-bench quality`: what a precision costs.  Per bundle: perplexity on a text, how often its
next-token choice agrees with the first bundle's (teacher-forced, position by position), the mean
KL divergence of its next-token distribution from the first bundle's (as llama.cpp's
`perplexity --kl-divergence` reports it), and a sample greedy answer.  `--peers llamacpp` scores
the same tokens with llama.cpp on the first bundle's source GGUF, against the same first bundle.

    dflash-bench quality --bundle bundles/smollm2 --bundle bundles/smollm2-int4 --json quality.json
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click
import numpy as np

from dflash.runtime.target import MAX_ROWS, causal_mask

SAMPLE_PROMPT = "Write a haiku about CPUs."
SAMPLE_TOKENS = 48
# Tokens scored with one fill of the cache; a longer text is scored in windows of this many, each
# from an empty cache.  Fixed (not each bundle's capacity) so that every bundle scores the same
# windows and the agreement compares like with like.
WINDOW = 1024


class Scores:
    """What one model gives at every scored position: the log-probability of the next token, the
    argmax, and (`keep` set) the whole log-distribution, written to a float32 file of
    positions x vocabulary (a long text's distributions do not fit in memory)."""

    def __init__(self, positions: int, keep: Path | None = None, vocab: int = 0):
        self.logprobs, self.argmax, self.done = np.zeros(positions), np.zeros(positions, np.int64), 0
        self.all = np.lib.format.open_memmap(keep, "w+", np.float32, (positions, vocab)) if keep else None

    def add(self, logits: np.ndarray, following) -> np.ndarray:
        """Record the rows of logits [n, V] whose next tokens are `following`: their log-softmax."""
        logits = logits.astype(np.float64)
        top = logits.max(-1, keepdims=True)
        log_p = logits - (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))
        n, at = len(following), self.done
        self.logprobs[at:at + n] = log_p[np.arange(n), following]
        self.argmax[at:at + n] = logits.argmax(-1)
        if self.all is not None:
            self.all[at:at + n] = log_p
        self.done += n
        return log_p


def windows(ids: list[int], window: int):
    """(start, ids[start:start + window]) for windows overlapping by one token: every next token
    is scored exactly once, each window from an empty cache."""
    for start in range(0, len(ids) - 1, window - 1):
        yield start, ids[start: start + window]


def score(model, ids: list[int], window: int = WINDOW, keep: Path | None = None, reference: Scores | None = None):
    """(log-probability of each next token, the argmax at each position) over `ids`, teacher-forced
    through the bundle's own target graph; with `reference` also the mean KL divergence from it."""
    scores = Scores(len(ids) - 1, keep, model.bundle.vocab_size if keep else 0)
    kl = []
    for _, chunk_ids in windows(ids, min(window, model.capacity)):
        for start in range(0, len(chunk_ids) - 1, MAX_ROWS):
            chunk = chunk_ids[start: min(start + MAX_ROWS, len(chunk_ids) - 1)]
            logits = model.target.forward(chunk, np.arange(start, start + len(chunk)), causal_mask(len(chunk)), start)
            at = scores.done
            log_p = scores.add(logits, chunk_ids[start + 1: start + 1 + len(chunk)])
            if reference is not None:
                kl.append(kl_divergence(np.asarray(reference.all[at:at + len(chunk)], np.float64), log_p))
    result = (scores.logprobs, scores.argmax)
    return (*result, float(np.concatenate(kl).mean()) if kl else None) if reference is not None else result


def kl_divergence(reference_log_p: np.ndarray, log_p: np.ndarray) -> np.ndarray:
    """KL(reference || this) per row, from log-distributions [n, V]."""
    return (np.exp(reference_log_p) * (reference_log_p - log_p)).sum(-1)


def quality(bundles: list[str], text: str, threads: int | None = None, window: int = WINDOW,
            peers: tuple[str, ...] = ()) -> list[dict]:
    """One row per bundle (then per peer): perplexity, agreement with and KL divergence from the
    first bundle, a sample answer."""
    from dflash.runtime import Model

    rows, reference = [], None
    with tempfile.TemporaryDirectory(prefix="dflash-quality-") as scratch:
        for bundle in bundles:
            model = Model(bundle, threads=threads)  # one at a time: only one model's weights in memory
            ids = model.encode(prompt=text)
            if len(ids) < 2:
                raise ValueError("the text needs at least two tokens")
            if reference is None:
                first = Scores(0)
                first.logprobs, first.argmax = score(model, ids, window, keep=Path(scratch) / "reference.npy")
                first.all = np.load(Path(scratch) / "reference.npy", mmap_mode="r")
                reference, first_ids, first_model = first, ids, model
                logprobs, argmax, kl = first.logprobs, first.argmax, 0.0
            else:
                if ids != first_ids:
                    raise click.ClickException(f"{bundle} tokenizes the text differently from {bundles[0]}: "
                                               "compare bundles of one model")
                logprobs, argmax, kl = score(model, ids, window, reference=reference)
            answer = model.generate(messages=[{"role": "user", "content": SAMPLE_PROMPT}],
                                    max_new_tokens=SAMPLE_TOKENS).text
            rows.append(row(str(bundle), model.bundle.graphs["target"]["dtype"], ids, min(window, model.capacity),
                            logprobs, argmax, reference, kl, answer))
        if "llamacpp" in peers:
            rows.append(llamacpp_row(first_model, first_ids, window, reference, threads))
    return rows


def row(name, dtype, ids, window, logprobs, argmax, reference, kl, answer) -> dict:
    return {"bundle": name, "dtype": dtype, "tokens": len(ids), "window": window,
            "perplexity": float(np.exp(-logprobs.mean())), "agreement": float((argmax == reference.argmax).mean()),
            "kl_divergence": kl, "sample_prompt": SAMPLE_PROMPT, "sample": answer}


def llamacpp_row(model, ids: list[int], window: int, reference: Scores, threads: int | None) -> dict:
    """The same tokens scored by llama.cpp (llama-cpp-python) on the first bundle's source GGUF,
    in the same windows, and its greedy answer to the same chat prompt."""
    import importlib.util
    import os

    source = Path(model.bundle.source)
    if source.suffix != ".gguf":
        raise click.ClickException(f"--peers llamacpp scores the first bundle's source GGUF, but its source is "
                                   f"{source}: export the first bundle from a .gguf")
    if importlib.util.find_spec("llama_cpp") is None:
        raise click.ClickException("--peers llamacpp needs llama-cpp-python: pip install -e '.[compare]'")
    from llama_cpp import Llama

    window = min(window, model.capacity)
    threads = threads or len(os.sched_getaffinity(0))
    llm = Llama(model_path=str(source), n_ctx=window, n_batch=window, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    scores, kl = Scores(len(ids) - 1), []
    for _, chunk in windows(ids, window):
        llm.reset()
        llm.eval(chunk[:-1])
        at = scores.done
        log_p = scores.add(np.array(llm.scores[:len(chunk) - 1]), chunk[1:])
        kl.append(kl_divergence(np.asarray(reference.all[at:at + len(chunk) - 1], np.float64), log_p))
    prompt = model.encode(messages=[{"role": "user", "content": SAMPLE_PROMPT}])
    llm.reset()
    answer = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        if token in set(model.bundle.eos_token_ids) or len(answer) >= SAMPLE_TOKENS:
            break
        answer.append(int(token))
    name = f"llama.cpp {source.name}"
    return row(name, "gguf", ids, window, scores.logprobs, scores.argmax, reference,
               float(np.concatenate(kl).mean()), model.codec.decode(answer))


def print_table(rows: list[dict]) -> None:
    width = max(len("bundle"), *(len(r["bundle"]) for r in rows))
    click.echo(f"{'bundle':{width}s} {'dtype':5s} {'tokens':>6s} {'perplexity':>10s} {'agrees with first':>17s} "
               f"{'KL from first':>13s}")
    for r in rows:
        click.echo(f"{r['bundle']:{width}s} {r['dtype']:5s} {r['tokens']:6d} {r['perplexity']:10.2f} "
                   f"{r['agreement']:17.1%} {r['kl_divergence']:13.5f}")
    for r in rows:
        click.echo(f"\n{r['bundle']} ({r['dtype']}) answers {r['sample_prompt']!r}:\n{r['sample']}")
