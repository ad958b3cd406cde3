"""`dflash-bench compare`: this runtime next to what users would pick instead, same weights and inputs.

    dflash-bench compare --bundle bundles/smollm2 --bundle bundles/smollm2-int4 \\
        --max-new-tokens 128 --threads 2 \\
        --json out/compare.json --plot out/compare.png

Rows, per runtime and mode (greedy everywhere, the same prompt token ids for every runtime: the
prompts are tokenized once with the bundle's tokenizer and chat template):
- dflash: `ar` and every drafter each bundle lists (`Model(bundle).drafters`), per bundle dtype;
- ortgenai (PyPI onnxruntime-genai): plain greedy at fp32 and int4, n-gram speculative decoding
  (its prompt lookup) at fp32 and int4, and draft-model speculative decoding with its own int4
  build drafting for its fp32 build (the analogue of our `self-int4`);
- llamacpp (PyPI llama-cpp-python) on the bundle's source GGUF as it is (e.g. Q4_1): greedy, and
  with `LlamaPromptLookupDecoding`;
- transformers, fp32 on the bundle's source weights: greedy, and assisted generation with prompt
  lookup (`prompt_lookup_num_tokens`). Assisted generation with an assistant model is not run:
  there is no smaller model with this tokenizer on hand.
- optimum-onnx is not run: it pins transformers < 4.58, this project pins 5.24.

Each row: decode tokens/s (tokens after the first, per second from the first token to the last;
median over prompts, and per prompt kind), prefill tokens/s (prompt tokens per second to the first
token), tokens per target call after the first token (ortgenai: from its speculative stats,
target forward passes + standard steps; llamacpp: its eval calls; transformers: streamer chunks),
and `lossless`: token-identical, on every prompt, to the same runtime's own greedy output at the
same precision. All runtimes share one process and run interleaved, prompt by prompt.

llama.cpp note: on a CPU with AMX, llama-cpp-python 0.3.36 (built from source with native flags)
segfaults in its AMX matmul on multi-token batches, so there it runs with use_extra_bufts=False
(no AMX / repacked weight buffers), which the report notes.

onnxruntime-genai's models are made by its model builder from the bundle's own source weights,
once, and cached under --peers-dir (default `peers/`, gitignored). The builder wants a Hugging Face
folder (it takes a GGUF only at fp16/fp32), so a GGUF source is first written out as one, dequantized
to fp32 by transformers exactly as `dflash-export` reads it. For the default bundle `bundles/smollm2`
the commands are:

    # peers/hf/smollm2: transformers' GGUF loader, then save_pretrained (see hf_folder below)
    python -m onnxruntime_genai.models.builder -i peers/hf/smollm2 -o peers/ortgenai/smollm2-fp32 \\
        -p fp32 -e cpu -c peers/cache
    python -m onnxruntime_genai.models.builder -i peers/hf/smollm2 -o peers/ortgenai/smollm2-int4 \\
        -p int4 -e cpu -c peers/cache

(int4 with the builder's CPU defaults: MatMulNBits, block 32, symmetric, accuracy_level 4 — the
quantization `dflash-export --dtype int4` uses too, run by our MatMulQ4 op instead.) onnxruntime-genai 0.18.0 needs onnxruntime>=1.31,
so it installs next to this project's onnxruntime==1.32.0 pin in the same environment.

The peers are imported only here, and this module only by `dflash-bench compare`: the runtime
never imports them. Install them with `pip install -e '.[compare]'`; a missing peer is skipped
with a note.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

from .common import OrtRunner

PEERS = ("ortgenai", "llamacpp", "hf")
INSTALL = "pip install -e '.[compare]'"
# onnxruntime-genai's n-gram settings: the example in its docs/SpeculativeDecoding.md.
ORTGENAI_NGRAM = {"ngram_size": 4, "max_draft_tokens": 8, "ngram_chained_lookup": True, "min_adaptive_k": 2}
ORTGENAI_DRAFT = {"max_draft_tokens": 4}  # its docs: "start with fixed max_draft_tokens=2 or 4"
HF_LOOKUP_TOKENS = 10  # the value transformers' docs use


@dataclass
class Row:
    runtime: str
    mode: str
    dtype: str
    run: Callable[[list[int], int], dict]  # (prompt ids, max new tokens) -> one run
    base: str = ""  # the name of the same runtime's greedy row at this precision ("" = this one)

    @property
    def name(self) -> str:
        return f"{self.runtime} {self.mode} {self.dtype}"


@dataclass
class Setup:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    builds: list[str] = field(default_factory=list)  # builder commands run or reused
    versions: dict = field(default_factory=dict)


def _timed(start: float, stamps: list[tuple[float, int]], tokens: list[int], steps: int) -> dict:
    """One run from its emission times: (time, tokens emitted then), first entry = first token(s)."""
    first_at, first_n = stamps[0]
    return {"tokens": tokens, "prefill_s": first_at - start, "decode_s": stamps[-1][0] - first_at,
            "decode_tokens": len(tokens) - first_n, "steps": steps}


# ---------------------------------------------------------------------------------------------
# this project


# ---------------------------------------------------------------------------------------------
# onnxruntime-genai


def hf_folder(source: str, out: Path) -> Path:
    """A Hugging Face folder of SOURCE (a folder is used as it is; a GGUF is dequantized to fp32
    by transformers and saved), for builders that want one."""
    if Path(source).is_dir():
        return Path(source)
    marker = out / "dflash_source.txt"
    if marker.is_file() and marker.read_text() == source:
        return out
    from dflash.export.sources import load

    loaded = load(source)
    model = loaded.model
    model.hf_quantizer = None  # the weights are plain fp32 tensors now; transformers refuses otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    loaded.tokenizer.save_pretrained(tmp)
    (tmp / "dflash_source.txt").write_text(source)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def build_ortgenai(hf: Path, out: Path, precision: str, cache: Path) -> str:
    """onnxruntime-genai's model builder on HF at PRECISION (CPU) into OUT, unless already built.
    Returns the command."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
           "-p", precision, "-e", "cpu", "-c", str(cache)]
    shown = " ".join(["python"] + cmd[1:])
    marker = out / "dflash_source.txt"
    if (out / "genai_config.json").is_file() and (not marker.is_file() or marker.read_text() == str(hf)):
        return shown
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log = out.with_name(out.name + ".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    click.echo(f"building onnxruntime-genai {precision} model (log: {log}): {shown}", err=True)
    with open(log, "w") as f:
        if subprocess.run(cmd[:6] + [str(tmp)] + cmd[7:], stdout=f, stderr=subprocess.STDOUT, check=False).returncode:
            raise RuntimeError(f"the model builder failed ({precision}); see {log}")
    (tmp / "dflash_source.txt").write_text(str(hf))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return shown


class OrtGenaiRunner:
    def __init__(self, folder: Path, threads: int, speculative: dict | None = None, draft: Path | None = None):
        import onnxruntime_genai as og

        self.og, self.speculative = og, speculative
        sessions = {"session_options": {"intra_op_num_threads": threads}}
        overlay = {"model": {"decoder": sessions}}
        if draft:  # a draft model: its decoder block, its file named relative to the target's folder
            block = json.loads((draft / "genai_config.json").read_text())["model"]["decoder"]
            block["filename"] = os.path.relpath(draft / block["filename"], folder)
            block["session_options"]["intra_op_num_threads"] = threads
            overlay["model"]["draft"] = block
        config = og.Config(str(folder))
        config.overlay(json.dumps(overlay))
        self.model = og.Model(config)

    def __call__(self, ids, max_new_tokens) -> dict:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + max_new_tokens, do_sample=False)
        if self.speculative:
            params.set_speculative_options(**self.speculative)
        generator = og.Generator(self.model, params)
        start = time.perf_counter()
        generator.append_tokens(np.array([ids], dtype=np.int32))
        stamps, tokens = [], []
        while not generator.is_done():
            generator.generate_next_token()  # one user-visible token per call, also when speculating
            stamps.append((time.perf_counter(), 1))
            tokens.append(int(generator.get_next_tokens()[0]))  # (the sequence leaves out EOS)
        steps = len(tokens) - 1
        if self.speculative:
            stats = generator.get_speculative_stats()
            steps = int(stats["target_forward_passes"] + stats["standard_fallback_steps"])
        return _timed(start, stamps, tokens, steps)


