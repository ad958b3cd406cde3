"""`dflash-train`: train a drafter for an exported target, on a CPU.

    dflash-train data --target bundles/smollm2 --out campaign/smollm2/answers --tokens 1000000
    dflash-train fit  --target bundles/smollm2 --data campaign/smollm2/answers --out out/drafter
    dflash-export drafter out/drafter --target bundles/smollm2
    dflash-train eval --bundle bundles/smollm2                # acceptance through ONNX Runtime
    dflash-train ship out/drafter --out export/default_drafter  # int8 matrices, as the package ships it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .data import DEFAULT_TEMPERATURE


@click.group()
def main():
    """Train a drafter for an exported target (the target stays frozen)."""
    from dflash.export.cli import quiet_libraries

    quiet_libraries()


def load_target(bundle):
    """The bundle's manifest and its source model in transformers (fp32)."""
    from dflash.export import sources

    manifest = json.loads((Path(bundle) / "dflash.json").read_text())
    return manifest, sources.load(manifest["source"])


@main.command()
@click.option("--target", "bundle", required=True, type=click.Path(exists=True), help="target bundle")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="shard folder (resumable)")
@click.option("--tokens", "answer_tokens", default=1_000_000, show_default=True,
              help="stop once the answers hold this many tokens")
@click.option("--max-new-tokens", default=320, show_default=True)
@click.option("--threads", default=0, help="threads for torch and ONNX Runtime (0: all cores)")
@click.option("--seed", default=0, show_default=True)
@click.option("--target-dtype", type=click.Choice(["fp32", "int4"]), default="fp32", show_default=True,
              help="answer with the target as it runs in a bundle of this precision (int4: its MatMuls emulate "
                   "MatMulQ4; its rows' ids start with q4r instead of r); give each its own --out")
@click.option("--engine", type=click.Choice(["torch", "ort"]), default="torch", show_default=True,
              help="torch: transformers, batched; ort: the bundle's own graph in ONNX Runtime, at its precision "
                   "(an int4 bundle answers ~3x faster than --target-dtype int4 one at a time, more with --batch; "
                   "its rows' ids start with q4o)")
@click.option("--batch", default=1, show_default=True,
              help="--engine ort: answers decoded together by the bundle's batched graph (export the bundle with "
                   "--batched); the answers are the same, token for token, as with --batch 1")
@click.option("--id-prefix", help="start every row id with this instead (a second job beside another one, with its "
                                  "own --out and --seed, needs its own so the two can be fitted together)")
@click.option("--recipe", type=click.Choice(["1", "2"]), default="1", show_default=True,
              help="1: the first campaign's request mix (prompts.py); 2: many more kinds of request, passages the "
                   "target writes and rewrites, deeper conversations (varied.py; its row ids start with v2)")
@click.option("--temperature", default=DEFAULT_TEMPERATURE, show_default=True, type=click.FloatRange(min=0),
              help="of the answers (top-p 0.95); 0: the target's greedy answers, the text the runtime drafts after "
                   "(a folder resumes only at the temperature it was started with)")
@click.option("--prompts", "prompt_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="answer your own requests instead of a recipe's: JSON lines of {\"prompt\": ...} or "
                   "{\"messages\": [...]} (e.g. your users' traffic); the job ends when they are answered; its row "
                   "ids start with p")
def data(bundle, out, answer_tokens, max_new_tokens, threads, seed, target_dtype, engine, batch, id_prefix, recipe,
         temperature, prompt_file):
    """The target's own sampled answers to self-written, template, grounded and follow-up requests
    (or to a prompt file's), in resumable shards (see dflash/train/data.py)."""
    import torch

    from .data import Target, read_requests, run

    try:
        requests = read_requests(prompt_file) if prompt_file else None
    except ValueError as e:
        raise click.ClickException(str(e))

    if threads:
        torch.set_num_threads(threads)
    _, source = load_target(bundle)
    prefix, sampler = "q4r" if target_dtype == "int4" else "r", None
    if batch != 1 and engine != "ort":
        raise click.UsageError("--batch is for --engine ort (the torch engine answers a whole round together)")
    if engine == "ort":
        from dflash.runtime.bundle import BundleError

        from .ort_sampler import OrtSampler

        if target_dtype != "fp32":
            raise click.UsageError("--engine ort answers at the bundle's own precision: drop --target-dtype "
                                   "and pass an int4 bundle as --target")
        try:
            sampler = OrtSampler(bundle, threads or None, batch)
        except BundleError as e:
            raise click.ClickException(str(e))
        prefix = {"fp32": "o", "int8": "q8o", "int4": "q4o"}[sampler.dtype]
    elif target_dtype == "int4":
        from .int4_target import emulate_int4

        emulate_int4(source.model, source.path)
    if requests is not None:
        prefix = "p" + prefix
    elif recipe == "2":
        prefix = "v2" + prefix
    try:
        run(Target(source, sampler), out, answer_tokens, seed, max_new_tokens,
            echo=lambda m: click.echo(m, err=True), prefix=id_prefix or prefix, recipe=int(recipe),
            temperature=temperature, requests=requests)
    except ValueError as e:
        raise click.ClickException(str(e))


