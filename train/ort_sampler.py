"""Sampling answers with the exported target in ONNX Runtime, and labelling them, as a bundle
runs for its users.

An int4 bundle decodes ~3-4x faster here than transformers emulating its MatMuls
(int4_target.py), so the int4 target's own answers are cheap to make this way.  Every step
records the target's argmax beside the sampled token, as sampler.sample does, and a looping
answer is stopped early.  With the bundle's batched graph (`dflash-export target --batched`)
`batch` answers decode together: a step of 16 rows costs little more than a step of one (the
quantized weights are read once for all), and each sequence gets the bits it gets alone, so the
answers are the ones the one-at-a-time path samples, token for token.
The labeller gives a fit the taps and logits the runtime's drafter will read, to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from .sampler import Sampled, looping


class OrtSampler:
    """`sample(prompts, ...)` with the same contract as sampler.sample, on a bundle's target graph."""

    def __init__(self, bundle, threads: int | None = None, batch: int = 1):
        from dflash.runtime import Model

        self.model = Model(bundle, threads=threads)
        self.target = self.model.target
        self.dtype = self.model.bundle.graphs["target"]["dtype"]
        self.batched = BatchedTarget(self.model.bundle, batch, threads) if batch > 1 else None

    def sample(self, prompts: list[list[int]], max_new_tokens: int, end_ids: set[int], temperature: float = 0.7,
               top_p: float = 0.95, seed: int = 0) -> list[Sampled]:
        from dflash.runtime.sampling import Sampler, SamplingParams

        # a seed per row, so an answer does not depend on the others or on the batch
        samplers = [Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=[seed, k]))
                    for k in range(len(prompts))]
        if self.batched:
            fitted = [self.model._fit(p, max_new_tokens, truncate=None) for p in prompts]
            return self.batched.answer(fitted, end_ids, samplers)
        return [self._answer(p, max_new_tokens, end_ids, s) for p, s in zip(prompts, samplers)]

    def _answer(self, prompt: list[int], max_new_tokens: int, end_ids: set[int], sampler) -> Sampled:
        # The runtime's own fitting: a prompt the cache cannot hold is an error (cutting it would store
        # a row whose rebuilt prompt is not what the answer followed); the answer stops when it is full.
        prompt, budget = self.model._fit(prompt, max_new_tokens, truncate=None)
        one, answer, out = np.ones((1, 1), np.bool_), _Answer(0, len(prompt), budget, sampler), Sampled([], [], False)
        logits = self.target.prefill(prompt)
        while _record(answer, out, logits, end_ids):  # the last token needs no forward
            logits = self.target.forward([answer.token], [answer.past], one, answer.past)[0]
            answer.past += 1
        return out


class OrtLabeller:
    """`labeller(ids)` -> (tap features [L, T*H], logits [L, V]) as torch tensors: a causal pass of
    the bundle's target graph over one sequence (LabelCache.build's contract, fit.py)."""

    def __init__(self, bundle, taps: list[int], vocab_size: int, threads: int | None = None):
        from dflash.runtime.bundle import load_bundle
        from dflash.runtime.target import Target

        self.bundle = load_bundle(bundle)
        if list(self.bundle.taps) != list(taps) or self.bundle.vocab_size != vocab_size:
            raise ValueError(f"{bundle} taps {self.bundle.taps} and vocabulary {self.bundle.vocab_size} differ from the "
                             f"fitted target's {taps} and {vocab_size}: export both bundles from the same model")
        self.target = Target(self.bundle, threads=threads)

    def __call__(self, ids: list[int]):
        import torch

        from dflash.runtime.target import MAX_ROWS, causal_mask

        if len(ids) > self.target.capacity:
            raise ValueError(f"a {len(ids)}-token sequence does not fit the bundle's cache of {self.target.capacity}")
        features = np.empty((len(ids), len(self.bundle.taps) * self.bundle.hidden_size), np.float32)
        logits = np.empty((len(ids), self.bundle.vocab_size), np.float32)
        for start in range(0, len(ids), MAX_ROWS):
            chunk = ids[start : start + MAX_ROWS]
            s = len(chunk)
            logits[start : start + s] = self.target.forward(chunk, np.arange(start, start + s), causal_mask(s), start)
            features[start : start + s] = self.target.taps(s)
        return torch.from_numpy(features), torch.from_numpy(logits)


@dataclass
class _Answer:
    """A prompt being answered in a slot of the batch."""
    k: int  # the prompt's index
    past: int  # its cached rows
    budget: int  # tokens it may write in all
    sampler: object
    token: int = -1  # the last sampled token, fed at the next step


def _record(answer: _Answer, out: Sampled, logits: np.ndarray, end_ids: set[int]) -> bool:
    """Sample the next token of `answer` from `logits`; whether it goes on."""
    out.greedy.append(int(np.argmax(logits)))
    answer.token = answer.sampler(logits)
    out.tokens.append(answer.token)
    if answer.token in end_ids:
        out.ended = True
        return False
    return len(out.tokens) < answer.budget and not looping(out.tokens)


