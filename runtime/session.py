"""Creating ONNX Runtime sessions for a bundle's graphs."""

from __future__ import annotations

import os

import onnxruntime as ort

from .bundle import Bundle, BundleError


def make_session(path, bundle: Bundle, threads: int | None = None,
                 cores: list[int] | None = None) -> ort.InferenceSession:
    """A session on `threads` intra-op threads (default: one per usable core).

    `cores` pins the session's threads: ORT's pool threads through
    `session.intra_op_thread_affinities` (1-based logical processors, one entry per
    pool thread beyond the caller's own), the calling thread by the caller.
    """
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    if cores:
        threads = len(cores)
        if threads > 1:
            opts.add_session_config_entry("session.intra_op_thread_affinities",
                                          ";".join(str(c + 1) for c in cores[1:]))
    opts.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
    opts.inter_op_num_threads = 1
    # Pool threads spin between the ops of a run (fast hand-offs) but stop when it ends:
    # left spinning, a session's idle threads take the cores the other session (the
    # drafter, or the app) runs on next, and its steps slow down 1.5-2x.
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    if bundle.manifest.get("ops_library"):
        from dflash import ops

        ops.register(opts)
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own Fail/InvalidGraph types
        raise BundleError(f"ONNX Runtime could not load {path}: {e}") from e


def run_pinned(session: ort.InferenceSession, binding: ort.IOBinding, cores: set[int] | None) -> None:
    """Run; with `cores`, the calling thread (one of the session's) runs pinned to them."""
    if not cores:
        session.run_with_iobinding(binding)
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        session.run_with_iobinding(binding)
    finally:
        os.sched_setaffinity(0, previous)