def ortgenai_rows(bundles: list, threads: int, peers_dir: Path, setup: Setup) -> None:
    import onnxruntime_genai

    setup.versions["onnxruntime-genai"] = onnxruntime_genai.__version__
    info = bundles[0].bundle
    name = Path(info.folder).name
    hf = hf_folder(info.source, peers_dir / "hf" / name)
    built = {}
    # the precisions of the bundles given: an int4-only run (a large model) builds no fp32 model
    ours = {b.bundle.graphs["target"]["dtype"] for b in bundles}
    for precision in [p for p in ("fp32", "int4") if p in ours]:
        out = peers_dir / "ortgenai" / f"{name}-{precision}"
        setup.builds.append(build_ortgenai(hf, out, precision, peers_dir / "cache"))
        built[precision] = out
    for precision, folder in built.items():
        base = f"ortgenai greedy {precision}"
        setup.rows.append(Row("ortgenai", "greedy", precision, OrtGenaiRunner(folder, threads)))
        setup.rows.append(Row("ortgenai", "ngram", precision, OrtGenaiRunner(folder, threads, ORTGENAI_NGRAM), base))
    if len(built) == 2:
        setup.rows.append(Row("ortgenai", "draft-int4", "fp32", OrtGenaiRunner(built["fp32"], threads, ORTGENAI_DRAFT,
                                                                            built["int4"]), "ortgenai greedy fp32"))


