"""Drafters: where speculative tokens come from.

Every drafter has the same three calls, so new kinds (DFlash) plug into the same loop:
  begin()                      a generation starts
  propose(history, room)       a Draft of at most `room` nodes after `history`
  observe(draft, rows, ...)    which rows the target accepted, and what the step cost
"""

from __future__ import annotations

import time

import numpy as np

from .policy import ALONE, MAX_DRAFT, Acceptance, Beside, Policy
from .speculative import Draft, accepted_along
from .suffix import AnswerMemory, SuffixIndex


class Drafter:
    wants_taps = False  # True: the loop hands it the target's taps of committed tokens (add_context)

    def __init__(self, policy: Policy):
        self.policy = policy
        self.acceptance = Acceptance()
        self.main: list[int] = []  # node indices of the last draft's main chain

    def begin(self) -> None:
        pass

    def remember(self, answer: list[int]) -> None:
        """A generation this drafter served is finished: `answer` is what the target wrote."""

    def observe(self, draft: Draft, rows: list[int], draft_ms: float, verify_ms: float) -> None:
        self.policy.cost.observe(len(draft) + 1, verify_ms)
        if self.main:
            self._acceptance().observe(len(self.main), accepted_along(rows, self.main))

    def _acceptance(self) -> Acceptance:
        return self.acceptance


def lookup_draft(tokens: list[int], k: int, max_ngram: int = 3) -> tuple[list[int], int]:
    """Prompt lookup: the k tokens that followed the latest earlier match of the last n
    tokens (n from max_ngram down to 1), and n; ([], 0) if nothing matches."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k], n
    return [], 0


class NgramLookup:
    """lookup_draft over a text that grows (a generation's history), each call O(new tokens): where
    every 1..max_ngram-gram last ended, indexed as the text grows; a text that is not the last one
    grown starts the index over.  The scan costs ~0.4 ms a call at 1K tokens, a tenth of an int4 step."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.text: list[int] = []  # the tokens indexed: every n-gram ending in them
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> where it last ended

    def __call__(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """lookup_draft(tokens, k, max_ngram)."""
        if len(tokens) <= len(self.text) or tokens[: len(self.text)] != self.text:
            self.text, self.latest = [], {}
        # index the n-grams ending before the last token (the tail's own must not match itself)
        for end in range(len(self.text), len(tokens) - 1):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.latest[tuple(tokens[end - n + 1 : end + 1])] = end
        self.text = tokens[: len(tokens) - 1]
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            end = self.latest.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k], n
        return [], 0


class LookupDrafter(Drafter):
    """Copies what followed an earlier occurrence of the latest n-gram (no model). With a
    `memory` of the answers it served, where one continues a longer suffix than the prompt does,
    it drafts from that (a repeated request is drafted from its last answer); with a `corpus`
    (the `suffix` drafter), where neither offers 2 tokens to match, it drafts from the target's
    earlier answers instead (runtime/suffix.py)."""

    def __init__(self, policy: Policy, max_ngram: int = 3, corpus: SuffixIndex | None = None,
                 memory: AnswerMemory | None = None):
        super().__init__(policy)
        self.max_ngram = max_ngram
        self.ngrams = NgramLookup(max_ngram)
        self.corpus, self.memory = corpus, memory
        # Longer matches continue correctly more often: one acceptance record per match length,
        # and one each for the memory's and the corpus's drafts.
        self.by_source = {n: Acceptance() for n in (*range(1, max_ngram + 1), "memory", "corpus")}
        self.source: int | str = 0

    def remember(self, answer: list[int]) -> None:
        if self.memory is not None:
            self.memory.add(answer)

    def propose(self, history: list[int], room: int) -> Draft:
        limit = min(room, MAX_DRAFT)
        tokens, self.source = self.ngrams(history, limit)
        if self.memory is not None:
            remembered, order = self.memory.match(history)
            if order > self.source:
                tokens, self.source = remembered[:limit], "memory"
        if self.corpus is not None and self.source in (0, 1):
            from_corpus = self.corpus.draft(history)[:limit]
            if from_corpus:
                tokens, self.source = from_corpus, "corpus"
        k = self.policy.chain_length(self.by_source[self.source], 0.0, len(tokens)) if tokens else 0
        self.main = list(range(k))
        return Draft.chain(tokens[:k])

    def _acceptance(self) -> Acceptance:
        return self.by_source[self.source]


class Calibration:
    """P(a draft token is accepted, once reached) by the drafter's own probability for it:
    running rates in probability bins, each starting from its bin's middle."""

    BINS, WEIGHT = 10, 2.0

    def __init__(self, decay: float = 0.995):
        self.accepted = np.zeros(self.BINS)
        self.tried = np.zeros(self.BINS)
        self.decay = decay

    def _bin(self, p: float) -> int:
        return min(int(p * self.BINS), self.BINS - 1)

    def __call__(self, p: float) -> float:
        b = self._bin(p)
        prior = (b + 0.5) / self.BINS
        return (self.accepted[b] + self.WEIGHT * prior) / (self.tried[b] + self.WEIGHT)

    def observe_chain(self, confidence: list[float], main: list[int], rows: list[int]) -> None:
        """Learn from a verified chain: its tokens' confidences up to the first rejected one."""
        for depth, p in enumerate(confidence[: len(main)]):
            accepted = depth + 1 < len(rows) and rows[depth + 1] == main[depth] + 1
            self.observe(p, accepted)
            if not accepted:
                break

    def observe(self, p: float, accepted: bool) -> None:
        b = self._bin(p)
        self.accepted[b] = self.decay * self.accepted[b] + accepted
        self.tried[b] = self.decay * self.tried[b] + 1


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max())
    return z / z.sum()


