"""Sampling answers with the exported target in ONNX Runtime, as a bundle runs for its users.

An int4 bundle decodes ~3-4x faster here than transformers emulating its MatMuls
(int4_target.py), so the int4 target's own answers are cheap to make this way.  One prompt
at a time (the graph takes one sequence); every step records the target's argmax beside
the sampled token, as sampler.sample does, and a looping answer is stopped early.
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