# ---------------------------------------------------------------------------------------------
# llama.cpp


def cpu_has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


class LlamaCppRunner:
    def __init__(self, gguf: Path, threads: int, n_ctx: int, eos: set[int], lookup: bool, extra_bufts: bool):
        import llama_cpp.llama_cpp as low
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        # Llama() takes its model parameters from this factory and has no argument for
        # use_extra_bufts (the AMX and weight-repacking buffers): set it through the factory.
        default = low.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = extra_bufts
            return p

        low.llama_model_default_params = params
        try:
            self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                             verbose=False, draft_model=LlamaPromptLookupDecoding() if lookup else None)
        finally:
            low.llama_model_default_params = default
        self.eos = eos | {self.llm.token_eos()}
        self.evals, eval_ = 0, self.llm.eval

        def counted(tokens):  # one eval = one model call (the prompt's, then one per step)
            self.evals += 1
            return eval_(tokens)

        self.llm.eval = counted

    def __call__(self, ids, max_new_tokens) -> dict:
        self.llm.reset()
        self.evals = 0
        tokens, stamps = [], []
        start = time.perf_counter()
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            tokens.append(int(token))
            stamps.append((time.perf_counter(), 1))
            if token in self.eos or len(tokens) >= max_new_tokens:
                break
        return _timed(start, stamps, tokens, self.evals - 1)


def llamacpp_rows(bundles: list, threads: int, n_ctx: int, setup: Setup) -> None:
    import llama_cpp

    setup.versions["llama-cpp-python"] = llama_cpp.__version__
    info = bundles[0].bundle
    gguf = Path(info.source)
    if gguf.suffix != ".gguf":
        setup.notes.append(f"llamacpp: skipped, the bundle's source is not a GGUF ({info.source})")
        return
    match = re.search(r"\.((?:I?Q\d\w*)|F16|BF16|F32)\.gguf$", gguf.name, re.IGNORECASE)
    dtype = match.group(1).lower() if match else "gguf"
    eos = set(info.eos_token_ids)
    extra = not cpu_has_amx()
    if not extra:
        setup.notes.append("llamacpp: run with use_extra_bufts=False (no AMX / repacked weight buffers): on this "
                           "AMX CPU llama-cpp-python 0.3.36's AMX matmul segfaults on multi-token batches")
    setup.rows.append(Row("llamacpp", "greedy", dtype, LlamaCppRunner(gguf, threads, n_ctx, eos, False, extra)))
    setup.rows.append(Row("llamacpp", "prompt-lookup", dtype, LlamaCppRunner(gguf, threads, n_ctx, eos, True, extra),
                          f"llamacpp greedy {dtype}"))


