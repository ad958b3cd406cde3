"""The target model behind IOBinding: fixed KV buffers updated in place by the graph.

Every input and output is bound to numpy memory allocated once.  A forward pass
writes its new K/V rows straight into the cache buffers (past and present are bound
to the same memory), and its logits into a preallocated buffer; a step only writes a
few integers and calls `run_with_iobinding`.

Graphs quantized with ORT's MatMulNBits run every call with at least two rows.
MatMulNBits takes a different kernel for one row than for several, and the two round
differently (logits differ by up to 0.8 at int4, accuracy level 4), so a one-token decode
step and a multi-token verify could pick different tokens.  With two rows or more, each
row's result is bit-identical whatever the row count (tests/test_speculative.py checks
it), so plain decoding pads its one row with a dummy second row, which costs one cache
row of capacity.  fp32 MatMul and our MatMulQ4 / MatMulQ8 (int4 / int8 bundles with the op
library) are row-count independent and run single rows as they are.
"""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort

from .bundle import Bundle, BundleError, new_cache
from .session import make_session, run_pinned


def _ortvalue(array: np.ndarray) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_numpy(array)


MAX_ROWS = 64  # rows per call; longer prompts are prefilled in chunks of this size


class Target:
    def __init__(self, bundle: Bundle, threads: int | None = None, cores: list[int] | None = None,
                 exact: bool = True):
        """`exact=False` (a drafter) skips the padding row: its rounding never reaches the output."""
        self.bundle = bundle
        self.cores = set(cores) if cores else None
        self.session = make_session(bundle.graph_path("target"), bundle, threads, cores)
        check_graph_matches(self.session, bundle)
        graph = bundle.graphs["target"]
        padded = graph["dtype"] != "fp32" and graph.get("matmul", "nbits") == "nbits"
        self.min_rows = 2 if exact and padded else 1
        kv = bundle.kv
        self.capacity = bundle.max_len - (self.min_rows - 1)  # the padding row needs a cache row
        self.key_cache = [new_cache(kv, bundle.max_len) for _ in range(kv["layers"])]
        self.value_cache = [new_cache(kv, bundle.max_len) for _ in range(kv["layers"])]
        width = len(bundle.taps) * bundle.hidden_size
        # Row buffers sized for the largest call; a call with S rows uses the first S.
        self._ids = np.zeros((1, MAX_ROWS), np.int64)
        self._pos = np.zeros((1, MAX_ROWS), np.int64)
        self._past = np.zeros((), np.int64)
        self._logits = np.zeros((1, MAX_ROWS, bundle.vocab_size), np.float32)
        self._taps = np.zeros((1, MAX_ROWS, width), np.float32)
        self._masks: dict[int, np.ndarray] = {}
        self._bindings: dict[int, ort.IOBinding] = {}
        self._cache_values = [(_ortvalue(k), _ortvalue(v)) for k, v in zip(self.key_cache, self.value_cache)]

    def _binding(self, s: int) -> ort.IOBinding:
        """The binding for calls of S rows, made once per S and reused."""
        binding = self._bindings.get(s)
        if binding is None:
            binding = self.session.io_binding()
            mask = self._masks.setdefault(s, np.zeros((s, s), np.bool_))
            binding.bind_ortvalue_input("input_ids", _ortvalue(self._ids[:, :s]))
            binding.bind_ortvalue_input("position_ids", _ortvalue(self._pos[:, :s]))
            binding.bind_ortvalue_input("tree_mask", _ortvalue(mask))
            binding.bind_ortvalue_input("past_len", _ortvalue(self._past))
            for i, (k, v) in enumerate(self._cache_values):
                binding.bind_ortvalue_input(f"past_key_{i}", k)
                binding.bind_ortvalue_input(f"past_value_{i}", v)
                binding.bind_ortvalue_output(f"present_key_{i}", k)
                binding.bind_ortvalue_output(f"present_value_{i}", v)
            binding.bind_ortvalue_output("logits", _ortvalue(self._logits[:, :s]))
            binding.bind_ortvalue_output("taps", _ortvalue(self._taps[:, :s]))
            self._bindings[s] = binding
        return binding

    def forward(self, ids, positions, mask: np.ndarray, past: int) -> np.ndarray:
        """Run S new tokens after `past` cached rows; returns logits [S, V] (a view, valid
        until the next call).  `mask[i, j]`: new row i may attend to new row j."""
        s = n = len(ids)
        if s > MAX_ROWS:
            raise ValueError(f"{s} rows in one call; at most {MAX_ROWS}")
        if past + s > self.capacity:
            raise ValueError(f"{past} cached + {s} new tokens exceed the KV capacity {self.capacity}")
        if n < self.min_rows:  # a dummy row after the real one (see the module docstring)
            ids, positions = [ids[0], ids[0]], [positions[0], positions[0] + 1]
            mask, s = causal_mask(2), 2
        binding = self._binding(s)
        self._ids[0, :s] = ids
        self._pos[0, :s] = positions
        self._masks[s][...] = mask
        self._past[...] = past
        run_pinned(self.session, binding, self.cores)
        return self._logits[0, :n]

    def keep_rows(self, past: int, rows: list[int]) -> None:
        """Move the cache rows `past + rows[i]` to `past + i`: after a tree verify, the
        accepted path's rows become contiguous.  Rows only move down (rows[i] >= i, increasing)."""
        moves = [(i, r) for i, r in enumerate(rows) if r != i]
        if not moves:
            return
        dst = [past + i for i, _ in moves]
        src = [past + r for _, r in moves]
        for cache in (*self.key_cache, *self.value_cache):
            cache[0, :, dst] = cache[0, :, src]

    def measure_cost(self, sizes, repeats: int = 3) -> dict[int, float]:
        """Median ms of one forward of S rows, for each S in `sizes`.  A session's first calls of
        a size are slow (ORT plans and allocates per shape), and so is a small call right after a
        much larger one (int4, one row: 3.0 ms alone, 4.1 right after 25 rows), so an untimed pass
        goes from the largest size down, then the timed calls from the smallest up.  Measured
        size by size from a cold start, one row once looked 1.7x dearer than it is and the policy
        drafted where drafting did not pay.  It writes scratch rows into the cache, so call it
        before a prefill, never mid-generation."""
        past = min(256, self.capacity - max(sizes))

        def timed(s: int) -> float:
            start = time.perf_counter()
            self.forward(np.full(s, 100), np.arange(past, past + s), causal_mask(s), past)
            return (time.perf_counter() - start) * 1e3

        for s in sorted(sizes, reverse=True):
            timed(s)
        return {s: float(np.median([timed(s) for _ in range(repeats)])) for s in sorted(sizes)}

    def taps(self, s: int) -> np.ndarray:
        """Tap features [S, T*H] of the last call of S rows."""
        return self._taps[0, :s]

    def prefill(self, ids, past: int = 0, on_chunk=None) -> np.ndarray:
        """Causal pass over `ids` after `past` rows, in chunks; returns the last row's logits.
        `on_chunk(start, s)` runs after each chunk (to read its taps)."""
        for start in range(0, len(ids), MAX_ROWS):
            chunk = ids[start : start + MAX_ROWS]
            s, at = len(chunk), past + start
            logits = self.forward(chunk, np.arange(at, at + s), causal_mask(s), at)
            if on_chunk is not None:
                on_chunk(start, s)
        return logits[-1]