@main.command()
@click.option("--target", "bundle", required=True, type=click.Path(exists=True), help="target bundle")
@click.option("--data", "data_dirs", required=True, multiple=True, type=click.Path(exists=True, path_type=Path),
              help="shard folder(s) written by `dflash-train data`")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="drafter folder (z-lab layout)")
@click.option("--cache", "cache_dir", type=click.Path(path_type=Path),
              help="where the target's features and soft labels are kept (default: OUT/cache)")
@click.option("--arch", type=click.Choice(["dflash", "eagle3"]), default="dflash", show_default=True,
              help="dflash: a block drafter; eagle3: an EAGLE-3 head with training-time test")
@click.option("--taps", "head_taps", help="eagle3: the three target layers (outputs) it reads; default: the "
              "bundle's taps nearest EAGLE-3's low, middle and high layers")
@click.option("--layers", default=1, show_default=True)
@click.option("--intermediate", type=int, help="dflash: the MLP's width (default: the target's); --init from a "
              "narrower drafter grows it (the new units start reading nothing)")
@click.option("--block", default=16, show_default=True)
@click.option("--draft-vocab", type=int, help="restrict outputs to the N most frequent answer tokens of the data "
              "(a --resume keeps the fit's own; the label cache serves any N)")
@click.option("--minutes", default=30.0, show_default=True, help="training time budget")
@click.option("--anchors", default=32, show_default=True, help="blocks per sequence and step")
@click.option("--lr", default=6e-4, show_default=True)
@click.option("--mask-token-id", default=0, show_default=True)
@click.option("--text-tokens", default=0, show_default=True,
              help="also label this many tokens of offline text (teacher-forced; see dflash/train/texts.py)")
@click.option("--threads", default=0, help="threads for torch and ONNX Runtime (0: all cores)")
@click.option("--seed", default=0, show_default=True)
@click.option("--resume", is_flag=True, help="continue from OUT/checkpoint.pt")
@click.option("--init", "init_from", type=click.Path(exists=True, file_okay=False),
              help="start from this drafter's weights (e.g. export/default_drafter or export/default_eagle3) "
                   "with a fresh optimizer; a DFlash drafter with more --layers grows from one with fewer "
                   "(its new layers start as the identity)")
@click.option("--greedy-only", is_flag=True,
              help="dflash: learn a block position only where the data before it is the target's greedy "
                   "choice (what a verify accepts), not past a sampled detour")
@click.option("--target-dtype", type=click.Choice(["fp32", "int4"]), default="fp32", show_default=True,
              help="dflash: label with the target as it runs in a bundle of this precision (int4: its MatMuls "
                   "emulate MatMulQ4); give each its own --cache")
@click.option("--int4-data", "int4_data_dirs", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="dflash: also train on answers an int4 target wrote (`data --target-dtype int4`, or `--engine "
                   "ort` on an int4 bundle), labelled in CACHE/int4 by the int4-emulating target (or --int4-bundle): "
                   "one drafter for fp32 and int4 bundles")
@click.option("--int4-share", type=click.FloatRange(0, 1),
              help="with --int4-data: the fraction of steps on those answers (default: by row count)")
@click.option("--int4-bundle", type=click.Path(exists=True, file_okay=False),
              help="with --int4-data: label those answers with this int4 bundle in ONNX Runtime (the exact taps "
                   "the runtime's drafter reads, several times faster than the emulation)")