# ---------------------------------------------------------------------------------------------
# transformers


class _Stamps:
    """A generate() streamer that records when each batch of new tokens arrives."""

    def __init__(self):
        self.stamps, self.prompt_seen = [], False

    def put(self, value):
        if not self.prompt_seen:  # generate() first puts the prompt
            self.prompt_seen = True
            return
        self.stamps.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


class HfRunner:
    def __init__(self, model, threads: int, eos: set[int], lookup: int = 0):
        import torch

        torch.set_num_threads(threads)
        self.torch, self.model, self.eos, self.lookup = torch, model, sorted(eos), lookup

    def __call__(self, ids, max_new_tokens) -> dict:
        torch = self.torch
        inputs = torch.tensor([ids])
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=self.eos,
                      attention_mask=torch.ones_like(inputs))
        if self.lookup:
            kwargs["prompt_lookup_num_tokens"] = self.lookup
        streamer = _Stamps()
        with torch.no_grad():
            start = time.perf_counter()
            out = self.model.generate(inputs, streamer=streamer, **kwargs)
        tokens = out[0, len(ids):].tolist()
        return _timed(start, streamer.stamps, tokens, len(streamer.stamps) - 1)


def hf_rows(bundles: list, threads: int, setup: Setup) -> None:
    import transformers
    from dflash.export.sources import load

    setup.versions["transformers"] = transformers.__version__
    info = bundles[0].bundle
    model = load(info.source).model
    eos = set(info.eos_token_ids)
    setup.rows.append(Row("transformers", "greedy", "fp32", HfRunner(model, threads, eos)))
    setup.rows.append(Row("transformers", "prompt-lookup", "fp32", HfRunner(model, threads, eos, HF_LOOKUP_TOKENS),
                          "transformers greedy fp32"))
    setup.notes.append("transformers: assisted generation with an assistant model not run "
                       "(no smaller model with this tokenizer)")


# ---------------------------------------------------------------------------------------------
# the comparison

PEER_SETUP = {  # peer -> (modules it needs, what adds its rows)
    "ortgenai": (("onnxruntime_genai", "torch", "transformers"), "onnxruntime-genai"),
    "llamacpp": (("llama_cpp",), "llama-cpp-python"),
    "hf": (("torch", "transformers"), "transformers"),
}


def setup_rows(bundles: list[str], threads: int, peers: list[str], peers_dir: Path, n_ctx: int) -> tuple[Setup, list]:
    from dflash.runtime import Model

    setup = Setup()
    models = [Model(b, threads=threads) for b in bundles]
    for model in models:
        dtype = model.bundle.graphs["target"]["dtype"]
        setup.rows.append(Row("dflash", "ar", dtype, OrtRunner(model, "ar")))
        for mode in model.drafters:
            setup.rows.append(Row("dflash", mode, dtype, OrtRunner(model, mode), f"dflash ar {dtype}"))
    for peer in peers:
        modules, package = PEER_SETUP[peer]
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            setup.notes.append(f"{peer}: skipped, {', '.join(missing)} not installed ({INSTALL})")
            continue
        click.echo(f"setting up {package} ...", err=True)
        try:
            if peer == "ortgenai":
                ortgenai_rows(models, threads, peers_dir, setup)
            elif peer == "llamacpp":
                llamacpp_rows(models, threads, n_ctx, setup)
            else:
                hf_rows(models, threads, setup)
        except Exception as e:  # noqa: BLE001 - a peer that cannot be set up is a note, not a failure
            setup.notes.append(f"{peer}: skipped, setting it up failed: {type(e).__name__}: {e}")
    setup.notes.append("optimum-onnx: not run (it pins transformers < 4.58; this project pins transformers 5.24)")
    return setup, models


