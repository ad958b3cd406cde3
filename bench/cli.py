"""`dflash-bench`: side-by-side measurements, interleaved in one run, reported as medians.

    dflash-bench generate --bundle bundles/smollm2 --bundle bundles/smollm2-int4 \\
        --max-new-tokens 128 --modes ar --hf --json out.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from unittest.mock import patch

import click

from .common import HfRunner, OrtRunner, encode_row, load_prompts, machine, rate, summarize
from .prompts import BENCHMARK


def speedups_by_kind(rows, results, mode: str, base: str) -> dict:
    """Median per-prompt ratio of mode to base tokens/s, for all prompts and per prompt kind."""
    ratios = {}
    for row in rows:
        a, b = results[mode][row["id"]], results[base][row["id"]]
        if len(a["tokens"]) > 1 and len(b["tokens"]) > 1:
            for kind in ("all", row.get("kind", "other")):
                ratios.setdefault(kind, []).append(rate(a) / rate(b))
    return {kind: statistics.median(v) for kind, v in ratios.items()}


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    panels = [("tokens_per_s", "decode tokens/s (median over prompts)", "%.1f")]
    if any(m != "hf" and report["modes"][m].get("accept_hist") for m in modes):
        panels.append(("mean_accept_len", "tokens per target call", "%.2f"))
    fig, axes = plt.subplots(1, len(panels), figsize=(len(panels) * (1.1 * len(modes) + 2), 3.8), squeeze=False)
    for ax, (key, label, fmt) in zip(axes[0], panels):
        values = [report["modes"][m][key] for m in modes]
        bars = ax.bar(modes, values, color="#3b7dd8")
        ax.bar_label(bars, fmt=fmt)
        ax.set_ylim(0, max(values) * 1.15)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{report['machine']['cores']} cores, {report['threads']} threads, "
                 f"{report['max_new_tokens']} new tokens, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@click.group()
def main():
    """Benchmarks: every ratio comes from one interleaved run."""


def parse_cores(text: str | None) -> list[int] | None:
    from dflash.runtime.session import parse_cores as parse

    try:
        return parse(text)
    except ValueError as e:
        raise click.BadParameter(str(e))


@main.command()
@click.option("--bundle", "bundles", multiple=True, required=True,
              help="bundle folder; repeat to compare bundles (modes get a -DTYPE suffix)")
@click.option("--prompts", default=str(BENCHMARK), show_default="the benchmark set",
              type=click.Path(exists=True), help="JSONL prompt file")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--modes", default="ar", show_default=True,
              help="comma-separated: ar and drafter names (lookup, self-int4, self-int4-tree, draft-lm, ...)")
@click.option("--draft-len", type=int, help="fixed chain length (default: adaptive)")
@click.option("--hf", is_flag=True, help="add transformers' greedy generate as mode 'hf'")
@click.option("--threads", type=int, default=len(os.sched_getaffinity(0)), show_default=True)
@click.option("--target-cores", help="also run every speculative mode with the target pinned to these "
              "cores (e.g. 0) and ...")
@click.option("--draft-cores", help="... the drafter pinned to these (e.g. 1): modes suffixed @pinned")
@click.option("--small-pages", is_flag=True, help="also run every mode with the weights left on 4 KB "
              "pages (DFLASH_HUGE_PAGES=0): modes suffixed @4k")
@click.option("--repeats", default=1, show_default=True, help="runs per prompt (median taken)")
@click.option("--json", "json_out", type=click.Path(), help="write the report here")
@click.option("--plot", "plot_out", type=click.Path(), help="write a PNG bar chart here")
def generate(bundles, prompts, max_new_tokens, modes, draft_len, hf, threads, target_cores, draft_cores,
             small_pages, repeats, json_out, plot_out):
    """Decode tokens/s per mode on a prompt file, with outputs checked against `ar`."""
    from dflash.runtime import Model

    rows = load_prompts(prompts)
    runners, bases, skipped = {}, {}, []
    layouts = {"": dict(threads=threads)}
    if target_cores or draft_cores:
        layouts["@pinned"] = dict(target_cores=parse_cores(target_cores), draft_cores=parse_cores(draft_cores))
    if small_pages:
        layouts["@4k"] = dict(threads=threads)
    names = []  # bundle suffixes: "" for the first, then -DTYPE (or the folder name if taken)
    for i, bundle in enumerate(bundles):
        for layout, options in layouts.items():
            pages = {"DFLASH_HUGE_PAGES": "0"} if layout == "@4k" else {}
            with patch.dict(os.environ, pages):  # read when the sessions are made
                model = Model(bundle, **options)  # one per bundle and layout, shared by its modes
                for mode in set(modes.split(",")) & set(model.drafters):
                    model.drafter(mode, draft_len)  # its sessions too
            if not layout:
                dtype = f"-{model.bundle.graphs['target']['dtype']}"
                names.append("" if i == 0 else dtype if dtype not in names else f"-{Path(bundle).name}")
            suffix = names[i] + layout
            for mode in modes.split(","):
                if mode != "ar" and mode not in model.drafters:
                    skipped.append(f"{mode}{suffix} (not in {bundle}: it has {', '.join(model.drafters)})")
                    continue
                if layout == "@pinned" and mode == "ar":
                    continue  # the pinned layout is about the two sessions
                runners[mode + suffix] = OrtRunner(model, mode, draft_len)
                bases[mode + suffix] = "ar" + names[i]
    for note in skipped:
        click.echo(f"skipped: {note}", err=True)
    if hf:
        runners["hf"] = HfRunner(bundles[0], threads)
        bases["hf"] = "ar"
    ids = {row["id"]: encode_row(model, row) for row in rows}  # the bundles share the tokenizer
    for runner in runners.values():  # warm-up
        runner(ids[rows[0]["id"]], 8)
    results = {name: {} for name in runners}
    with click.progressbar(length=len(rows) * repeats * len(runners), label="generating",
                           file=sys.stderr) as bar:
        for row in rows:
            trials = {name: [] for name in runners}
            for _ in range(repeats):
                for name, runner in runners.items():  # interleaved: A, B, A, B, ...
                    trials[name].append(runner(ids[row["id"]], max_new_tokens))
                    bar.update(1)
            for name, runs in trials.items():
                runs.sort(key=rate)
                results[name][row["id"]] = runs[len(runs) // 2]
    report = {"machine": machine(), "threads": threads, "max_new_tokens": max_new_tokens,
              "prompts": str(prompts), "bundles": list(bundles), "draft_len": draft_len or "adaptive",
              "layouts": layouts, "skipped": skipped,
              "modes": {name: summarize(runs) for name, runs in results.items()}}
    modes_ = report["modes"]
    report["speedup"] = {name: modes_[name]["tokens_per_s"] / modes_[bases[name]]["tokens_per_s"] for name in modes_}
    report["speedup_by_kind"] = {name: speedups_by_kind(rows, results, name, bases[name]) for name in modes_}
    report["lossless"] = {name: modes_[name]["outputs"] == modes_[bases[name]]["outputs"] for name in modes_}
    _print_table(report)
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=1))
    if plot_out:
        plot(report, plot_out)


@main.command()
@click.option("--json", "json_out", type=click.Path(), help="write the rows here")
@click.option("--repeats", default=30, show_default=True)
def attention(json_out, repeats):
    """Per-layer attention time: TreeAttention (custom) vs ORT GQA vs ONNX Attention-23."""
    from .attention import IMPLS, bench_attention

    shapes = [(9, 3, 64), (32, 8, 128)]  # SmolLM2, Qwen3-8B
    rows = []
    grid = [(h, t, p, s) for h in shapes for t in (1, 2) for p in (128, 1024, 4096) for s in (1, 16, 64)]
    with click.progressbar(grid, label="attention", file=sys.stderr) as bar:
        for (heads, kv_heads, dim), threads, past, s in bar:
            for impl in IMPLS:  # interleaved per configuration
                us = bench_attention(impl, s, past, threads, heads, kv_heads, dim, past + s + 64, repeats)
                rows.append({"impl": impl, "S": s, "past": past, "threads": threads,
                             "heads": [heads, kv_heads, dim], "us": us})
    ratios = _ratios(rows, ("S", "past", "threads", "heads"), "custom", "gqa")
    click.echo(f"{'heads':>10s} {'thr':>3s} {'S':>3s} {'past':>5s} {'custom':>8s} {'gqa':>8s} {'onnx':>8s} {'gqa/custom':>10s}")
    for key, ratio in ratios.items():
        s, past, threads, heads = key
        us = {r["impl"]: r["us"] for r in rows if (r["S"], r["past"], r["threads"], tuple(r["heads"])) == key}
        click.echo(f"{','.join(map(str, heads)):>10s} {threads:3d} {s:3d} {past:5d} {us['custom']:8.0f} "
                   f"{us['gqa']:8.0f} {us['onnx']:8.0f} {ratio:10.2f}")
    if json_out:
        report = {"machine": machine(), "rows": rows,
                  "gqa_over_custom": [{"S": k[0], "past": k[1], "threads": k[2], "heads": list(k[3]), "ratio": v}
                                      for k, v in ratios.items()]}
        Path(json_out).write_text(json.dumps(report, indent=1))


@main.command()
@click.option("--json", "json_out", type=click.Path(), help="write the rows here")
@click.option("--threads", type=int, default=len(os.sched_getaffinity(0)), show_default=True)
def matmul(json_out, threads):
    """4-bit MatMul: MatMulQ4 (ours) vs ORT MatMulNBits at the default model's shapes."""
    from .matmul import bench_pair

    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # qkv, o, gate|up, down, lm_head
    rows = []
    with click.progressbar(shapes, label="matmul", file=sys.stderr) as bar:
        for K, N in bar:
            rows += bench_pair(K, N, [1, 2, 4, 16, 64], threads)
    ratios = _ratios(rows, ("K", "N", "M"), "q4", "nbits")
    click.echo(f"{'K':>5s} {'N':>6s} {'M':>3s} {'q4 us':>9s} {'nbits us':>9s} {'nbits/q4':>9s}")
    for (K, N, m), ratio in ratios.items():
        us = {r["impl"]: r["us"] for r in rows if (r["K"], r["N"], r["M"]) == (K, N, m)}
        click.echo(f"{K:5d} {N:6d} {m:3d} {us['q4']:9.1f} {us['nbits']:9.1f} {ratio:9.2f}")
    if json_out:
        report = {"machine": machine(), "threads": threads, "rows": rows,
                  "nbits_over_q4": [{"K": k[0], "N": k[1], "M": k[2], "ratio": v} for k, v in ratios.items()]}
        Path(json_out).write_text(json.dumps(report, indent=1))


