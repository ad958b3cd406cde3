"""The public API: load a bundle, generate text (whole or streamed), with stats."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from .bundle import load_bundle
from .sampling import Sampler, SamplingParams
from .speculative import greedy_chain, lookup_draft
from .target import Target
from .text import StopMatcher, StreamDecoder, TextCodec


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0  # from the first new token to the last
    steps: int = 0  # target calls after prefill

    @property
    def mean_accept_len(self) -> float:
        """Tokens committed per target call after prefill (1.0 for plain decoding)."""
        return (self.new_tokens - 1) / self.steps if self.steps else 1.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding (the first comes from prefill)."""
        return (self.new_tokens - 1) / (self.decode_ms / 1e3) if self.decode_ms > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else 0.0

    def summary(self) -> str:
        return (f"prompt {self.prompt_tokens} tokens, prefill {self.prefill_ms:.0f} ms "
                f"({self.prefill_tokens_per_s:.0f} tok/s); {self.new_tokens} new tokens, "
                f"decode {self.decode_tokens_per_s:.1f} tok/s")


@dataclass
class Result:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", "error"
    stats: Stats = field(default_factory=Stats)


class Model:
    """A target model bundle, ready to generate.

    >>> model = Model("bundles/smollm2")
    >>> print(model.generate(messages=[{"role": "user", "content": "Hi!"}]).text)
    """

    def __init__(self, bundle_dir: str | Path, threads: int | None = None, cores: list[int] | None = None):
        self.bundle = load_bundle(bundle_dir)
        self.codec = TextCodec(self.bundle)
        self.target = Target(self.bundle, threads, cores)
        self.eos_ids = set(self.bundle.eos_token_ids)
        self.capacity = self.bundle.max_len
        self._busy = threading.Lock()

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
               input_ids: list[int] | None = None) -> list[int]:
        """Token ids of a plain prompt, chat messages (the model's template), or ids as given."""
        if sum(x is not None for x in (prompt, messages, input_ids)) != 1:
            raise ValueError("give exactly one of prompt=, messages= or input_ids=")
        if input_ids is not None:
            ids = [int(i) for i in input_ids]
            bad = [i for i in ids if not 0 <= i < self.bundle.vocab_size]
            if bad:
                raise ValueError(f"input_ids holds {bad[0]}, outside the vocabulary 0..{self.bundle.vocab_size - 1}")
        elif messages is not None:
            ids = self.codec.encode_chat(messages)
        else:
            ids = self.codec.encode_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty: it encodes to no tokens")
        return ids

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               input_ids: list[int] | None = None, max_new_tokens: int = 128,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int | None = None, stop=None, ignore_eos: bool = False,
               drafter: str | None = None, draft_len: int = 8) -> "Generation":
        """An iterator of text pieces; its `.result` holds tokens, finish reason and stats.

        temperature 0 is greedy decoding; `stop` is a string or a list of strings that end
        the text (not included); `ignore_eos` decodes past EOS up to max_new_tokens.
        `drafter="lookup"` speculates `draft_len` tokens a step by prompt lookup (greedy only)."""
        ids = self.encode(prompt, messages, input_ids)
        params = SamplingParams(temperature, top_k, top_p, seed)
        if drafter not in (None, "lookup"):
            raise ValueError(f"unknown drafter {drafter!r}; available: lookup")
        if drafter and not params.greedy:
            raise ValueError("speculative decoding here is greedy only so far: use temperature=0")
        self._check_length(len(ids), max_new_tokens)
        eos = set() if ignore_eos else self.eos_ids
        return Generation(self, ids, params, max_new_tokens, stop, eos, drafter, draft_len)

    def generate(self, prompt: str | None = None, **kwargs) -> Result:
        generation = self.stream(prompt, **kwargs)
        for _ in generation:
            pass
        return generation.result

    def _check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
        if prompt_tokens >= self.capacity:
            raise ValueError(f"the prompt has {prompt_tokens} tokens but this bundle holds "
                             f"{self.capacity} in all: shorten the prompt, or re-export with a "
                             "larger --max-len")
        # Generating n tokens feeds n-1 of them back through the cache.
        if prompt_tokens + max_new_tokens - 1 > self.capacity:
            raise ValueError(f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds the bundle's capacity of {self.capacity} tokens: lower "
                             f"max_new_tokens to {self.capacity - prompt_tokens + 1} or re-export "
                             "with a larger --max-len")

    def _decode_tokens(self, token: int, past: int, sampler: Sampler, stats: Stats) -> Iterator[list[int]]:
        """Plain autoregressive decoding after `token`: yields one new token at a time."""
        one = np.ones((1, 1), np.bool_)
        while True:
            logits = self.target.forward([token], [past], one, past)
            past += 1
            stats.steps += 1
            token = sampler(logits[0])
            yield [token]


class Generation:
    """One generation in progress: iterate for text pieces, then read `.result`."""

    def __init__(self, model: Model, ids: list[int], params: SamplingParams, max_new_tokens: int,
                 stop, eos_ids: set[int], drafter: str | None = None, draft_len: int = 0):
        self.model, self.ids, self.params, self.eos_ids = model, ids, params, eos_ids
        self.max_new_tokens = max_new_tokens
        self.drafter, self.draft_len = drafter, draft_len
        self.stops = StopMatcher(stop)
        self.result = Result(stats=Stats(prompt_tokens=len(ids)))

    def __iter__(self) -> Iterator[str]:
        model = self.model
        if not model._busy.acquire(blocking=False):
            raise RuntimeError("this Model is already generating (in another thread or an unfinished "
                               "stream); finish that one first, or load one Model per thread")
        try:
            yield from self._run()
        except GeneratorExit:  # the consumer stopped early: not an error
            raise
        except BaseException:
            self.result.finish_reason = "error"
            raise
        finally:
            model._busy.release()

    def _token_chunks(self, stats: Stats) -> Iterator[list[int]]:
        """Prefill, the first token, then the chosen decoding loop's chunks of new tokens."""
        target, sampler = self.model.target, Sampler(self.params)
        start = time.perf_counter()
        first = sampler(target.prefill(self.ids))
        stats.prefill_ms = (time.perf_counter() - start) * 1e3
        yield [first]
        if self.drafter == "lookup":
            yield from greedy_chain(target, self.ids + [first], lookup_draft, self.draft_len, stats)
        else:
            yield from self.model._decode_tokens(first, len(self.ids), sampler, stats)

    def _run(self) -> Iterator[str]:
        result, stats = self.result, self.result.stats
        decoder = StreamDecoder(self.model.codec)
        chunks = self._token_chunks(stats)
        first_token_at = None
        for chunk in chunks:
            first_token_at = first_token_at or time.perf_counter()
            for token in chunk:
                result.tokens.append(token)
                if token in self.eos_ids:
                    result.finish_reason = "stop"
                    break
                piece, stopped = self.stops.feed(decoder.push([token]))
                if piece:
                    yield piece
                if stopped:
                    result.finish_reason = "stop"
                    break
                if len(result.tokens) >= self.max_new_tokens:
                    result.finish_reason = "length"
                    break
            if result.finish_reason:
                break
        chunks.close()
        stats.decode_ms = (time.perf_counter() - first_token_at) * 1e3
        stats.new_tokens = len(result.tokens)
        tail = self.stops.flush()
        if tail:
            yield tail
        result.text = self.stops.text
