"""What the benchmarks share: the machine's description, the runners, rates and summaries."""

from __future__ import annotations

import datetime
import os
import platform
import statistics


def machine() -> dict:
    import onnxruntime

    from dflash.ops import native_kernel_path

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__,
            "kernels": native_kernel_path(), "date": datetime.date.today().isoformat()}


class OrtRunner:
    """Generation with this project's runtime from token ids: mode "ar" (plain) or a drafter's
    name; greedy, or sampled with `sampling` (temperature, top_p, top_k, seed: every run draws
    the same tokens as plain sampling with that seed).  Serves `generate` and `compare`."""

    def __init__(self, model, mode: str, draft_len: int | None = None, sampling: dict | None = None):
        self.model, self.draft_len, self.sampling = model, draft_len, sampling or {}
        self.drafter = None if mode == "ar" else mode

    def __call__(self, ids: list[int], max_new_tokens: int) -> dict:
        result = self.model.generate(input_ids=ids, max_new_tokens=max_new_tokens, drafter=self.drafter,
                                     draft_len=self.draft_len, **self.sampling)
        s = result.stats
        return {"tokens": result.tokens, "decode_s": s.decode_ms / 1e3, "prefill_s": s.prefill_ms / 1e3,
                "prompt_tokens": s.prompt_tokens, "steps": s.steps, "decode_tokens": len(result.tokens) - 1,
                "draft_ms": s.draft_ms, "verify_ms": s.verify_ms, "accept_hist": s.accept_hist}


def encode_row(model, row: dict) -> list[int]:
    """A prompt-file row as token ids: its messages through the chat template, or its prompt."""
    return model.encode(messages=row["messages"]) if "messages" in row else model.encode(prompt=row["prompt"])


class HfRunner:
    """transformers' own greedy generate on the bundle's source weights, from token ids, same
    thread count."""

    def __init__(self, bundle, threads):
        import torch

        from dflash.export.sources import load
        from dflash.runtime import load_bundle

        torch.set_num_threads(threads)
        self.torch = torch
        info = load_bundle(bundle)
        self.source = load(info.source)
        self.eos = sorted(info.eos_token_ids)

    def __call__(self, ids: list[int], max_new_tokens: int) -> dict:
        import time

        inputs, eos = self.torch.tensor([ids]), self.eos
        with self.torch.no_grad():
            start = time.perf_counter()
            self.source.model.generate(inputs, max_new_tokens=1, do_sample=False, eos_token_id=eos)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            out = self.source.model.generate(inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                             eos_token_id=eos)
            total = time.perf_counter() - start
        tokens = out[0, len(ids):].tolist()
        return {"tokens": tokens, "decode_s": max(total - prefill, 1e-9), "prefill_s": prefill,
                "prompt_tokens": len(ids), "steps": len(tokens) - 1}


def rate(run: dict) -> float:
    """Decode tokens/s of one run: tokens after the first, per decode second."""
    return (len(run["tokens"]) - 1) / run["decode_s"] if len(run["tokens"]) > 1 else float("nan")


def summarize(runs: dict[str, dict]) -> dict:
    """Medians over prompts; acceptance and per-step times summed over all steps."""
    rates = [rate(r) for r in runs.values() if len(r["tokens"]) > 1]
    prefill = [r["prompt_tokens"] / r["prefill_s"] for r in runs.values()]
    steps = sum(r["steps"] for r in runs.values())
    accepted = sum(len(r["tokens"]) - 1 for r in runs.values())
    hist = [0] * max((len(r.get("accept_hist", [])) for r in runs.values()), default=0)
    for r in runs.values():
        for k, count in enumerate(r.get("accept_hist", [])):
            hist[k] += count
    tps = statistics.median(rates) if rates else 0.0
    summary = {"tokens_per_s": tps, "decode_ms_per_token": 1e3 / tps if tps else None,
               "prefill_tokens_per_s": statistics.median(prefill),
               "mean_accept_len": accepted / steps if steps else 1.0}
    if hist:
        summary.update(accept_hist=hist, draft_ms_per_step=sum(r["draft_ms"] for r in runs.values()) / steps,
                       verify_ms_per_step=sum(r["verify_ms"] for r in runs.values()) / steps)
    summary["outputs"] = {pid: r["tokens"] for pid, r in runs.items()}
    return summary


def ratios(rows: list[dict], keys, a: str, b: str) -> dict:
    """time(b) / time(a) for each configuration (> 1: a is faster); rows carry "impl" and "us"."""
    by = {}
    for r in rows:
        key = tuple(tuple(r[k]) if isinstance(r[k], list) else r[k] for k in keys)
        by.setdefault(key, {})[r["impl"]] = r["us"]
    return {k: v[b] / v[a] for k, v in by.items()}
