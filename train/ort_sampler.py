"""Sampling answers with the exported target in ONNX Runtime, and labelling them, as a bundle
runs for its users.

An int4 bundle decodes ~3-4x faster here than transformers emulating its MatMuls
(int4_target.py), so the int4 target's own answers are cheap to make this way.  One prompt
at a time (the graph takes one sequence); every step records the target's argmax beside
the sampled token, as sampler.sample does, and a looping answer is stopped early.
The labeller gives a fit the taps and logits the runtime's drafter will read, to the bit.
"""

from __future__ import annotations

import numpy as np

from .sampler import Sampled, looping


class OrtSampler:
    """`sample(prompts, ...)` with the same contract as sampler.sample, on a bundle's target graph."""

    def __init__(self, bundle, threads: int | None = None):
        from dflash.runtime import Model

        self.model = Model(bundle, threads=threads)
        self.target = self.model.target
        self.dtype = self.model.bundle.graphs["target"]["dtype"]

    def sample(self, prompts: list[list[int]], max_new_tokens: int, end_ids: set[int], temperature: float = 0.7,
               top_p: float = 0.95, seed: int = 0) -> list[Sampled]:
        from dflash.runtime.sampling import Sampler, SamplingParams

        results = []
        for k, prompt in enumerate(prompts):
            sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=[seed, k]))  # a seed per row
            results.append(self._answer(prompt, max_new_tokens, end_ids, sampler))
        return results

    def _answer(self, prompt: list[int], max_new_tokens: int, end_ids: set[int], sampler) -> Sampled:
        # The runtime's own fitting: a prompt the cache cannot hold is an error (cutting it would store
        # a row whose rebuilt prompt is not what the answer followed); the answer stops when it is full.
        prompt, budget = self.model._fit(prompt, max_new_tokens, truncate=None)
        one, past = np.ones((1, 1), np.bool_), len(prompt)
        logits, out = self.target.prefill(prompt), Sampled([], [], False)
        while len(out.tokens) < budget:
            out.greedy.append(int(np.argmax(logits)))
            token = sampler(logits)
            out.tokens.append(token)
            if token in end_ids:
                out.ended = True
                break
            if looping(out.tokens):
                break
            logits = self.target.forward([token], [past], one, past)[0]
            past += 1
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
