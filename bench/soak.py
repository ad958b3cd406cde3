"""`dflash-bench soak`: many generations on one Model, cycling through every mode, watching memory.

    dflash-bench soak --bundle bundles/smollm2 --n 200 --json out/soak.json

1. Full capacity: for every mode, a greedy generation that runs until the cache is full (finish
   reason "length") must be token-identical to `ar`'s. This also touches every cache page, so it
   runs first, as part of the warm-up.
2. Warm-up: `ar` on every prompt, every mode greedy and sampled on the longest one; then the
   peak and current RSS are recorded.
3. The soak: N generations cycling through the modes (ar and every drafter of the bundle) and the
   built-in prompts, greedy and sampled; every greedy one must equal `ar`'s on that prompt.
4. The peak RSS at the end may exceed the one after warm-up by at most --max-growth percent.
Exit status 1 if any check fails.
"""

from __future__ import annotations

import resource
import time

import click

PROMPTS = [
    {"messages": [{"role": "user", "content": "Why is the sky blue? Answer in two sentences."}]},
    {"prompt": "Once upon a time, in a small village by the sea,"},
    {"messages": [{"role": "user", "content": "Write a Python function that checks whether a string is a "
                                              "palindrome, with a docstring."}]},
    {"messages": [{"role": "user", "content": "List five fruits and one fact about each."}]},
    {"messages": [{"role": "user", "content": "Repeat this sentence three times: the quick brown fox "
                                              "jumps over the lazy dog."}]},
    {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"},
    {"messages": [{"role": "user", "content": (
        "Summarise this in one sentence: Speculative decoding lets a small, fast model propose several "
        "tokens ahead, and the large model checks all of them in a single forward pass. Every proposed "
        "token that matches what the large model would have produced is kept, so the output does not "
        "change, but the large model runs fewer times. How much this helps depends on how often the "
        "small model guesses right.")}]},
    {"messages": [{"role": "user", "content": "How do you say 'good morning' in French, German, Greek and "
                                              "Japanese? — réponds brièvement ✓"}]},
    {"messages": [{"role": "system", "content": "You are a terse assistant."},
                  {"role": "user", "content": "What is the capital of Italy?"},
                  {"role": "assistant", "content": "Rome."},
                  {"role": "user", "content": "And its population?"}]},
    {"prompt": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'},
    {"messages": [{"role": "user", "content": "What is 17 * 23? Show your steps."}]},
    {"messages": [{"role": "user", "content": "Write two short paragraphs about rivers."}], "stop": ["\n\n"]},
]
SAMPLED = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=40)]