def summarize(row: Row, runs: dict[str, dict], kinds: dict[str, str], reference: dict | None) -> dict:
    def rate(r):
        return r["decode_tokens"] / r["decode_s"] if r["decode_tokens"] > 0 and r["decode_s"] > 0 else None

    by_kind = {}
    for pid, r in runs.items():
        for kind in ("all", kinds[pid]):
            if rate(r) is not None:
                by_kind.setdefault(kind, []).append(rate(r))
    steps = sum(r["steps"] for r in runs.values())
    summary = {"runtime": row.runtime, "mode": row.mode, "dtype": row.dtype, "base": row.base or row.name,
               "decode_tokens_per_s": statistics.median(by_kind["all"]) if by_kind.get("all") else None,
               "decode_tokens_per_s_by_kind": {k: statistics.median(v) for k, v in by_kind.items() if k != "all"},
               "prefill_tokens_per_s": statistics.median(r["prompt_tokens"] / r["prefill_s"] for r in runs.values()),
               "tokens_per_step": sum(r["decode_tokens"] for r in runs.values()) / steps if steps else None,
               "outputs": {pid: r["tokens"] for pid, r in runs.items()}}
    if reference is not None:
        summary["same_as_dflash_ar_fp32"] = sum(runs[p]["tokens"] == reference.get(p) for p in runs)
    return summary


def compare(bundles, rows, prompts_path, max_new_tokens, threads, peers, peers_dir, json_out, plot_out):
    from .common import machine

    peers_dir = Path(peers_dir)
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise click.BadParameter(f"unknown peer(s) {', '.join(sorted(unknown))}; choose from {', '.join(PEERS)}")
    from dflash.runtime.bundle import load_bundle
    from dflash.runtime.text import TextCodec

    codec = TextCodec(load_bundle(bundles[0]))  # tokenize once: every runtime gets these ids
    prompt_ids = {r["id"]: codec.encode_chat(r["messages"]) if "messages" in r else codec.encode_prompt(r["prompt"])
                  for r in rows}
    kinds = {r["id"]: r.get("kind", "other") for r in rows}
    n_ctx = max(len(ids) for ids in prompt_ids.values()) + max_new_tokens + 64
    setup, _models = setup_rows(list(bundles), threads, list(peers), peers_dir, n_ctx)
    for note in setup.notes:
        click.echo(f"note: {note}", err=True)

    live = list(setup.rows)
    first = rows[0]["id"]
    for row in list(live):  # warm-up; a row that fails is dropped with a note
        try:
            row.run(prompt_ids[first], 8)
        except Exception as e:  # noqa: BLE001
            setup.notes.append(f"{row.name}: dropped, it failed: {type(e).__name__}: {e}")
            click.echo(f"note: {setup.notes[-1]}", err=True)
            live.remove(row)
    results = {row.name: {} for row in live}
    with click.progressbar(length=len(rows) * len(live), label="comparing", file=sys.stderr,
                           item_show_func=lambda s: s) as bar:
        for prompt in rows:  # interleaved: every row on a prompt, then the next prompt
            ids = prompt_ids[prompt["id"]]
            for row in list(live):
                bar.update(1, f"{prompt['id']} {row.name}")
                try:
                    run = row.run(ids, max_new_tokens)
                except Exception as e:  # noqa: BLE001
                    setup.notes.append(f"{row.name}: dropped, it failed on {prompt['id']}: {type(e).__name__}: {e}")
                    live.remove(row)
                    results.pop(row.name)
                    continue
                run["prompt_tokens"] = len(ids)
                results[row.name][prompt["id"]] = run
    reference = results.get("dflash ar fp32")
    reference = {p: r["tokens"] for p, r in reference.items()} if reference else None
    report_rows = {row.name: summarize(row, results[row.name], kinds, reference) for row in live}
    for summary in report_rows.values():
        base = report_rows.get(summary["base"])
        summary["lossless"] = None if base is None else summary["outputs"] == base["outputs"]
    report = {"machine": machine(), "threads": threads, "max_new_tokens": max_new_tokens,
              "prompts": str(prompts_path), "prompt_count": len(rows), "bundles": list(bundles),
              "versions": setup.versions, "builder_commands": setup.builds, "notes": setup.notes,
              "settings": {"ortgenai ngram": ORTGENAI_NGRAM, "ortgenai draft": ORTGENAI_DRAFT,
                           "transformers prompt_lookup_num_tokens": HF_LOOKUP_TOKENS,
                           "llamacpp prompt-lookup": "LlamaPromptLookupDecoding() defaults"},
              "rows": report_rows}
    print_table(report)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(report, indent=1))
    if plot_out:
        plot(report, plot_out)
    return report


