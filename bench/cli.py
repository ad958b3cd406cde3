"""`dflash-bench`: side-by-side measurements, interleaved in one run, reported as medians.
One module per command (generate, verify, attention, matmul, compare, soak, quality); this one only
parses options.

    dflash-bench generate --bundle bundles/smollm2 --bundle bundles/smollm2-int4 \\
        --max-new-tokens 128 --modes ar --hf --json out.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from .common import machine, ratios
from .prompts import BENCHMARK, QUALITY_TEXT, load_prompts

ALL_CORES = len(os.sched_getaffinity(0))


@click.group()
def main():
    """Benchmarks: every ratio comes from one interleaved run."""


def parse_cores(text: str | None) -> list[int] | None:
    from dflash.runtime.session import parse_cores as parse

    try:
        return parse(text)
    except ValueError as e:
        raise click.BadParameter(str(e))


def write_json(path: str | None, report: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=1))


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
@click.option("--threads", type=int, default=ALL_CORES, show_default=True)
@click.option("--target-cores", help="also run every speculative mode with the target pinned to these "
              "cores (e.g. 0) and ...")
@click.option("--draft-cores", help="... the drafter pinned to these (e.g. 1): modes suffixed @pinned")
@click.option("--small-pages", is_flag=True, help="also run every mode with the weights left on 4 KB "
              "pages (DFLASH_HUGE_PAGES=0): modes suffixed @4k")
@click.option("--repeats", default=1, show_default=True, help="runs per prompt (median taken)")
@click.option("--answer-memory", default=0, show_default=True, type=click.IntRange(min=0),
              help="tokens of its latest answers each copying drafter drafts from (Model's answer_memory)")
@click.option("--ask-again", is_flag=True, help="after the prompts, ask every one once more (kind \"again\"): "
              "with --answer-memory, a user repeating requests")
@click.option("--temperature", default=0.0, show_default=True,
              help="sample at this temperature (0: greedy); every mode then draws what `ar` draws")
@click.option("--top-p", default=1.0, show_default=True, help="with --temperature: nucleus sampling")
@click.option("--top-k", default=0, show_default=True, help="with --temperature: top-k sampling (0: off)")
@click.option("--seed", default=0, show_default=True, help="with --temperature: the sampling seed")
@click.option("--json", "json_out", type=click.Path(), help="write the report here")
@click.option("--plot", "plot_out", type=click.Path(), help="write a PNG bar chart here")
def generate(bundles, prompts, max_new_tokens, modes, draft_len, hf, threads, target_cores, draft_cores,
             small_pages, repeats, answer_memory, ask_again, temperature, top_p, top_k, seed, json_out, plot_out):
    """Decode tokens/s per mode on a prompt file, with outputs checked against `ar`."""
    from .generate import ask_again as repeated, generate as run, layouts_for, plot, print_table

    sampling = None
    if temperature > 0:
        if hf:
            raise click.UsageError("--hf runs transformers' greedy generate: drop --hf or --temperature")
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    layouts = layouts_for(threads, parse_cores(target_cores), parse_cores(draft_cores), small_pages)
    rows = load_prompts(prompts)
    report = run(bundles, repeated(rows) if ask_again else rows, modes.split(","), max_new_tokens, threads,
                 draft_len, hf, layouts, repeats, sampling, answer_memory)
    report = {"prompts": str(prompts), "ask_again": ask_again, **report}
    print_table(report)
    write_json(json_out, report)
    if plot_out:
        plot(report, plot_out)


@main.command()
@click.option("--json", "json_out", type=click.Path(), help="write the rows here")
@click.option("--repeats", default=30, show_default=True)
def attention(json_out, repeats):
    """Per-layer attention time: TreeAttention (custom) vs ORT GQA vs ONNX Attention-23."""
    from .attention import print_grid, run_grid

    rows = run_grid(repeats)
    gqa_over_custom = ratios(rows, ("S", "past", "threads", "heads"), "custom", "gqa")
    print_grid(rows, gqa_over_custom)
    write_json(json_out, {"machine": machine(), "rows": rows, "gqa_over_custom": [
        {"S": k[0], "past": k[1], "threads": k[2], "heads": list(k[3]), "ratio": v} for k, v in gqa_over_custom.items()]})


def kernel_paths(text: str) -> list[str]:
    """A --paths value as distinct kernel paths ("native" resolved), or a usage error naming the bad one."""
    from dflash.ops import resolve_kernel_path

    try:
        return list(dict.fromkeys(resolve_kernel_path(p) for p in text.split(",") if p))
    except ValueError as e:
        raise click.UsageError(str(e))


@main.command()
@click.option("--json", "json_out", type=click.Path(), help="write the rows here")
@click.option("--threads", type=int, default=ALL_CORES, show_default=True)
@click.option("--paths", default="native", show_default=True,
              help="MatMulQ4 kernel paths, comma-separated (native, avx2, portable); native is always timed")
def matmul(json_out, threads, paths):
    """4-bit MatMul: MatMulQ4 (ours, symmetric and asymmetric) vs ORT MatMulNBits at the default
    model's shapes."""
    from dflash.ops import native_kernel_path

    from .matmul import print_grid, run_grid

    rows = run_grid(threads, [p for p in kernel_paths(paths) if p != native_kernel_path()])
    nbits_over_q4 = ratios(rows, ("K", "N", "M"), "q4", "nbits")
    print_grid(rows, nbits_over_q4)
    as_rows = lambda found: [{"K": k[0], "N": k[1], "M": k[2], "ratio": v} for k, v in found.items()]
    write_json(json_out, {"machine": machine(), "threads": threads, "rows": rows,
                          "nbits_over_q4": as_rows(nbits_over_q4),
                          "q4a_over_q4": as_rows(ratios(rows, ("K", "N", "M"), "q4", "q4a"))})


