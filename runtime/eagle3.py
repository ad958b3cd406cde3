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

from .bundle import Bundle
from .drafters import Calibration, Drafter
from .policy import MAX_DRAFT, Policy
from .session import make_session, run_pinned
from .speculative import Draft


class Eagle3Session:
    """The head's graph with its KV cache kept in numpy memory and updated in place."""

    def __init__(self, bundle: Bundle, threads: int | None = None, cores: list[int] | None = None):
        info = bundle.manifest["eagle3"]
        self.cores = set(cores) if cores else None
        self.session = make_session(bundle.graph_path("eagle3"), bundle, threads, cores)
        self.capacity, self.hidden = info["capacity"], info["hidden_size"]
        self.tap_columns = bundle.tap_columns(info["taps"])
        shape = (1, info["kv"]["kv_heads"], self.capacity, info["kv"]["head_dim"])
        self.key, self.value = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        self.features_width = len(self.tap_columns)

    def run(self, features: np.ndarray, states: np.ndarray, tokens, positions, mask: np.ndarray, past: int):
        """Rows (target features first, then own states) written at past..: per row the top
        log-probs and target ids [R, K], and the output states [R, H]."""
        if past + len(tokens) > self.capacity:
            raise RuntimeError(f"EAGLE-3 head cache full: {past} + {len(tokens)} rows > {self.capacity}")
        feeds = {"features": np.asarray(features, np.float32).reshape(1, -1, self.features_width),
                 "states": np.asarray(states, np.float32).reshape(1, -1, self.hidden),
                 "token_ids": np.asarray([tokens], np.int64), "position_ids": np.asarray([positions], np.int64),
                 "attention_mask": np.ascontiguousarray(mask, np.bool_), "past_len": np.asarray(past, np.int64),
                 "past_key_0": self.key, "past_value_0": self.value}
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name in ("top_logprobs", "top_ids", "hidden"):
            binding.bind_output(name)
        # the cache outputs alias the inputs' memory: the graph writes the new rows in place
        binding.bind_output("present_key_0", "cpu", 0, np.float32, list(self.key.shape), self.key.ctypes.data)
        binding.bind_output("present_value_0", "cpu", 0, np.float32, list(self.value.shape), self.value.ctypes.data)
        run_pinned(self.session, binding, self.cores)
        logprobs, ids, hidden = (v.numpy()[0] for v in binding.get_outputs()[:3])
        return logprobs, ids, hidden


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

    def propose(self, history: list[int], room: int) -> Draft:
        self.main, self.confidence = [], []
        limit = min(room, MAX_DRAFT)
        planned = self.policy.chain_length(self.acceptance, self.call_ms, limit)
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