@click.option("--from-round", type=int, multiple=True,
              help="train on the answers of rounds N on only (with --init: a session's new answers, without "
                   "labelling the earlier ones again); once for every folder, or once per folder in the order "
                   "given, --data folders then --int4-data folders  [default: 0]")
@click.option("--refine", is_flag=True,
              help="dflash: also learn a second pass over the block with the first pass's drafts in place of "
                   "the masks (the runtime then drafts in two calls; see dflash/train/objective.py)")
@click.option("--copy", is_flag=True,
              help="dflash: a copy-aware drafter, which also reads what prompt lookup copies into the block "
                   "(see DFlashDrafter.block_input); --init from a plain drafter starts its copy weights at zero")
def fit(bundle, data_dirs, out, cache_dir, arch, head_taps, layers, intermediate, block, draft_vocab, minutes,
        anchors, lr, mask_token_id, text_tokens, threads, seed, resume, init_from, greedy_only, target_dtype,
        int4_data_dirs, int4_share, int4_bundle, refine, copy, from_round):
    """Fit a DFlash drafter (or an EAGLE-3 head) with soft labels; checkpoints and a plot in OUT
    (see dflash/train/fit.py and eagle3.py)."""
    import torch

    from dflash.runtime.bundle import load_bundle

    from .fit import train

    if int4_bundle and not int4_data_dirs:
        raise click.ClickException("--int4-bundle labels the --int4-data answers: give --int4-data too")
    if int4_bundle and load_bundle(int4_bundle).graphs["target"]["dtype"] != "int4":
        raise click.ClickException(f"--int4-bundle {int4_bundle} is not an int4 bundle: export one with "
                                   "`dflash-export target ... --dtype int4`")
    empty = [str(d) for d in (*data_dirs, *int4_data_dirs) if not any(Path(d).glob("shard-*.npz"))]
    if empty:
        raise click.ClickException(f"no data shards in {', '.join(empty)}: run `dflash-train data` first")
    folders = len(data_dirs) + len(int4_data_dirs)
    if len(from_round) not in (0, 1, folders):
        raise click.ClickException(f"{len(from_round)} --from-round for {folders} data folders: give one for all, "
                                   "or one per folder (--data folders, then --int4-data folders)")
    if threads:
        torch.set_num_threads(threads)
    manifest, source = load_target(bundle)
    if arch == "eagle3":
        from . import eagle3

        if greedy_only:
            raise click.ClickException("--greedy-only is for --arch dflash (an EAGLE-3 head drafts one token a step)")
        if (target_dtype != "fp32" or int4_data_dirs or int4_bundle or refine or copy or any(from_round)
                or intermediate):
            raise click.ClickException("--target-dtype, --int4-data, --int4-bundle, --refine, --copy, --from-round "
                                       "and --intermediate are for --arch dflash; drop them for --arch eagle3")

        taps = [int(t) for t in head_taps.split(",")] if head_taps else None
        eagle3.train(source, manifest, data_dirs, out, cache_dir or Path(out) / "cache", taps=taps,
                     draft_vocab=draft_vocab or 8192, minutes=minutes, lr=min(lr, 3e-4), seed=seed, resume=resume,
                     text_tokens=text_tokens, init_from=init_from, echo=lambda m: click.echo(m, err=True))
        return
    try:
        train(source, manifest, data_dirs, out, cache_dir or Path(out) / "cache", layers=layers, block=block,
              draft_vocab=draft_vocab, minutes=minutes, anchors=anchors, lr=lr, mask_token_id=mask_token_id,
              seed=seed, resume=resume, text_tokens=text_tokens, init_from=init_from, greedy_only=greedy_only,
              target_dtype=target_dtype, int4_data_dirs=int4_data_dirs, int4_share=int4_share,
              int4_bundle=int4_bundle, refine=refine, copy=copy, from_round=list(from_round) or 0,
              intermediate=intermediate, echo=lambda m: click.echo(m, err=True))
    except ValueError as e:  # a bad --init (another shape): what to change
        raise click.ClickException(str(e))


@main.command("eval")
@click.option("--bundle", required=True, type=click.Path(exists=True))
@click.option("--prompts", type=click.Path(exists=True), help="JSONL prompt file (default: the benchmark set)")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--drafter", "drafter_name", default="dflash", show_default=True)
@click.option("--shard", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="instead of --prompts: one-turn requests of a data shard, 9 per source (a round the drafter "
                   "did not train on: acceptance on the data job's own sources; template requests repeat "
                   "verbatim across rounds and seeds, so their kinds can score recital, not drafting)")