def memory_mib() -> tuple[float, float]:
    """(peak RSS, current RSS) of this process in MiB: VmHWM and VmRSS, or getrusage's peak."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    fields[key] = int(value.split()[0]) / 1024  # kB
    except OSError:
        pass
    peak = fields.get("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return peak, fields.get("VmRSS", peak)


def soak(bundle, n: int, modes: list[str] | None = None, max_new_tokens: int = 64, threads: int | None = None,
         max_growth: float = 5.0, full: bool = True, memory=memory_mib, echo=None) -> dict:
    """Run the soak; returns the report (report["passed"] says whether every check held)."""
    from dflash.runtime import Model

    echo = echo or (lambda text: click.echo(text, err=True))
    start = time.perf_counter()
    model = Model(bundle, threads=threads)
    available = ["ar", *model.drafters]
    modes = modes or available
    unknown = [m for m in modes if m not in available]
    if unknown:
        raise click.ClickException(f"{bundle} has no mode {', '.join(unknown)}; it has: {', '.join(available)}")
    problems = []

    def run(i: int, mode: str, prompt: dict, sampled: bool, **extra):
        kwargs = dict(prompt)
        if sampled:
            kwargs.update(SAMPLED[i % len(SAMPLED)], seed=i)
        return model.generate(drafter=None if mode == "ar" else mode, truncate="left", **kwargs, **extra)

    ar_greedy = {}  # prompt index -> ar's greedy tokens

    def reference(p: int) -> list[int]:
        if p not in ar_greedy:
            ar_greedy[p] = run(0, "ar", PROMPTS[p], False, max_new_tokens=max_new_tokens).tokens
        return ar_greedy[p]

    # 1. every mode until the cache is full, against ar
    capacity = {}
    if full:
        echo(f"full capacity ({model.capacity} tokens): {len(modes)} modes")
        base = None
        for mode in ["ar", *(m for m in modes if m != "ar")]:
            r = run(0, mode, PROMPTS[1], False, max_new_tokens=model.capacity, ignore_eos=True)
            base = base or r.tokens
            same, rows = r.tokens == base, r.stats.prompt_tokens + len(r.tokens) - 1  # the last is not fed
            capacity[mode] = {"tokens": len(r.tokens), "cache_rows": rows, "finish_reason": r.finish_reason,
                              "same_as_ar": same}
            echo(f"  {mode:16s} {len(r.tokens):5d} tokens, cache {rows}/{model.capacity}, "
                 f"finish {r.finish_reason}, same as ar: {same}")
            if not same or r.finish_reason != "length" or rows != model.capacity:
                problems.append(f"full capacity, {mode}: cache {rows}/{model.capacity}, finish "
                                f"{r.finish_reason}, same tokens as ar: {same}")

    def schedule(i: int):  # generation i of the soak
        mode = modes[i % len(modes)]
        p = (i + i // len(modes)) % len(PROMPTS)
        return mode, p, (i // len(modes)) % 2 == 1

    # Warm-up: ar on every prompt (the references), and every mode greedy and sampled on the longest
    # prompt to the end of the budget, so that every session has met its largest inputs and touched
    # its cache rows as far as the soak will reach.
    for p in range(len(PROMPTS)):
        reference(p)
    plain = [{k: v for k, v in prompt.items() if k != "stop"} for prompt in PROMPTS]
    longest = max(plain, key=lambda prompt: len(model.encode(**prompt)))
    for mode in modes:
        for sampled in (False, True):
            run(1, mode, longest, sampled, max_new_tokens=max_new_tokens, ignore_eos=True)
    warmup = len(PROMPTS) + 2 * len(modes)
    after_warmup = memory()
    echo(f"after warm-up ({warmup} generations): peak RSS {after_warmup[0]:.0f} MiB, RSS {after_warmup[1]:.0f} MiB")
    finish, mismatches = {}, []
    for i in range(n):
        mode, p, sampled = schedule(i)
        r = run(i, mode, PROMPTS[p], sampled, max_new_tokens=max_new_tokens)
        if not sampled and r.tokens != reference(p):
            mismatches.append({"generation": i, "mode": mode, "prompt": p})
            problems.append(f"generation {i}: {mode} greedy differs from ar on prompt {p}")
        finish[r.finish_reason] = finish.get(r.finish_reason, 0) + 1
        peak, rss = memory()
        echo(f"[{i + 1:4d}/{n}] {mode:16s} {'sampled' if sampled else 'greedy ':7s} prompt {p:2d} "
             f"{len(r.tokens):4d} tokens {r.finish_reason:6s}  RSS {rss:6.0f} MiB  peak {peak:6.0f} MiB")
    end = memory()
    growth = 100 * (end[0] - after_warmup[0]) / after_warmup[0]
    if growth > max_growth:
        problems.append(f"peak RSS grew {growth:.1f}% after warm-up ({after_warmup[0]:.0f} -> {end[0]:.0f} MiB), "
                        f"more than {max_growth}%")
    from .common import machine

    return {
        "bundle": str(bundle), "n": n, "modes": modes, "max_new_tokens": max_new_tokens,
        "warmup": warmup,
        "capacity": model.capacity, "full_capacity": capacity,
        "peak_rss_mib": {"after_warmup": after_warmup[0], "end": end[0]},
        "rss_mib": {"after_warmup": after_warmup[1], "end": end[1]},
        "peak_growth_pct": growth, "rss_growth_pct": 100 * (end[1] - after_warmup[1]) / after_warmup[1],
        "max_growth_pct": max_growth, "finish_reasons": finish, "greedy_mismatches": mismatches,
        "problems": problems, "passed": not problems, "seconds": time.perf_counter() - start,
        "machine": machine(),
    }


def summary(report: dict) -> str:
    lines = [f"soak: {report['n']} generations over {', '.join(report['modes'])} "
             f"({report['seconds']:.0f} s); finish reasons {report['finish_reasons']}",
             f"peak RSS {report['peak_rss_mib']['after_warmup']:.0f} -> {report['peak_rss_mib']['end']:.0f} MiB "
             f"({report['peak_growth_pct']:+.2f}%, limit {report['max_growth_pct']}%); RSS "
             f"{report['rss_mib']['after_warmup']:.0f} -> {report['rss_mib']['end']:.0f} MiB "
             f"({report['rss_growth_pct']:+.2f}%)"]
    if report["full_capacity"]:
        same = all(v["same_as_ar"] for v in report["full_capacity"].values())
        lines.append(f"full capacity ({report['capacity']} tokens): every mode token-identical to ar: {same}")
    lines += [f"FAILED: {p}" for p in report["problems"]] or ["passed"]
    return "\n".join(lines)

