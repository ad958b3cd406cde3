"""The DFlash drafter at run time: one drafter call proposes a whole block.

The drafter reads the target's tap features of the committed tokens (its context) and the
block [anchor, MASK x (B-1)], and returns the K likeliest tokens at each block position.
`dflash` drafts the argmax chain, cut where the calibrated confidence stops paying for the
verify rows; `dflash-tree` (DDTree) grows a best-first tree over the same per-position
candidates under a node budget the same rule sets.  A call serves only the block positions the
policy may use (one past its expected chain): the drafter was trained on blocks of 16, but where
verify rows are dear (int4 targets) chains are short, and a block of 3-4 rows costs about half
a full one while its first positions are drafted nearly as well (the block rows see each other,
so the drafts can differ slightly from a full block's).  A drafter trained to refine
(`dflash-train fit --refine`) gets a second call over the same block with the first call's
drafts in place of the masks, and drafts from that.  A copy-aware drafter (`fit --copy`) is also
given what prompt lookup copies into the block (the tokens after the latest earlier match of the
text's last n-gram), and learned when to trust it.  Its cache holds context rows only:
each call writes the pending context rows (those of the last step's accepted tokens) after
the ones already there, and the block rows after those are scratch.
"""

from __future__ import annotations

import heapq
import time

import numpy as np
import onnxruntime as ort

from .bundle import Bundle, new_cache
from .drafters import Calibration, Drafter, NgramLookup
from .policy import ALONE, MAX_DRAFT, Beside, Policy
from .session import make_session, run_pinned
from .speculative import Draft