def evaluate(bundle, prompts, max_new_tokens, drafter_name, shard):
    """Acceptance per block position and per prompt kind on a prompt file, through ONNX Runtime
    (a full block verified every step, so every position is tested)."""
    from dflash.bench.prompts import BENCHMARK, load_prompts

    from .evaluate import evaluate as run, position_rates, shard_prompts, tau

    if shard and prompts:
        raise click.UsageError("give --prompts or --shard, not both")
    rows = shard_prompts(shard) if shard else load_prompts(prompts or BENCHMARK)
    result = run(bundle, rows, max_new_tokens, drafter_name)
    hist, block = result["hist"], result["block"]
    click.echo(f"tau {tau(hist):.2f} over {sum(hist)} steps (block {block})")
    for position, rate in enumerate(position_rates(hist, block), 1):
        said = f"{rate:.2f} of the time it was reached" if rate is not None else "never reached"
        click.echo(f"  position {position}: accepted {said}")
    click.echo("tau by prompt kind: " + ", ".join(f"{kind} {tau(h):.2f}" for kind, h in sorted(result["by_kind"].items())))


@main.command()
@click.option("--bundle", required=True, type=click.Path(exists=True), help="the target bundle")
@click.option("--data", "data_dirs", required=True, multiple=True, type=click.Path(exists=True, path_type=Path),
              help="shard folder(s) whose answers form the corpus")
@click.option("--prompts", type=click.Path(exists=True), help="held-out prompts (default: the benchmark set)")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--json", "json_out", type=click.Path(path_type=Path))
def copying(bundle, data_dirs, prompts, max_new_tokens, json_out):
    """Simulate whether drafting from a corpus of the target's earlier answers (SuffixDecoding)
    adds acceptance over prompt lookup on held-out prompts (see dflash/train/copying.py)."""
    from dflash.bench.prompts import BENCHMARK, load_prompts
    from dflash.runtime import Model
    from dflash.runtime.suffix import SuffixIndex

    from . import shards
    from .copying import measure

    answers = [r["answer"] for d in data_dirs for r in shards.read_all(d)]
    corpus = SuffixIndex.from_answers(answers)
    model = Model(bundle)
    held_out = []
    for row in load_prompts(prompts or BENCHMARK):
        kwargs = {"messages": row["messages"]} if "messages" in row else {"prompt": row["prompt"]}
        result = model.generate(max_new_tokens=max_new_tokens, **kwargs)
        held_out.append({"kind": row.get("kind", "all"), "prompt": model.encode(**kwargs), "answer": result.tokens})
    tokens = sum(map(len, answers))
    report = {"corpus_tokens": tokens, "tau": measure(held_out, corpus)}
    click.echo(f"corpus: {len(answers)} answers, {tokens} tokens")
    for kind, t in report["tau"].items():
        click.echo(f"  {kind}: lookup tau {t['lookup']:.2f}, lookup+suffix {t['lookup+suffix']:.2f} "
                   f"(+{t['lookup+suffix'] - t['lookup']:.2f})")
    if json_out:
        json_out.write_text(json.dumps(report, indent=1))


@main.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="the folder to write (export/default_drafter ships with the package)")
def ship(src, out):
    """Write the DFlash drafter in SRC (a fit's OUT) compactly, as the package ships it: its
    matrices int8 with a scale per row, half of bf16's size (see dflash/export/compact.py)."""
    import shutil

    from dflash.export.dflash import DFlashDrafter
    from dflash.export.sources import SourceError

    from .fit import save

    try:
        drafter = DFlashDrafter.load(src)
    except SourceError as e:
        raise click.ClickException(f"{e} (ship takes the OUT folder of `dflash-train fit`)")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    save(drafter, drafter.config, drafter.d2t, out, compact=True)
    if (src / "training.png").is_file():
        shutil.copyfile(src / "training.png", out / "training.png")
    size = (out / "model.safetensors").stat().st_size / 1e6
    click.echo(f"wrote {out}: {size:.1f} MB of weights (int8 matrices)")


if __name__ == "__main__":
    sys.exit(main())
