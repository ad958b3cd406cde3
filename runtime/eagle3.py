"""EAGLE-3 heads at run time: one head call per draft depth.

A head row pairs a feature with the token after it: the target's tap states of committed
position j with the token at j+1, or, past the committed text, the head's own output state of
the parent row with the drafted token. Its cache holds committed rows only: each propose()
first runs the target features of the tokens the last verify committed (their rows stay), then
drafts in scratch rows after them, which the next call overwrites.

`eagle3` drafts a chain, one row per call, while the calibrated confidence pays for the verify
rows. `eagle3-tree` is EAGLE-2's dynamic tree: each depth expands the TOP_K best frontier nodes
(by cumulative log-prob) in one call, and the draft keeps the best nodes overall. Tree rows must
see only their ancestors, so each depth's call re-runs the tree's earlier rows with the tree mask.
"""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort

from .bundle import Bundle, new_cache
from .drafters import Calibration, Drafter
from .policy import ALONE, MAX_DRAFT, Beside, Policy
from .session import make_session, run_pinned
from .speculative import Draft


class Eagle3Session:
    """The head's graph behind IOBinding: inputs and outputs live in numpy buffers allocated once
    (grown when a call needs more rows), bound once per (target rows, own rows) shape, and its KV
    cache is updated in place. A draft makes a call per depth, so per-call binding would cost as
    much as the head's own work."""

    def __init__(self, bundle: Bundle, threads: int | None = None, cores: list[int] | None = None):
        info = bundle.manifest["eagle3"]
        self.cores = set(cores) if cores else None
        self.session = make_session(bundle.graph_path("eagle3"), bundle, threads, cores)
        self.capacity, self.hidden = info["capacity"], info["hidden_size"]
        self.tap_columns = bundle.tap_columns(info["taps"])
        self.key, self.value = new_cache(info["kv"], self.capacity), new_cache(info["kv"], self.capacity)
        self._caches = [ort.OrtValue.ortvalue_from_numpy(c) for c in (self.key, self.value)]
        self.features_width = len(self.tap_columns)
        self.top_k = {o.name: o for o in self.session.get_outputs()}["top_logprobs"].shape[-1]
        self._past = np.zeros((), np.int64)
        self._grow(64)

    def _grow(self, rows: int) -> None:
        """Row buffers for calls of up to `rows` rows; the bindings made on the old ones go."""
        self.rows = rows
        self._features = np.zeros((1, rows, self.features_width), np.float32)
        self._states = np.zeros((1, rows, self.hidden), np.float32)
        self._tokens = np.zeros((1, rows), np.int64)
        self._positions = np.zeros((1, rows), np.int64)
        self._masks: dict[int, np.ndarray] = {}
        self._top_logprobs = np.zeros((1, rows, self.top_k), np.float32)
        self._top_ids = np.zeros((1, rows, self.top_k), np.int64)
        self._out = np.zeros((1, rows, self.hidden), np.float32)
        self._bindings: dict[tuple[int, int], ort.IOBinding] = {}

    def _binding(self, n: int, m: int) -> ort.IOBinding:
        """The binding for calls of N target rows then M own rows, made once per shape."""
        binding = self._bindings.get((n, m))
        if binding is None:
            r = n + m
            value = ort.OrtValue.ortvalue_from_numpy
            binding = self.session.io_binding()
            binding.bind_ortvalue_input("features", value(self._features[:, :n]))
            binding.bind_ortvalue_input("states", value(self._states[:, :m]))
            binding.bind_ortvalue_input("token_ids", value(self._tokens[:, :r]))
            binding.bind_ortvalue_input("position_ids", value(self._positions[:, :r]))
            binding.bind_ortvalue_input("attention_mask", value(self._masks.setdefault(r, np.zeros((r, r), np.bool_))))
            binding.bind_ortvalue_input("past_len", value(self._past))
            for name, cache in zip(("key", "value"), self._caches):
                binding.bind_ortvalue_input(f"past_{name}_0", cache)
                binding.bind_ortvalue_output(f"present_{name}_0", cache)  # new rows written in place
            binding.bind_ortvalue_output("top_logprobs", value(self._top_logprobs[:, :r]))
            binding.bind_ortvalue_output("top_ids", value(self._top_ids[:, :r]))
            binding.bind_ortvalue_output("hidden", value(self._out[:, :r]))
            self._bindings[n, m] = binding
        return binding

    def run(self, features: np.ndarray, states: np.ndarray, tokens, positions, mask: np.ndarray, past: int):
        """Rows (target features first, then own states) written at past..: per row the top
        log-probs and target ids [R, K], and the output states [R, H]."""
        n, m, r = len(features), len(states), len(tokens)
        if past + r > self.capacity:
            raise RuntimeError(f"EAGLE-3 head cache full: {past} + {r} rows > {self.capacity}")
        if r > self.rows:
            self._grow(max(r, 2 * self.rows))
        binding = self._binding(n, m)
        self._features[0, :n] = np.asarray(features, np.float32).reshape(n, self.features_width)
        self._states[0, :m] = np.asarray(states, np.float32).reshape(m, self.hidden)
        self._tokens[0, :r] = tokens
        self._positions[0, :r] = positions
        self._masks[r][...] = mask
        self._past[...] = past
        run_pinned(self.session, binding, self.cores)
        # copies: a tree draft keeps states of earlier calls
        return self._top_logprobs[0, :r].copy(), self._top_ids[0, :r].copy(), self._out[0, :r].copy()