class BatchedTarget:
    """The bundle's batched target graph over `batch` slots, each a sequence with its own KV cache:
    `answer` keeps the slots full from a queue of prompts (a finished answer's slot takes the
    next prompt), and the live slots are always 0..n-1 so a step runs n rows."""

    def __init__(self, bundle, batch: int, threads: int | None = None):
        from dflash.runtime.bundle import BundleError
        from dflash.runtime.session import make_session

        graph = bundle.graphs.get("target_batched")
        if graph is None:
            raise BundleError(f"{bundle.folder} has no batched target graph: export it with `dflash-export target "
                              "SRC --batched`, or answer one prompt at a time (--batch 1)")
        if graph["dtype"] != "fp32" and graph.get("matmul", "nbits") == "nbits":
            raise BundleError(f"{bundle.folder}'s MatMulNBits rows round differently by row count, so a batch would "
                              "change the answers: export it with --matmul q4 (or q8), or use --batch 1")
        self.bundle, self.batch = bundle, batch
        self.session = make_session(bundle.graph_path("target_batched"), bundle, threads)
        self.capacity = 0
        self.ids, self.pos = np.zeros((batch, 1), np.int64), np.zeros((batch, 1), np.int64)
        self.pasts = np.zeros(batch, np.int64)
        self.logits = np.zeros((batch, 1, bundle.vocab_size), np.float32)
        self.one = np.ones((1, 1), np.bool_)

    def _allocate(self, capacity: int) -> None:
        """Caches [batch, Hkv, capacity, D] for every layer, and a binding per live count."""
        kv = self.bundle.kv
        shape = (self.batch, kv["kv_heads"], capacity, kv["head_dim"])
        self.caches = [np.zeros(shape, np.float32) for _ in range(2 * kv["layers"])]  # key_0, value_0, ...
        self.capacity = capacity
        self.steps = {n: self._bind(n) for n in range(1, self.batch + 1)}

    def _bind(self, n: int, slot: int = 0, ids=None, pos=None, past=None, logits=None) -> ort.IOBinding:
        """A binding over slots slot..slot+n-1 (the step's own row buffers unless given)."""
        binding = self.session.io_binding()
        value = ort.OrtValue.ortvalue_from_numpy
        binding.bind_ortvalue_input("input_ids", value(self.ids[:n] if ids is None else ids))
        binding.bind_ortvalue_input("position_ids", value(self.pos[:n] if pos is None else pos))
        binding.bind_ortvalue_input("tree_mask", value(self.one if ids is None else np.tri(ids.shape[1], dtype=bool)))
        binding.bind_ortvalue_input("past_len", value(self.pasts[:n] if past is None else past))
        for i, cache in enumerate(self.caches):
            view = value(cache[slot : slot + n])  # the slots' own memory: updated in place
            kind = "key" if i % 2 == 0 else "value"
            binding.bind_ortvalue_input(f"past_{kind}_{i // 2}", view)
            binding.bind_ortvalue_output(f"present_{kind}_{i // 2}", view)
        binding.bind_ortvalue_output("logits", value(self.logits[:n] if logits is None else logits))
        binding.bind_output("taps")
        return binding

    def _prefill(self, slot: int, prompt: list[int]) -> np.ndarray:
        """The prompt into the slot's cache, in chunks as Target.prefill does: the last logits."""
        from dflash.runtime.target import MAX_ROWS

        for start in range(0, len(prompt), MAX_ROWS):
            chunk = np.array([prompt[start : start + MAX_ROWS]], np.int64)
            s = chunk.shape[1]
            logits = np.zeros((1, s, self.bundle.vocab_size), np.float32)
            binding = self._bind(1, slot, chunk, np.arange(start, start + s)[None], np.array([start], np.int64), logits)
            self.session.run_with_iobinding(binding)
        return logits[0, -1]

    def _move(self, src: int, dst: int, rows: int) -> None:
        for cache in self.caches:
            cache[dst, :, :rows] = cache[src, :, :rows]

    def answer(self, fitted: list[tuple[list[int], int]], end_ids: set[int], samplers: list) -> list[Sampled]:
        """Sampled answers to the (prompt, budget) pairs, each drawn by its own sampler."""
        if not fitted:
            return []
        need = max(len(p) + b for p, b in fitted)
        if need > self.capacity:
            self._allocate(min(self.bundle.max_len, max(need, 2 * self.capacity)))
        out = [Sampled([], [], False) for _ in fitted]
        queue, live = list(range(len(fitted))), []

        def start(slot: int) -> _Answer | None:
            """The next queued prompt that needs more than its first token, prefilled into `slot`."""
            while queue:
                k = queue.pop(0)
                prompt, budget = fitted[k]
                a = _Answer(k, len(prompt), budget, samplers[k])
                if _record(a, out[k], self._prefill(slot, prompt), end_ids):
                    return a
            return None

        while len(live) < self.batch and queue:  # fill the slots
            a = start(len(live))
            if a is not None:
                live.append(a)
        while live:
            n = len(live)
            for i, a in enumerate(live):
                self.ids[i, 0], self.pos[i, 0], self.pasts[i] = a.token, a.past, a.past
            self.session.run_with_iobinding(self.steps[n])
            finished = []
            for i, a in enumerate(live):
                a.past += 1
                if not _record(a, out[a.k], self.logits[i, 0], end_ids):
                    finished.append(i)
            # A finished slot takes the next prompt, or else the last live slot's rows, so the live
            # slots stay 0..n-1 (from the end: every slot after i is live by then).
            for i in reversed(finished):
                a = start(i)
                if a is not None:
                    live[i] = a
                    continue
                last = live.pop()
                if i < len(live):
                    self._move(len(live), i, last.past)
                    live[i] = last
        return out