@main.command()
@click.option("--bundle", "bundles", multiple=True, required=True, help="bundle folder; repeat to compare")
@click.option("--threads", type=int, default=ALL_CORES, show_default=True)
@click.option("--repeats", default=20, show_default=True)
@click.option("--paths", default="native", show_default=True,
              help="quantized MatMul kernel paths to time, comma-separated: native, avx2, portable")
@click.option("--json", "json_out", type=click.Path(), help="write the rows here")
def verify(bundles, threads, repeats, paths, json_out):
    """Whole-target forward time for S new rows (a verify of S candidates) at past 256 and 2048."""
    from .verify import print_table, time_forwards

    rows = time_forwards(bundles, threads, repeats, kernel_paths(paths))
    print_table(rows)
    write_json(json_out, {"machine": machine(), "threads": threads, "rows": rows})


@main.command()
@click.option("--bundle", "bundles", multiple=True, required=True,
              help="bundle folder (peers use the first one's source weights); repeat, e.g. for its int4 twin")
@click.option("--prompts", default=str(BENCHMARK), show_default="the benchmark set",
              type=click.Path(exists=True), help="JSONL prompt file")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--threads", type=int, default=ALL_CORES, show_default=True)
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
    write_json(json_out, report)
    click.echo(summary(report))
    if not report["passed"]:
        sys.exit(1)


@main.command()
@click.option("--bundle", "bundles", multiple=True, required=True,
              help="bundle folder; repeat (agreement is measured against the first)")
@click.option("--text", "text_file", type=click.Path(exists=True), help="plain-text file (default: a shipped text)")
@click.option("--threads", type=int, help="intra-op threads (default: every usable core)")
@click.option("--json", "json_out", type=click.Path(), help="write the rows here")
@click.option("--peers", default="", help="comma-separated: llamacpp (llama.cpp on the first bundle's source GGUF)")
def quality(bundles, text_file, threads, json_out, peers):
    """Per bundle: perplexity on a text, top-1 agreement with and KL divergence from the first
    bundle, a sample answer."""
    from .quality import print_table, quality as run

    peers = tuple(p for p in peers.split(",") if p)
    if set(peers) - {"llamacpp"}:
        raise click.BadParameter(f"unknown peer(s) {', '.join(sorted(set(peers) - {'llamacpp'}))}; known: llamacpp",
                                 param_hint="--peers")
    rows = run(list(bundles), Path(text_file or QUALITY_TEXT).read_text(), threads, peers=peers)
    print_table(rows)
    write_json(json_out, {"machine": machine(), "text": text_file or "the shipped text (bench/prompts/quality.txt)",
                          "rows": rows})


if __name__ == "__main__":
    main()


@main.command()
@click.argument("shapes", nargs=-1)
@click.option("--out", "out", required=True, type=click.Path(path_type=Path),
              help="folder to write the model folders in (one subfolder per shape)")
@click.option("--seed", default=0, show_default=True)
def shapes(shapes, out, seed):
    """Write random-weight Hugging Face folders of published shapes (bf16 safetensors, sharded):
    SHAPES among qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, llama-3.2-1b, llama-3.2-3b,
    llama-3.1-8b (all targets by default), and the drafters qwen3-4b-dflash-b16, qwen3-8b-dflash-b16
    (z-lab's DFlash layout) and llama-3.1-8b-eagle3 (an EAGLE-3 head). For speed and memory only:
    the weights are random."""
    from .shapes import DRAFTERS, SHAPES, write_drafter, write_folder

    for shape in shapes:
        if shape not in SHAPES and shape not in DRAFTERS:
            raise click.BadParameter(f"unknown shape {shape!r}; known: {', '.join([*SHAPES, *DRAFTERS])}")
    for shape in shapes or SHAPES:
        click.echo(f"writing {out / shape}", err=True)
        if shape in DRAFTERS:
            write_drafter(shape, out / shape, seed)
        else:
            write_folder(shape, out / shape, seed, lambda line: click.echo(line, err=True))
