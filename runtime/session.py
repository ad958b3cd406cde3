"""Creating ONNX Runtime sessions for a bundle's graphs."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import onnxruntime as ort

from .bundle import Bundle, BundleError


def parse_cores(text: str | None) -> list[int] | None:
    """"0,1" -> [0, 1]; None or "" -> None."""
    try:
        return [int(c) for c in text.split(",")] if text else None
    except ValueError:
        raise ValueError(f"give core ids like 0 or 0,1; got {text!r}") from None


def make_session(path, bundle: Bundle, threads: int | None = None,
                 cores: list[int] | None = None, resident: bool = True) -> ort.InferenceSession:
    """A session on `threads` intra-op threads (default: one per usable core).

    `resident`: the weights on huge pages and every mapped page faulted in (steady speed and
    memory for an app); False leaves them as ORT placed them, for one-off runs such as the
    export check (an 8B model's embedding then costs only the rows a run reads).

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
    before = _anonymous_regions()
    try:
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own Fail/InvalidGraph types
        raise BundleError(f"ONNX Runtime could not load {path}: {e}") from e
    if not resident:
        return session
    if os.environ.get("DFLASH_HUGE_PAGES", "1") != "0":  # 0: leave them on 4 KB pages (for A/B runs)
        _back_with_huge_pages(_grown(before, _anonymous_regions()))
    _read_in_mapped_weights(Path(path).parent)
    return session


_HUGE = 2 << 20  # bytes in an x86-64 huge page
_MADV_COLLAPSE = 25  # Linux 6.1+
_MADV_POPULATE_READ = 22  # Linux 5.14+


def _madvise():
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _read_in_mapped_weights(folder: Path) -> None:
    """Fault in every page of the bundle's weight files that ORT mapped rather than copied (the
    embedding table a Gather reads, for one). Left to fault lazily, each token id seen for the
    first time pulls in its row's pages, and a long-running app's memory creeps up for hours
    (about 0.5 MB a generation on the default model) though nothing leaks. Best effort."""
    folder = str(folder.resolve()) + os.sep
    try:
        with open("/proc/self/maps") as maps:
            regions = [line.split() for line in maps]
    except OSError:
        return
    madvise = _madvise()
    if madvise is None:
        return
    for fields in regions:
        if len(fields) >= 6 and fields[5].startswith(folder):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            madvise(start, end - start, _MADV_POPULATE_READ)  # an error leaves the pages as they were


def _anonymous_regions() -> dict[int, int]:
    """start -> end of this process's private anonymous writable mappings, the heap included."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return {}
    regions = {}
    for line in lines:
        fields = line.split()
        if fields[1].startswith("rw") and (len(fields) < 6 or fields[5] == "[heap]"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            regions[start] = end
    return regions


def _grown(before: dict[int, int], after: dict[int, int]) -> list[tuple[int, int]]:
    """The address ranges that are new in `after`: new mappings, and the grown tail of old ones
    (the heap grows upwards)."""
    return [(max(start, before.get(start, start)), end) for start, end in after.items()
            if end > before.get(start, start)]


def _back_with_huge_pages(regions) -> None:
    """Move the session's new buffers (its weights, as ORT prepacked them) onto 2 MB pages.

    A decode step streams every weight once; with 4 KB pages the TLB misses cost about 3% of
    fp32 decode speed on the reference machine. glibc's malloc does not ask for huge pages
    (unless GLIBC_TUNABLES=glibc.malloc.hugetlb=1 is set at start), so we collapse the pages
    after the fact. Best effort: where the kernel or libc cannot, nothing changes."""
    regions = [(start, end) for start, end in regions if end - start >= 2 * _HUGE]
    if not regions:
        return
    madvise = _madvise()
    if madvise is None:
        return
    for start, end in regions:
        first, last = -(-start // _HUGE) * _HUGE, end // _HUGE * _HUGE
        if last > first:
            madvise(first, last - first, _MADV_COLLAPSE)  # an error leaves the pages as they were


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
