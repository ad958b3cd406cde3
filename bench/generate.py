"""`dflash-bench generate`: decode tokens/s per mode on a prompt file, every mode interleaved prompt
by prompt, outputs checked against plain decoding of the same bundle.

    dflash-bench generate --bundle bundles/smollm2 --bundle bundles/smollm2-int4 \\
        --max-new-tokens 128 --modes ar --hf --json out.json
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from unittest.mock import patch

import click

from .common import HfRunner, OrtRunner, encode_row, machine, rate, summarize


def layouts_for(threads: int, target_cores=None, draft_cores=None, small_pages=False) -> dict[str, dict]:
    """Model options per layout suffix: "" (every thread), "@pinned" (target and drafter on their own
    cores), "@4k" (weights left on 4 KB pages)."""
    layouts = {"": dict(threads=threads)}
    if target_cores or draft_cores:
        layouts["@pinned"] = dict(target_cores=target_cores, draft_cores=draft_cores)
    if small_pages:
        layouts["@4k"] = dict(threads=threads)
    return layouts


def make_runners(bundles, modes: list[str], draft_len, layouts: dict, sampling=None,
                 answer_memory: int = 0) -> tuple[dict, dict, list, object]:
    """({name: runner}, {name: the name it is compared with}, skipped notes, the last Model).
    A name is the mode, then the bundle's suffix ("" for the first bundle, then -DTYPE, or the
    folder name if an earlier bundle has that dtype), then the layout's suffix."""
    from dflash.runtime import Model

    runners, bases, skipped, names, dtypes = {}, {}, [], [], []
    for i, bundle in enumerate(bundles):
        for layout, options in layouts.items():
            pages = {"DFLASH_HUGE_PAGES": "0"} if layout == "@4k" else {}
            with patch.dict(os.environ, pages):  # read when the sessions are made
                model = Model(bundle, answer_memory=answer_memory, **options)  # one per bundle and layout
                for mode in set(modes) & set(model.drafters):
                    model.drafter(mode, draft_len)  # its sessions too
            if not layout:
                dtype = f"-{model.bundle.graphs['target']['dtype']}"
                names.append("" if i == 0 else dtype if dtype not in dtypes else f"-{Path(bundle).name}")
                dtypes.append(dtype)
            suffix = names[i] + layout
            for mode in modes:
                if mode != "ar" and mode not in model.drafters:
                    skipped.append(f"{mode}{suffix} (not in {bundle}: it has {', '.join(model.drafters)})")
                    continue
                if layout == "@pinned" and mode == "ar":
                    continue  # the pinned layout is about the two sessions
                runners[mode + suffix] = OrtRunner(model, mode, draft_len, sampling)
                bases[mode + suffix] = "ar" + names[i]
    return runners, bases, skipped, model