def _ratios(rows, keys, a, b) -> dict:
    """time(b) / time(a) for each configuration (> 1: a is faster)."""
    by = {}
    for r in rows:
        key = tuple(tuple(r[k]) if isinstance(r[k], list) else r[k] for k in keys)
        by.setdefault(key, {})[r["impl"]] = r["us"]
    return {k: v[b] / v[a] for k, v in by.items()}


@main.command()
@click.option("--bundle", "bundles", multiple=True, required=True, help="bundle folder; repeat to compare")
@click.option("--threads", type=int, default=len(os.sched_getaffinity(0)), show_default=True)
@click.option("--repeats", default=20, show_default=True)
@click.option("--json", "json_out", type=click.Path(), help="write the rows here")
def verify(bundles, threads, repeats, json_out):
    """Whole-target forward time for S new rows (a verify of S candidates) at past 256 and 2048."""
    import time

    import numpy as np

    from dflash.runtime.target import Target, causal_mask
    from dflash.runtime.bundle import load_bundle

    targets = {}
    for path in bundles:
        info = load_bundle(path)
        targets[Path(path).name] = Target(info, threads)  # e.g. smollm2-gqa
    rows = []
    grid = [(past, s) for past in (256, 2048) for s in (1, 2, 4, 8, 16, 32)]
    with click.progressbar(grid, label="verify", file=sys.stderr) as bar:
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
            rows += [{"bundle": name, "past": past, "S": s, "ms": float(np.median(t))}
                     for name, t in times.items() if t]
    names = list(targets)
    click.echo(f"{'past':>5s} {'S':>3s} " + " ".join(f"{n:>14s}" for n in names) + "   (ms per forward)")
    for past, s in grid:
        ms = {r["bundle"]: r["ms"] for r in rows if (r["past"], r["S"]) == (past, s)}
        click.echo(f"{past:5d} {s:3d} " + " ".join(f"{ms.get(n, float('nan')):14.2f}" for n in names))
    if json_out:
        Path(json_out).write_text(json.dumps({"machine": machine(), "threads": threads, "rows": rows}, indent=1))


