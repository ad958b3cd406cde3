"""`dflash-bench verify`: whole-target forward time for S new rows (a verify of S candidates) at a
short and a long past, bundle against bundle (e.g. one exported with each attention op)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import numpy as np

GRID = [(past, s) for past in (256, 2048) for s in (1, 2, 4, 8, 16, 32)]  # (cached rows, new rows)


def time_forwards(bundles, threads: int, repeats: int, paths=("native",)) -> list[dict]:
    """One row per bundle, quantized MatMul kernel path (distinct, e.g. ["avx512", "avx2"]) and
    (past, S): the median ms of a forward; configurations that do not fit a bundle's cache are left out."""
    from dflash.ops import kernel_path, resolve_kernel_path
    from dflash.runtime.bundle import load_bundle
    from dflash.runtime.target import Target, causal_mask

    names = [Path(path).name for path in bundles]  # e.g. smollm2, smollm2-gqa
    if len(set(names)) < len(names):
        names = [str(path) for path in bundles]
    paths = list(dict.fromkeys(resolve_kernel_path(p) for p in paths))
    targets, path_of = {}, {}
    for path in paths:
        with kernel_path(path):  # read when the session creates its kernels
            for name, folder in zip(names, bundles):
                key = name if len(paths) == 1 else f"{name} {path}"
                targets[key], path_of[key] = Target(load_bundle(folder), threads), path
    for target in targets.values():  # a fresh session's first forwards are slow: keep them out
        past = max(0, min(256, target.capacity - 8))
        for s in (1, 8, 1):
            for _ in range(30):
                target.forward(np.arange(s) + 100, np.arange(past, past + s), causal_mask(s), past)
    rows = []
    with click.progressbar(GRID, label="verify", file=sys.stderr) as bar:
        for past, s in bar:
            ids, mask = np.arange(s) + 100, causal_mask(s)
            times = {name: [] for name in targets}
            # Rounds of a few runs per bundle, alternating: interleaving every single run would
            # evict each model's weights from the cache and time memory traffic, not the graph.
            for _ in range(max(1, repeats // 5)):
                for name, target in targets.items():
                    if past + s > target.capacity:
                        continue
                    for run in range(7):
                        start = time.perf_counter()
                        target.forward(ids, np.arange(past, past + s), mask, past)
                        if run >= 2:  # the first two re-warm the cache
                            times[name].append((time.perf_counter() - start) * 1e3)
            rows += [{"bundle": name, "kernels": path_of[name], "past": past, "S": s, "ms": float(np.median(t))}
                     for name, t in times.items() if t]
    return rows


def print_table(rows: list[dict]) -> None:
    names = list(dict.fromkeys(r["bundle"] for r in rows))
    click.echo(f"{'past':>5s} {'S':>3s} " + " ".join(f"{n:>14s}" for n in names) + "   (ms per forward)")
    for past, s in GRID:
        ms = {r["bundle"]: r["ms"] for r in rows if (r["past"], r["S"]) == (past, s)}
        click.echo(f"{past:5d} {s:3d} " + " ".join(f"{ms.get(n, float('nan')):14.2f}" for n in names))
    for past in sorted({p for p, _ in GRID}):
        for s in (8, 16):  # what a verify of s rows costs in one-token steps
            ratio = {n: step_ratio(rows, n, past, s) for n in names}
            click.echo(f"T({s})/T(1) past {past}: " + "  ".join(f"{n} {r:.2f}" for n, r in ratio.items() if r))


def step_ratio(rows: list[dict], bundle: str, past: int, s: int) -> float | None:
    ms = {r["S"]: r["ms"] for r in rows if r["bundle"] == bundle and r["past"] == past}
    return ms[s] / ms[1] if s in ms and 1 in ms else None