def run_interleaved(runners: dict, ids: dict[str, list[int]], max_new_tokens: int, repeats: int) -> dict:
    """{name: {prompt id: the median-rate run}}; per prompt the runners take turns: A, B, A, B, ..."""
    first = next(iter(ids.values()))
    for runner in runners.values():  # warm-up
        runner(first, 8)
    for runner in runners.values():  # no drafter may recite the warm-up's answer
        if isinstance(runner, OrtRunner):
            runner.model.forget_answers()
    results = {name: {} for name in runners}
    with click.progressbar(length=len(ids) * repeats * len(runners), label="generating", file=sys.stderr) as bar:
        for pid, prompt in ids.items():
            trials = {name: [] for name in runners}
            for _ in range(repeats):
                for name, runner in runners.items():
                    trials[name].append(runner(prompt, max_new_tokens))
                    bar.update(1)
            for name, runs in trials.items():
                runs.sort(key=rate)
                results[name][pid] = runs[len(runs) // 2]
    return results


def speedups_by_kind(rows, results, mode: str, base: str) -> dict:
    """Median per-prompt ratio of mode to base tokens/s, for all prompts and per prompt kind."""
    ratios = {}
    for row in rows:
        a, b = results[mode][row["id"]], results[base][row["id"]]
        if len(a["tokens"]) > 1 and len(b["tokens"]) > 1:
            for kind in ("all", row.get("kind", "other")):
                ratios.setdefault(kind, []).append(rate(a) / rate(b))
    return {kind: statistics.median(v) for kind, v in ratios.items()}


def ask_again(rows: list[dict]) -> list[dict]:
    """The prompt list, then every request once more (kind "again": a user repeating a request)."""
    return rows + [{**row, "id": f"{row['id']}-again", "kind": "again"} for row in rows]


def generate(bundles, rows: list[dict], modes: list[str], max_new_tokens: int, threads: int, draft_len=None,
             hf=False, layouts=None, repeats=1, sampling=None, answer_memory=0) -> dict:
    """The report: per mode its summary, speedup over its base, speedup by prompt kind, losslessness
    (greedy: the same tokens as `ar`; `sampling`: the same tokens as `ar` sampling with that seed).
    `answer_memory`: the Models' (see Model); each mode's drafters remember only their own answers."""
    if answer_memory and repeats > 1:
        raise click.UsageError("--answer-memory with --repeats above 1 would draft a prompt's later runs from "
                               "its first one: use --repeats 1 (and --ask-again to measure repeated requests)")
    layouts = layouts or layouts_for(threads)
    runners, bases, skipped, model = make_runners(bundles, modes, draft_len, layouts, sampling, answer_memory)
    for note in skipped:
        click.echo(f"skipped: {note}", err=True)
    if hf:
        runners["hf"] = HfRunner(bundles[0], threads)
        bases["hf"] = "ar"
    ids = {row["id"]: encode_row(model, row) for row in rows}  # the bundles share the tokenizer
    results = run_interleaved(runners, ids, max_new_tokens, repeats)
    summaries = {name: summarize(runs) for name, runs in results.items()}
    return {"machine": machine(), "threads": threads, "max_new_tokens": max_new_tokens,
            "bundles": list(bundles), "draft_len": draft_len or "adaptive", "layouts": layouts, "skipped": skipped,
            "answer_memory": answer_memory,
            "sampling": sampling or "greedy",
            "modes": summaries,
            "speedup": {name: summaries[name]["tokens_per_s"] / summaries[bases[name]]["tokens_per_s"]
                        for name in summaries},
            "speedup_by_kind": {name: speedups_by_kind(rows, results, name, bases[name]) for name in summaries},
            "lossless": {name: summaries[name]["outputs"] == summaries[bases[name]]["outputs"] for name in summaries}}


def print_table(report: dict) -> None:
    kinds = sorted({k for v in report["speedup_by_kind"].values() for k in v} - {"all"})
    click.echo(f"{'mode':22s} {'tok/s':>7s} {'speedup':>8s} {'tok/step':>8s} {'draft ms':>8s} "
               f"{'verify ms':>9s} {'same as ar':>10s}  speedup by kind: " + " ".join(kinds))
    for name, m in report["modes"].items():
        by_kind = report["speedup_by_kind"][name]
        click.echo(f"{name:22s} {m['tokens_per_s']:7.1f} {report['speedup'][name]:7.2f}x "
                   f"{m['mean_accept_len']:8.2f} {m.get('draft_ms_per_step', 0):8.1f} "
                   f"{m.get('verify_ms_per_step', 0):9.1f} {str(report['lossless'][name]):>10s}  "
                   + " ".join(f"{by_kind.get(k, float('nan')):.2f}x" for k in kinds))


def plot(report: dict, path: str) -> None:
    """Horizontal bars, a mode per row: speedup over its bundle's ar (labelled with tokens/s) and,
    for speculative modes, tokens per target call. A mode whose output differs from ar is red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    panels = [("speedup", "speedup over plain decoding (ar) of the same bundle")]
    if any(m != "hf" and report["modes"][m].get("accept_hist") for m in modes):
        panels.append(("mean_accept_len", "tokens per target call"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels) + 1.5, 0.3 * len(modes) + 1.4),
                             squeeze=False, sharey=True)
    colors = ["#c0392b" if report["lossless"].get(m) is False else "#3b7dd8" for m in modes]
    for ax, (key, label) in zip(axes[0], panels):
        if key == "speedup":
            values = [report["speedup"][m] for m in modes]
            texts = [f"{v:.2f}x  {report['modes'][m]['tokens_per_s']:.1f} tok/s" for v, m in zip(values, modes)]
            ax.axvline(1.0, color="gray", linewidth=0.8)
        else:
            values = [report["modes"][m].get(key) or 0.0 for m in modes]
            texts = [f"{v:.2f}" for v in values]
        bars = ax.barh(modes, values, color=colors)
        ax.bar_label(bars, labels=texts, padding=3, fontsize=8)
        ax.set_xlim(0, max(values) * 1.45)
        ax.set_xlabel(label)
    axes[0][0].invert_yaxis()  # the first mode on top (the axes share y: once is enough)
    m = report["machine"]
    kernels = f" ({m['kernels']} kernels)" if m.get("kernels") else ""
    memory = f", answer memory {report['answer_memory']} tokens" if report.get("answer_memory") else ""
    again = ", every prompt asked twice" if report.get("ask_again") else ""
    fig.suptitle(f"{m.get('cpu', '?')}{kernels}, {m['cores']} cores, {report['threads']} threads, "
                 f"{report['max_new_tokens']} new tokens, greedy{memory}{again}, {m.get('date', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