class DrafterSession:
    """The DFlash drafter graph behind IOBinding: every input and output is bound once per
    context length to numpy memory allocated once, and its KV cache is updated in place."""

    MAX_CONTEXT = 64  # context rows per call; more (a prompt's) are fed in chunks of this size
    MIN_BLOCK = 3  # the fewest block rows the graph takes (the anchor and two masks)

    def __init__(self, bundle: Bundle, threads: int | None = None, cores: list[int] | None = None):
        info = bundle.manifest["dflash"]
        self.cores = set(cores) if cores else None
        self.session = make_session(bundle.graph_path("drafter"), bundle, threads, cores)
        self.block, self.mask_id, self.capacity = info["block_size"], info["mask_token_id"], info["capacity"]
        self.refine = bool(info.get("refine", False))  # trained with a refining second pass
        self.copy = "copy_ids" in {i.name for i in self.session.get_inputs()}  # a copy-aware drafter
        kv = info["kv"]
        self.caches = [new_cache(kv, self.capacity) for _ in range(2 * kv["layers"])]
        self._cache_values = [ort.OrtValue.ortvalue_from_numpy(c) for c in self.caches]
        top_k = self.session.get_outputs()[1].shape[-1]
        vocab = self.session.get_outputs()[0].shape[-1]  # the draft vocabulary may be smaller
        self.logits = np.zeros((1, self.block - 1, vocab if isinstance(vocab, int) else bundle.vocab_size),
                               np.float32)
        self.top_logprobs = np.zeros((1, self.block - 1, top_k), np.float32)
        self.top_ids = np.zeros((1, self.block - 1, top_k), np.int64)
        self.columns = bundle.tap_columns(info.get("target_layer_ids", bundle.taps))
        self.width = len(self.columns)
        rows = self.MAX_CONTEXT + self.block
        self._context = np.zeros((1, self.MAX_CONTEXT, self.width), np.float32)
        self._block_ids = np.full((1, self.block), self.mask_id, np.int64)
        self._copy_ids = np.full((1, self.block), -1, np.int64)
        self._positions = np.zeros((1, rows), np.int64)
        self._mask = np.ones((rows, rows), np.bool_)  # every row sees every new row (block rows are non-causal)
        self._past = np.zeros((), np.int64)
        self._bindings: dict[tuple[int, int], ort.IOBinding] = {}  # by (context rows, block rows)

    def _binding(self, n: int, block: int) -> ort.IOBinding:
        """The binding for calls with N context rows and a block of B rows, made once and reused."""
        binding = self._bindings.get((n, block))
        if binding is None:
            binding = self.session.io_binding()
            rows = n + block
            value = ort.OrtValue.ortvalue_from_numpy
            binding.bind_ortvalue_input("context", value(self._context[:, :n]))
            binding.bind_ortvalue_input("block_ids", value(self._block_ids[:, :block]))
            binding.bind_ortvalue_input("position_ids", value(self._positions[:, :rows]))
            binding.bind_ortvalue_input("attention_mask", value(np.ascontiguousarray(self._mask[:rows, :rows])))
            binding.bind_ortvalue_input("past_len", value(self._past))
            if self.copy:
                binding.bind_ortvalue_input("copy_ids", value(self._copy_ids[:, :block]))
            for i, cache in enumerate(self._cache_values):
                kind, layer = ("key", "value")[i % 2], i // 2
                binding.bind_ortvalue_input(f"past_{kind}_{layer}", cache)
                binding.bind_ortvalue_output(f"present_{kind}_{layer}", cache)
            for name in ("logits", "top_logprobs", "top_ids"):
                binding.bind_ortvalue_output(name, value(getattr(self, name)[:, : block - 1]))
            self._bindings[(n, block)] = binding
        return binding

    def run(self, context: np.ndarray, anchor: int, past: int, block: int | None = None,
            filled: np.ndarray | None = None, copied: list[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Context rows [N, T*H] at positions past..past+N-1, the anchor right after them:
        (log-probs, ids) [B-1, K] of the likeliest tokens at block positions 1..B-1, for a block
        of B = `block` rows (default and at most: the trained block size; at least MIN_BLOCK).
        `filled`: token ids for block rows 1..B-1 instead of the mask (a refining pass);
        `copied`: what lookup copies into rows 1.. (a copy-aware drafter reads it; others ignore it)."""
        block = self.block if block is None else min(max(block, self.MIN_BLOCK), self.block)
        context = np.asarray(context, np.float32).reshape(-1, self.width)
        while len(context) > self.MAX_CONTEXT:  # a long context: its leading rows only fill the cache,
            # and the context's cache rows do not depend on the block, so the smallest one serves
            self._run(context[: self.MAX_CONTEXT], anchor, past, self.MIN_BLOCK)
            context, past = context[self.MAX_CONTEXT:], past + self.MAX_CONTEXT
        self._run(context, anchor, past, block, filled, copied)
        return self.top_logprobs[0, : block - 1], self.top_ids[0, : block - 1]

    def _run(self, context: np.ndarray, anchor: int, past: int, block: int, filled=None, copied=()) -> None:
        n = len(context)
        binding = self._binding(n, block)
        self._context[0, :n] = context
        self._block_ids[0, 0] = anchor
        self._block_ids[0, 1:block] = self.mask_id if filled is None else filled[: block - 1]
        copied = list(copied)[: block - 1]
        self._copy_ids[0, 1 : 1 + len(copied)] = copied
        self._copy_ids[0, 1 + len(copied) :] = -1
        self._positions[0, : n + block] = np.arange(past, past + n + block)
        self._past[...] = past
        run_pinned(self.session, binding, self.cores)


class DFlashDrafter(Drafter):
    wants_taps = True

    def __init__(self, policy: Policy, session: DrafterSession, tree: bool = False):
        super().__init__(policy)
        self.session, self.tree = session, tree
        self.calibration = Calibration()
        self.ngrams = NgramLookup()  # what a copy-aware drafter is given
        self.confidence: list[float] = []
        self.begin()
        start = time.perf_counter()
        self._draft(np.zeros((1, session.width), np.float32), 0, 0, session.block)
        self.call_ms = (time.perf_counter() - start) * 1e3

    def begin(self) -> None:
        self.past, self.pending = 0, []

    def add_context(self, rows: np.ndarray) -> None:
        self.pending.append(np.asarray(rows, np.float32)[:, self.session.columns])

    def propose(self, history: list[int], room: int, beside: Beside = ALONE) -> Draft:
        """`beside`: the branch already in the verify that this draft joins (the hybrid's copy)."""
        self.main, self.confidence = [], []
        limit = min(room, self.session.block - 1, MAX_DRAFT)
        planned = self.policy.chain_length(self.acceptance, 0.0, limit, fixed_ms=self.call_ms, beside=beside)
        if planned == 0:
            return Draft()  # the context waits in `pending` for the next call
        # Positions to draft: the planned chain, and one more where confident drafts may go on.
        positions = planned if self.policy.fixed is not None else min(planned + 1, limit)
        context = np.concatenate(self.pending) if self.pending else np.zeros((0, self.session.width), np.float32)
        if self.past + len(context) != len(history) - 1:
            raise RuntimeError(f"drafter context out of step: {self.past} + {len(context)} rows "
                               f"for {len(history) - 1} committed tokens")
        start = time.perf_counter()
        copied = self.ngrams(history, self.session.block - 1)[0] if self.session.copy else ()
        logprobs, ids = self._draft(context, history[-1], self.past, positions + 1, copied)
        self.call_ms += 0.1 * ((time.perf_counter() - start) * 1e3 - self.call_ms)
        self.past, self.pending = len(history) - 1, []
        if self.tree:
            return self._tree(logprobs[:limit], ids[:limit], min(room, MAX_DRAFT), beside)
        return self._chain(logprobs[:limit], ids[:limit], beside)

    def _draft(self, context: np.ndarray, anchor: int, past: int, block: int,
               copied: list[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The drafter's (log-probs, ids) for a block: one call, and for a drafter trained to
        refine a second one over the same block holding the first call's drafts."""
        logprobs, ids = self.session.run(context, anchor, past, block=block, copied=copied)
        if self.session.refine:
            logprobs, ids = self.session.run(context[:0], anchor, past + len(context), block=block,
                                             filled=ids[:, 0].copy(), copied=copied)
        return logprobs, ids

    def _chain(self, logprobs: np.ndarray, ids: np.ndarray, beside: Beside = ALONE) -> Draft:
        """The argmax tokens, as many as maximise expected tokens per verify millisecond."""
        self.confidence = np.exp(logprobs[:, 0]).tolist()
        reach = np.cumprod([self.calibration(p) for p in self.confidence])
        if self.policy.fixed is not None:
            k = min(self.policy.fixed, len(reach))
        else:  # the call is made: only the verify rows count now
            k = self.policy.best_length(reach, beside=beside)
        self.main = list(range(k))
        return Draft.chain(ids[:k, 0].tolist())

    def _tree(self, logprobs: np.ndarray, ids: np.ndarray, room: int, beside: Beside = ALONE) -> Draft:
        """DDTree: best-first over the per-position candidates.  A node's value is the chance
        the target walks to it: the calibrated probabilities along its path multiplied.
        Nodes join in value order (so parents precede children) while each raises the
        expected tokens per millisecond, or up to the fixed budget."""
        probs = np.exp(logprobs)
        self.confidence = probs[:, 0].tolist()
        fixed = self.policy.fixed
        budget = min(fixed if fixed is not None else room, room)  # room: nodes that fit in the verify
        draft, expected = Draft(), beside.tokens
        frontier = [(-beside.share * self.calibration(probs[0, r]), 0, r, -1, (r == 0)) for r in range(ids.shape[1])]
        heapq.heapify(frontier)
        while frontier and len(draft) < budget:
            value, depth, rank, parent, on_main = heapq.heappop(frontier)
            value = -value
            rows = len(draft) + beside.rows
            if fixed is None:
                rate = expected / self.policy.cost(rows)
                if value <= (self.policy.cost(rows + 1) - self.policy.cost(rows)) * rate:
                    break
            node = len(draft)
            draft.tokens.append(int(ids[depth, rank]))
            draft.parents.append(parent)
            expected += value
            if on_main:
                self.main.append(node)
            if depth + 1 < len(ids):
                for r in range(ids.shape[1]):
                    heapq.heappush(frontier, (-value * self.calibration(probs[depth + 1, r]), depth + 1, r, node,
                                              on_main and r == 0))
        return draft