class ModelDrafter(Drafter):
    """A small causal LM on its own session and cache: drafts a chain autoregressively;
    with `tree`, also offers the drafter's next choices at each depth as side branches.

    Its cache holds `fed`, the tokens whose K/V rows it has computed.  Rows stay valid as
    long as the tokens before them match the history, so only the tail that differs
    (usually the target's bonus token) is fed again before drafting."""

    ALTERNATIVES = 3  # side-branch candidates per depth

    def __init__(self, policy: Policy, model, tree: bool = False):
        super().__init__(policy)
        self.model, self.tree = model, tree
        self.fed: list[int] = []
        self.checked = 0  # fed[:checked] is known to equal the history
        self.ms_per_token = model.measure_cost([1])[1]
        self.calibration = Calibration()
        self.confidence: list[float] = []  # the drafter's probability of each chain token

    def observe(self, draft: Draft, rows: list[int], draft_ms: float, verify_ms: float) -> None:
        super().observe(draft, rows, draft_ms, verify_ms)
        self.calibration.observe_chain(self.confidence, self.main, rows)

    def begin(self) -> None:
        self.checked = 0  # a new prompt: compare the whole cached prefix once

    def _catch_up(self, history: list[int]) -> np.ndarray:
        """Feed the history's uncached tail; the logits after its last token."""
        valid, limit = self.checked, min(len(self.fed), len(history) - 1)
        while valid < limit and self.fed[valid] == history[valid]:
            valid += 1
        self.fed = self.fed[:valid]  # before feeding: a failure below leaves only valid rows listed
        logits = self.model.prefill(history[valid:], past=valid)
        self.fed = list(history)
        self.checked = len(history)
        return logits

    def propose(self, history: list[int], room: int) -> Draft:
        """Draft while the next token is worth its cost: the chance of reaching it (the
        calibrated confidences of the tokens before it) times the typical acceptance."""
        self.main, self.confidence = [], []
        limit = min(room, MAX_DRAFT)
        planned = self.policy.chain_length(self.acceptance, self.ms_per_token, limit)
        if planned == 0:
            return Draft()
        fixed = self.policy.fixed is not None
        rate = self.policy.rate(self.acceptance, planned, self.ms_per_token)
        logits = self._catch_up(history)
        chain, options, reach = [], [], [1.0]
        one = np.ones((1, 1), np.bool_)
        for depth in range(planned if fixed else limit):
            if depth:
                if not fixed and not self._worth_drafting(reach[-1], depth, rate):
                    break
                position = len(self.fed)
                start = time.perf_counter()
                logits = self.model.forward([chain[-1]], [position], one, position)[0]
                self.fed.append(chain[-1])  # only once its row is written (a failed step leaves none)
                # The cost per draft token, from single steps only: a catch-up after steps
                # without drafts feeds many rows at once and would make drafting look dear.
                ms = (time.perf_counter() - start) * 1e3
                self.ms_per_token += 0.1 * (ms - self.ms_per_token)
            p = softmax(logits)
            top = np.argpartition(p, -1 - self.ALTERNATIVES)[-1 - self.ALTERNATIVES:]
            top = top[np.argsort(-p[top])]
            options.append([(int(t), float(p[t])) for t in top])
            chain.append(int(top[0]))
            self.confidence.append(float(p[top[0]]))
            reach.append(reach[-1] * self.calibration(self.confidence[-1]))
        while not fixed and len(chain) > 1 and reach[len(chain)] < self._row_cost(len(chain) - 1) * rate:
            chain.pop()  # drafted but not worth a verify row
        if not self.tree:
            self.main = list(range(len(chain)))
            return Draft.chain(chain)
        return self._tree(chain, options, reach, room, rate)

    def _row_cost(self, depth: int) -> float:
        """What verifying one more row costs after `depth` drafts (ms)."""
        return self.policy.cost(depth + 2) - self.policy.cost(depth + 1)

    def _worth_drafting(self, reach: float, depth: int, rate: float) -> bool:
        gain = reach * self.acceptance.rates()[depth]
        return gain > (self.ms_per_token + self._row_cost(depth)) * rate

    def _tree(self, chain: list[int], options: list, reach: list[float], room: int, rate: float) -> Draft:
        """The chain plus the side branches worth their verify rows: a branch at depth i
        is taken when the chain's i-th token is rejected and the target picks it instead."""
        candidates = []
        for depth, choices in enumerate(options[: len(chain)]):
            (_, p_main), *others = choices
            missed = reach[depth] - reach[depth + 1]  # P(reach depth i, reject the chain's token)
            for token, p in others:
                candidates.append((missed * p / max(1 - p_main, 1e-6), depth, token))
        candidates.sort(reverse=True)
        side: dict[int, list[int]] = {}
        rows = len(chain) + 1
        for gain, depth, token in candidates:
            if rows - 1 >= room or not self.policy.worth_adding(gain, rows, rate):
                break
            if self.policy.fixed is not None and side.get(depth):
                continue  # fixed mode: one side branch per depth
            side.setdefault(depth, []).append(token)
            rows += 1
        draft, parent = Draft(), -1
        for depth, token in enumerate(chain):  # parents first: depth by depth
            self.main.append(len(draft.tokens))
            draft.tokens.append(token)
            draft.parents.append(parent)
            for other in side.get(depth, []):
                draft.tokens.append(other)
                draft.parents.append(parent)
            parent = self.main[-1]
        return draft