def check_graph_matches(session, bundle: Bundle) -> None:
    """The manifest's cache layout, vocabulary and taps must be the graph's, or every
    buffer the runtime binds would have the wrong shape."""
    kv, graph = bundle.kv, bundle.graph_path("target")
    shapes = {i.name: i.shape for i in (*session.get_inputs(), *session.get_outputs())}
    capacity = session.get_modelmeta().custom_metadata_map.get("max_len")
    if capacity and "past_key_0" in shapes:  # a streamed graph: the capacity is symbolic, its rotary tables are not
        shapes["past_key_0"] = [int(capacity) if isinstance(d, str) else d for d in shapes["past_key_0"]]
    cache = new_cache(kv, 0)  # the manifest's row width and dtype
    expected = {"past_key_0": [1, kv["kv_heads"], bundle.max_len, cache.shape[3]],
                "logits": [1, None, bundle.vocab_size], "taps": [1, None, len(bundle.taps) * bundle.hidden_size]}
    layers = sum(name.startswith("past_key_") for name in shapes)
    problems = [f"{kv['layers']} layers in the manifest, {layers} in the graph"] if layers != kv["layers"] else []
    have_type = {i.name: i.type for i in session.get_inputs()}.get("past_key_0")
    want_type = "tensor(float)" if cache.dtype == np.float32 else f"tensor({cache.dtype.name})"
    if have_type and have_type != want_type:
        problems.append(f"the KV cache is {have_type} in the graph, {kv.get('dtype', 'fp32')} ({want_type}) "
                        "by the manifest")
    for name, want in expected.items():
        have = shapes.get(name)
        if have is None or len(have) != len(want) or any(
                w is not None and isinstance(h, int) and h != w for h, w in zip(have, want)):
            problems.append(f"{name} is {have} in the graph, {want} by the manifest")
    if problems:
        raise BundleError(f"{bundle.folder / 'dflash.json'} contradicts {graph.name}: {'; '.join(problems)}; "
                          "the manifest was edited or mixed with another export: export the bundle again")


def causal_mask(s: int) -> np.ndarray:
    return np.tri(s, dtype=np.bool_)