@main.command()
@click.option("--bundle", "bundles", multiple=True, required=True,
              help="bundle folder (peers use the first one's source weights); repeat, e.g. for its int4 twin")
@click.option("--prompts", default=str(BENCHMARK), show_default="the benchmark set",
              type=click.Path(exists=True), help="JSONL prompt file")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--threads", type=int, default=len(os.sched_getaffinity(0)), show_default=True)
@click.option("--peers", default="ortgenai,llamacpp,hf", show_default=True,
              help="comma-separated peers to run: ortgenai, llamacpp, hf (a missing one is skipped)")
@click.option("--peers-dir", default="peers", show_default=True, type=click.Path(),
              help="where peer models are built and cached")
@click.option("--json", "json_out", type=click.Path(), help="write the report here")
@click.option("--plot", "plot_out", type=click.Path(), help="write a PNG bar chart here")
def compare(bundles, prompts, max_new_tokens, threads, peers, peers_dir, json_out, plot_out):
    """This runtime vs onnxruntime-genai, llama.cpp and transformers: same weights, prompts, threads,
    greedy (peers: pip install -e '.[compare]')."""
    from .compare import compare as run

    run(bundles, load_prompts(prompts), prompts, max_new_tokens, threads,
        [p for p in peers.split(",") if p], peers_dir, json_out, plot_out)