class HybridDrafter(Drafter):
    """One verify over a trained drafter's candidates (DFlash or EAGLE-3) and, when the text so far
    repeats itself or the corpus of earlier answers continues it, the lookup continuation as its
    own branch (merged where the two agree), so copied stretches and new text are both covered.

    The copy is planned first: it costs nothing to propose, and where it continues a long match it
    is usually right.  The drafter then drafts only what its branch adds to the copy's: the target
    can take the drafter's branch only where the copy's first token is wrong, so where the copy is
    reliable and verify rows are dear (int4) the drafter is not called at all."""

    wants_taps = True
    LOOKUP_MIN_MATCH = 2  # a one-token match continues correctly too rarely to pay its rows

    def __init__(self, policy: Policy, drafter: Drafter, lookup: LookupDrafter):
        super().__init__(policy)
        self.drafter, self.lookup = drafter, lookup
        self.copied: list[int] = []  # node indices of the lookup branch

    def begin(self) -> None:
        self.drafter.begin()

    def remember(self, answer: list[int]) -> None:
        self.lookup.remember(answer)

    def add_context(self, rows: np.ndarray) -> None:
        self.drafter.add_context(rows)

    def propose(self, history: list[int], room: int) -> Draft:
        room = min(room, MAX_DRAFT)
        copied = self.lookup.propose(history, room)
        if not self._lookup_branch():
            copied = Draft()
        draft = self.drafter.propose(history, room - len(copied), self._beside(len(copied)))
        self.main = self.drafter.main
        children = {(p, t): node for node, (t, p) in enumerate(zip(draft.tokens, draft.parents))}
        parent, self.copied = -1, []
        for token in copied.tokens:  # follow the drafter's tree while it agrees, then branch off
            node = children.get((parent, token))
            if node is None:
                node = len(draft.tokens)
                draft.tokens.append(token)
                draft.parents.append(parent)
            self.copied.append(node)
            parent = node
        return draft

    def observe(self, draft: Draft, rows: list[int], draft_ms: float, verify_ms: float) -> None:
        self.drafter.observe(draft, rows, draft_ms, verify_ms)
        if self._lookup_branch() and self.copied:
            self.lookup.by_source[self.lookup.source].observe(len(self.copied), accepted_along(rows, self.copied))

    def _beside(self, copied: int) -> Beside:
        """What a copy of `copied` tokens holds for the drafter's branch to add to."""
        if not copied:
            return ALONE
        acceptance = self.lookup.by_source[self.lookup.source]
        return Beside(rows=1 + copied, tokens=1 + float(acceptance.reach(copied).sum()),
                      share=1 - float(acceptance.rates()[0]))

    def _lookup_branch(self) -> bool:
        """Whether the last lookup draft earns its rows: a match of 2+ tokens, or the memory's or
        corpus's (whose matches are 2+ tokens long)."""
        source = self.lookup.source
        return source in ("memory", "corpus") or source >= self.LOOKUP_MIN_MATCH