class Eagle3Drafter(Drafter):
    wants_taps = True
    TOP_K = 4  # tree: children per expanded node, and nodes expanded per depth

    def __init__(self, policy: Policy, session: Eagle3Session, tree: bool = False):
        super().__init__(policy)
        self.session, self.tree = session, tree
        self.calibration = Calibration()
        self.confidence: list[float] = []
        self.begin()
        start = time.perf_counter()
        one = np.ones((1, 1), np.bool_)
        session.run(np.zeros((1, session.features_width)), np.zeros((0, session.hidden)), [0], [0], one, 0)
        self.call_ms = (time.perf_counter() - start) * 1e3

    def begin(self) -> None:
        self.past, self.pending = 0, []

    def add_context(self, rows: np.ndarray) -> None:
        self.pending.append(np.asarray(rows, np.float32)[:, self.session.tap_columns])

    def observe(self, draft: Draft, rows: list[int], draft_ms: float, verify_ms: float) -> None:
        super().observe(draft, rows, draft_ms, verify_ms)
        self.calibration.observe_chain(self.confidence, self.main, rows)

    def _commit(self, history: list[int]):
        """Run the pending target features (positions past..L-2, each with the token after it):
        the last row's state and its top candidates for the token after history[-1]."""
        features = np.concatenate(self.pending)
        n = len(features)
        if self.past + n != len(history) - 1:
            raise RuntimeError(f"EAGLE-3 context out of step: {self.past} + {n} rows for {len(history) - 1} "
                               "committed tokens")
        mask = np.tril(np.ones((n, n), np.bool_))
        logprobs, ids, hidden = self.session.run(features, np.zeros((0, self.session.hidden)),
                                                 history[self.past + 1:], np.arange(self.past, self.past + n),
                                                 mask, self.past)
        self.past, self.pending = len(history) - 1, []
        return logprobs[-1], ids[-1], hidden[-1]

    def propose(self, history: list[int], room: int, beside: Beside = ALONE) -> Draft:
        """`beside`: the branch already in the verify that this draft joins (the hybrid's copy);
        it decides whether to draft at all (the draft's own size is planned as if alone)."""
        self.main, self.confidence = [], []
        limit = min(room, MAX_DRAFT)
        planned = self.policy.chain_length(self.acceptance, self.call_ms, limit, beside=beside)
        if planned == 0:
            return Draft()  # the features wait in `pending` for the next call
        start = time.perf_counter()
        logprobs, ids, state = self._commit(history)
        if self.tree:  # as deep as a chain would pay for: each depth is a call over the whole tree
            draft, calls = self._tree(logprobs, ids, state, planned, limit)
        else:
            draft, calls = self._chain(logprobs, ids, state, planned if self.policy.fixed is not None else limit)
        self.call_ms += 0.1 * ((time.perf_counter() - start) * 1e3 / calls - self.call_ms)
        return draft

    def _chain(self, logprobs, ids, state, limit: int) -> tuple[Draft, int]:
        """The argmax chain, one row per call in the scratch rows (a chain's earlier rows are all
        its ancestors), while the next token is worth its call and verify row."""
        chain, reach, calls = [], 1.0, 1
        fixed = self.policy.fixed is not None
        rate = self.policy.rate(self.acceptance, max(1, limit), self.call_ms)
        while True:
            p = float(np.exp(logprobs[0]))
            chain.append(int(ids[0]))
            self.confidence.append(p)
            reach *= self.calibration(p)
            depth = len(chain)
            if depth >= limit:
                break
            row_cost = self.policy.cost(depth + 2) - self.policy.cost(depth + 1)
            if not fixed and reach * self.acceptance.rates()[depth] <= (self.call_ms + row_cost) * rate:
                break
            position = self.past + depth - 1
            lp, top, hidden = self.session.run(np.zeros((0, self.session.features_width)), state[None], [chain[-1]],
                                               [position], np.ones((1, 1), np.bool_), position)
            logprobs, ids, state = lp[0], top[0], hidden[0]
            calls += 1
        self.main = list(range(len(chain)))
        return Draft.chain(chain), calls

    def _tree(self, logprobs, ids, state, depth_limit: int, limit: int) -> tuple[Draft, int]:
        """EAGLE-2: expand the TOP_K best frontier nodes a depth at a time, then keep the best
        nodes by cumulative log-prob (parents first), as many as pay for their verify rows."""
        k = self.TOP_K
        tokens, parents, scores, states = [], [], [], []  # every scored node
        frontier = []
        for r in range(k):  # the root's children: the candidates are sorted best first
            tokens.append(int(ids[r]))
            parents.append(-1)
            scores.append(float(logprobs[r]))
            states.append(state)
            frontier.append(len(tokens) - 1)
        calls = 1
        depth_of = [1] * len(tokens)
        expanded: list[int] = []  # nodes whose rows were run (each run re-runs its ancestors too)
        for depth in range(1, depth_limit):
            expanded = expanded + frontier
            rows = sorted(set(expanded))  # parents before children: nodes are numbered in creation order
            index = {node: i for i, node in enumerate(rows)}
            mask = np.eye(len(rows), dtype=np.bool_)
            for i, node in enumerate(rows):
                parent = parents[node]
                if parent >= 0:
                    mask[i] |= mask[index[parent]]
            positions = [self.past + depth_of[node] - 1 for node in rows]
            lp, top, hidden = self.session.run(np.zeros((0, self.session.features_width)),
                                               np.stack([states[n] for n in rows]), [tokens[n] for n in rows],
                                               positions, mask, self.past)
            calls += 1
            children = []
            for node in frontier:
                i = index[node]
                for r in range(k):
                    tokens.append(int(top[i, r]))
                    parents.append(node)
                    states.append(hidden[i])  # a child's row reads its parent's output state
                    scores.append(scores[node] + float(lp[i, r]))
                    depth_of.append(depth_of[node] + 1)
                    children.append(len(tokens) - 1)
            frontier = sorted(children, key=lambda i: -scores[i])[:k]
        return self._keep_best(tokens, parents, scores, depth_of, limit), calls

    def _keep_best(self, tokens, parents, scores, depth_of, limit: int) -> Draft:
        """The best nodes by cumulative score (a parent scores at least its children), renumbered
        parents first, while each adds more expected tokens per verify millisecond."""
        order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
        kept, expected = [], 1.0
        fixed = self.policy.fixed
        budget = min(fixed if fixed is not None else MAX_DRAFT, limit)  # limit: the room in the verify
        for node in order:
            if len(kept) >= budget:
                break
            if parents[node] != -1 and parents[node] not in kept:
                continue
            value = float(np.exp(scores[node]))  # the head's chance that the target walks to it
            rows = len(kept) + 1
            if fixed is None and value <= (self.policy.cost(rows + 1) - self.policy.cost(rows)) * expected / \
                    self.policy.cost(rows):
                break
            kept.append(node)
            expected += value
        kept.sort(key=lambda n: (depth_of[n], n))
        new_index = {node: i for i, node in enumerate(kept)}
        draft = Draft([tokens[n] for n in kept], [new_index.get(parents[n], -1) for n in kept])
        node, self.main = -1, []
        while True:  # the main chain: the best child at each depth
            children = [i for i, n in enumerate(kept) if draft.parents[i] == node]
            if not children:
                break
            parent_score = scores[kept[node]] if node >= 0 else 0.0
            node = max(children, key=lambda i: scores[kept[i]])
            self.main.append(node)
            self.confidence.append(float(np.exp(scores[kept[node]] - parent_score)))  # the token's own probability
        return draft