def _print_table(report: dict) -> None:
    kinds = sorted({k for v in report["speedup_by_kind"].values() for k in v} - {"all"})
    click.echo(f"{'mode':22s} {'tok/s':>7s} {'speedup':>8s} {'tok/step':>8s} {'draft ms':>8s} "
               f"{'verify ms':>9s} {'same as ar':>10s}  speedup by kind: " + " ".join(kinds))
    for name, m in report["modes"].items():
        by_kind = report["speedup_by_kind"][name]
        click.echo(f"{name:22s} {m['tokens_per_s']:7.1f} {report['speedup'][name]:7.2f}x "
                   f"{m['mean_accept_len']:8.2f} {m.get('draft_ms_per_step', 0):8.1f} "
                   f"{m.get('verify_ms_per_step', 0):9.1f} {str(report['lossless'][name]):>10s}  "
                   + " ".join(f"{by_kind.get(k, float('nan')):.2f}x" for k in kinds))


@main.command()
@click.option("--bundle", required=True, type=click.Path(exists=True), help="bundle folder")
@click.option("--n", default=200, show_default=True, help="generations after the warm-up")
@click.option("--modes", help="comma-separated modes (default: ar and every drafter of the bundle)")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--threads", type=int, help="intra-op threads (default: every usable core)")
@click.option("--max-growth", default=5.0, show_default=True, help="allowed peak RSS growth after warm-up, %")
@click.option("--full/--no-full", default=True, show_default=True,
              help="check generation to a full cache, every mode against ar")
@click.option("--json", "json_out", type=click.Path(), help="write the report here")
def soak(bundle, n, modes, max_new_tokens, threads, max_growth, full, json_out):
    """Long run: N generations cycling through every mode and built-in prompts, greedy and sampled;
    fails if peak RSS grows more than --max-growth % after warm-up, or any mode differs from ar."""
    from .soak import soak as run, summary

    report = run(bundle, n, modes.split(",") if modes else None, max_new_tokens, threads, max_growth, full)
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=1))
    click.echo(summary(report))
    if not report["passed"]:
        sys.exit(1)


@main.command()
@click.option("--bundle", "bundles", multiple=True, required=True,
              help="bundle folder; repeat (agreement is measured against the first)")
@click.option("--text", "text_file", type=click.Path(exists=True), help="plain-text file (default: a shipped text)")
@click.option("--threads", type=int, help="intra-op threads (default: every usable core)")
@click.option("--json", "json_out", type=click.Path(), help="write the rows here")
def quality(bundles, text_file, threads, json_out):
    """Per bundle: perplexity on a text, top-1 agreement with the first bundle, a sample answer."""
    from .prompts import QUALITY_TEXT
    from .quality import quality as run

    text = Path(text_file or QUALITY_TEXT).read_text()
    rows = run(list(bundles), text, threads)
    click.echo(f"{'bundle':28s} {'dtype':5s} {'tokens':>6s} {'perplexity':>10s} {'agreement':>9s}")
    for r in rows:
        click.echo(f"{r['bundle']:28s} {r['dtype']:5s} {r['tokens']:6d} {r['perplexity']:10.2f} {r['agreement']:9.1%}")
    for r in rows:
        click.echo(f"\n{r['bundle']} ({r['dtype']}) answers {r['sample_prompt']!r}:\n{r['sample']}")
    if json_out:
        Path(json_out).write_text(json.dumps({"machine": machine(), "text": str(text_file or QUALITY_TEXT),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