def print_table(report: dict) -> None:
    kinds = sorted({k for r in report["rows"].values() for k in r["decode_tokens_per_s_by_kind"]})
    n = report["prompt_count"]

    def num(x, fmt):
        return format(x, fmt) if x is not None else "–"

    click.echo(f"{'runtime mode dtype':34s} {'decode':>7s} {'prefill':>8s} {'tok/step':>8s} {'lossless':>8s} "
               f"{'=ours':>6s}  decode tok/s by kind: " + " ".join(kinds))
    for name, r in report["rows"].items():
        lossless = "ref" if r["base"] == name else str(r["lossless"])
        same = f"{r['same_as_dflash_ar_fp32']}/{n}" if "same_as_dflash_ar_fp32" in r else "–"
        click.echo(f"{name:34s} {num(r['decode_tokens_per_s'], '7.1f')} {num(r['prefill_tokens_per_s'], '8.0f')} "
                   f"{num(r['tokens_per_step'], '8.2f')} {lossless:>8s} {same:>6s}  "
                   + " ".join(num(r["decode_tokens_per_s_by_kind"].get(k), ".1f") for k in kinds))
    click.echo("(decode/prefill: tokens/s, medians over prompts; lossless: same tokens as the runtime's own "
               "greedy at that precision; =ours: prompts with the same tokens as dflash ar fp32)")
    for note in report["notes"]:
        click.echo(f"note: {note}")


COLORS = {"dflash": "#3b7dd8", "ortgenai": "#e07b39", "llamacpp": "#5aa469", "transformers": "#8e6bbf"}


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["rows"])
    rows = [report["rows"][n] for n in names]
    panels = [("all prompts", [r["decode_tokens_per_s"] or 0 for r in rows])]
    if any("grounded" in r["decode_tokens_per_s_by_kind"] for r in rows):
        panels.append(("grounded prompts", [r["decode_tokens_per_s_by_kind"].get("grounded", 0) for r in rows]))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 0.32 * len(names) + 1.6),
                             squeeze=False, sharey=True)
    labels = [n + ("" if r["lossless"] is not False else "  (NOT lossless)") for n, r in zip(names, rows)]
    y = np.arange(len(names))[::-1]
    for ax, (title, values) in zip(axes[0], panels):
        bars = ax.barh(y, values, color=[COLORS.get(r["runtime"], "grey") for r in rows],
                       hatch=["//" if r["lossless"] is False else "" for r in rows], edgecolor="white")
        ax.bar_label(bars, fmt="%.1f", padding=2, fontsize=8)
        ax.set_yticks(y, labels, fontsize=8)
        ax.set_xlabel("decode tokens/s (median over prompts)")
        ax.set_title(title)
        ax.set_xlim(0, max(values + [1]) * 1.15)
    m = report["machine"]
    fig.suptitle(f"{m['cpu']}, {m['cores']} cores, {report['threads']} threads, {report['max_new_tokens']} new "
                 f"tokens, greedy, {m['date']}; hatched: output differs from that runtime's greedy", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
