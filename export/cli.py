"""`dflash-export`: turn a Hugging Face causal LM into a dflash bundle."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import click

from dflash.ops import KV_DTYPES

from .bundle import DiskFullError
from .ops import ATTENTION_IMPLEMENTATIONS, kv_stored_as
from .quantize import DTYPES
from .sources import SourceError
from .target import store_graph_kv_as


class Progress:
    """Numbered steps with elapsed time, so a long export never looks stuck."""

    def __init__(self, total: int):
        self.total, self.step, self.start = total, 0, time.perf_counter()

    def __call__(self, what: str) -> None:
        self.step += 1
        elapsed = time.perf_counter() - self.start
        click.echo(f"[{self.step}/{self.total} {elapsed:6.1f}s] {what}", err=True)


def parse_taps(text: str, num_layers: int) -> list[int]:
    from .target import default_taps

    if text == "auto":
        return default_taps(num_layers)
    try:
        taps = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise click.BadParameter(f"--taps takes 'auto' or layer ids like 1,8,14; got {text!r}")
    bad = [t for t in taps if not 0 <= t < num_layers]
    if bad or not taps:
        raise click.BadParameter(f"--taps {text!r}: layer ids must lie in 0..{num_layers - 1}")
    return taps


def quiet_libraries() -> None:
    """Keep the export's own progress readable: torch's and transformers' deprecation notices
    and the ONNX exporter's note about the (unused) torchvision ops say nothing to the user."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)


@click.group()
def main():
    """Export models into a dflash bundle (a folder the runtime loads)."""
    quiet_libraries()


@main.command()
@click.argument("src")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="bundle folder to write")
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True)
@click.option("--max-len", type=int, default=4096, show_default=True, help="KV-cache capacity in tokens")
@click.option("--taps", default="auto", show_default=True, help="tap layer ids for a drafter, or 'auto'")
@click.option("--attention", type=click.Choice(ATTENTION_IMPLEMENTATIONS), default="custom", show_default=True,
              help="custom: this project's TreeAttention op; gqa: ORT GroupQueryAttention; onnx: ONNX Attention-23")
@click.option("--matmul", type=click.Choice(["q4", "q8", "nbits"]),
              help="quantized MatMul kernel: q4 / q8 (this project's MatMulQ4 for int4 / MatMulQ8 for int8, "
                   "the default with --attention custom) or nbits (ORT MatMulNBits, with a padding row for "
                   "exact speculation)")
@click.option("--overwrite", is_flag=True, help="replace an existing bundle folder")
@click.option("--batched", is_flag=True,
              help="also write the batched target graph (many sequences per run, each with its own cache), "
                   "with which `dflash-train data --engine ort` answers many prompts at once")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a text file run through the fp32 model to weight the int4 search by the activations each "
                   "weight meets (an importance matrix); for weights a GGUF does not already hold quantized")
@click.option("--lm-head", "lm_head", type=click.Choice(["int8", "int4"]), default="int8", show_default=True,
              help="the lm_head's precision in an int4 target: int8 keeps it as llama.cpp does (a GGUF's Q8_0 "
                   "exactly); int4 is faster where the lm_head is a large share of the model and costs quality")
@click.option("--split-activations", is_flag=True,
              help="int4 / int8: quantize each MatMul's input as two int8 halves (~15-bit activations, as close to "
                   "fp32 as the weights allow); about free for one-token steps, twice the integer work of a "
                   "multi-row verify, so it suits plain decoding more than speculation")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default="fp32", show_default=True,
              help="how the KV cache stores its rows: fp16 halves and int8 (blocks of 32 with a scale) about "
                   "quarters the cache's memory and the time long contexts spend reading it")
def target(src, out, dtype, max_len, taps, attention, matmul, overwrite, batched, calibration, lm_head,
           split_activations, kv_dtype):
    """Export the target model SRC: a Hugging Face model folder, a .gguf file, or 'default'.

    A GGUF's quantized tensors are kept exactly at int4 and int8 (Q4_0/Q4_1/Q4_K as MatMulQ4,
    Q5_x/Q8_0 as MatMulQ8, Q6_K near-exactly); other weights are quantized here, int4 as searched
    asymmetric blocks with an int8 lm_head."""
    try:
        export_target(src, out, dtype, max_len, taps, attention, overwrite, matmul=matmul, batched=batched,
                      calibration=calibration, lm_head=lm_head, split_activations=split_activations,
                      kv_dtype=kv_dtype)
    except (SourceError, DiskFullError, FileExistsError) as e:
        raise click.ClickException(str(e))


def weight_plan_for(source, dtype: str, matmul: str, calibration: Path | None, progress, lm_head: str = "int8",
                    split_activations: bool = False):
    """The weight plan of a quantized target with our kernels (None for fp32 and MatMulNBits)."""
    from .quantize import weight_plan

    if lm_head != "int8" and dtype != "int4":
        raise SourceError(f"--lm-head {lm_head} applies to int4 targets (got --dtype {dtype})")
    if dtype == "fp32" or matmul not in ("q4", "q8"):
        if calibration:
            raise SourceError("--calibration applies to int4 / int8 targets with this project's kernels")
        if lm_head != "int8" or split_activations:
            raise SourceError("--lm-head and --split-activations apply to int4 / int8 targets with this project's "
                              "kernels (--attention custom)")
        return None
    importance = None
    if calibration:
        from .imatrix import importance as measure

        ids = source.tokenizer(calibration.read_text(), add_special_tokens=False)["input_ids"]
        if len(ids) < 2:
            raise SourceError(f"--calibration {calibration}: the text has fewer than two tokens")
        progress(f"measuring the importance matrix on {calibration} ({len(ids)} tokens)")
        importance = measure(source.model, ids)
    return weight_plan(source.path, dtype, importance, lm_head, split_activations)


def export_target(src, out, dtype="fp32", max_len=4096, taps="auto", attention="custom", overwrite=False,
                  source=None, matmul=None, batched=False, calibration=None, lm_head="int8",
                  split_activations=False, kv_dtype="fp32"):
    """Export SRC (or an already loaded `source`) as a target bundle in `out`."""
    from . import sources
    from .bundle import eos_token_ids, staging, write_manifest, write_tokenizer
    from .check import check_batched, check_target
    from .quantize import kernel_for
    from .target import kv_layout

    matmul = kernel_for(dtype, attention, matmul)  # q4, q8: rows round alike for any row count
    if batched and attention != "custom":
        raise SourceError(f"--batched needs --attention custom (this project's ops), not {attention}")
    if kv_dtype != "fp32" and attention != "custom":
        raise SourceError(f"--kv-dtype {kv_dtype} needs --attention custom (this project's ops), not {attention}")
    streamed = (source is None and not batched and not calibration and attention == "custom"
                and matmul in (None, "q4", "q8") and sources.streamable(src))
    progress = Progress((5 if dtype == "fp32" or streamed else 6)
                        + ((2 if dtype == "fp32" else 3) if batched else 0) + bool(calibration))
    progress(f"{'reading' if streamed else 'loading'} {src}")
    source = source or (sources.describe(src) if streamed else sources.load(src))
    config = source.config
    if max_len < 2:
        raise SourceError(f"--max-len {max_len} is too small; give the KV-cache capacity in tokens")
    tap_ids = parse_taps(taps, config.num_hidden_layers)
    plan = weight_plan_for(source, dtype, matmul, calibration, progress, lm_head, split_activations)
    with staging(Path(out), overwrite) as folder:
        if streamed:
            graph_file, refs = stream_graph(src, config, tap_ids, max_len, folder, dtype, plan, progress, kv_dtype)
        else:
            progress(f"exporting the {source.architecture} target graph "
                     f"({sum(p.numel() for p in source.model.parameters()) / 1e6:.0f}M parameters, "
                     f"attention {attention}, capacity {max_len})")
            graph_file = export_graph(source.model, tap_ids, max_len, attention, folder, "target", dtype, matmul,
                                      progress, plan=plan, kv_dtype=kv_dtype)
        graphs = {"target": {"file": graph_file, "dtype": dtype, "matmul": matmul}}
        if plan is not None:
            graphs["target"]["weights"] = dict(plan.counts)
            if split_activations:
                graphs["target"]["split_activations"] = True
            click.echo(f"  weights: {plan.summary()}", err=True)
        if batched:
            progress("exporting the batched target graph")
            graphs["target_batched"] = {**graphs["target"], "file": export_graph(
                source.model, tap_ids, max_len, attention, folder, "target_batched", dtype, matmul, progress, True,
                plan=plan, kv_dtype=kv_dtype)}
        progress("writing tokenizer and manifest")
        manifest = {
            "model_id": source.model_id, "source": source.path, "architecture": source.architecture,
            "graphs": graphs,
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "max_len": max_len, "kv": kv_layout(config, kv_dtype), "taps": tap_ids,
            "attention": attention, "ops_library": "dflash_ops" if attention == "custom" else None,
            "eos_token_ids": eos_token_ids(source.generation_config, source.tokenizer),
            "block_size": None, "mask_token_id": None,
            **write_tokenizer(source.tokenizer, folder),
        }
        write_manifest(folder, manifest)
        activations = "split (two int8)" if split_activations else "int8"
        reference = "torch" if dtype == "fp32" else f"torch with {dtype} weights and {activations} activations"
        progress(f"checking ONNX Runtime against {reference} on random inputs")
        if streamed:
            from .stream import compare

            diff = compare(folder, config, refs, matmul)
        else:
            diff = check_target(source.model, tap_ids, folder, plan=plan)
        verdict = "passed" if diff["passed"] else "FAILED"
        click.echo(f"  max |logits(ORT) - reference| = {diff['logits']:.3g} (bound {diff['logits_bound']:.3g}), "
                   f"taps {diff['taps']:.3g} (bound {diff['taps_bound']:.3g}): {verdict}", err=True)
        if "kv_logits" in diff:
            click.echo(f"  (checked with float32 caches; storing the cache's rows in {kv_dtype} moves the logits "
                       f"by {diff['kv_logits']:.3g} at most on these inputs)", err=True)
        if not diff["passed"]:
            raise SourceError(f"the exported {dtype} graph does not compute what the model does (see the check "
                              "above); nothing was written. This is a bug in the exporter or the op library: "
                              "please report it with the command you ran")
        manifest["export_check"] = diff
        if batched:
            progress("checking the batched graph against the target graph, sequence by sequence")
            if not check_batched(config, folder):
                raise SourceError("the batched target graph does not give each sequence what the target graph "
                                  "gives it alone; nothing was written. This is a bug in the exporter or the op "
                                  "library: please report it with the command you ran")
        write_manifest(folder, manifest)
    progress(f"bundle written to {out}")
    return manifest


def stream_graph(src, config, tap_ids, max_len, folder: Path, dtype, plan, progress, kv_dtype="fp32"):
    """The target graph streamed from the folder SRC (export/stream.py): its file name and the
    check's reference outputs."""
    from .stream import export_streamed

    if config.hidden_act not in ("silu", "swish"):
        raise SourceError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
    if getattr(config, "use_sliding_window", False):
        raise SourceError("sliding-window attention is not supported; export a full-attention model")
    name = "target" if dtype == "fp32" else f"target_{dtype}"
    progress(f"streaming the {config.model_type} target graph from {src} ({config.num_hidden_layers} layers, "
             f"{dtype}, capacity {max_len}), layer by layer with the check's reference")
    return export_streamed(Path(src), config, tap_ids, max_len, folder, name, plan,
                           lambda line: click.echo(line, err=True), kv_dtype)


def export_graph(model, tap_ids, max_len, attention, folder: Path, name: str, dtype, matmul, progress,
                 batched=False, plan=None, kv_dtype="fp32") -> str:
    """Export the target graph as folder/NAME.onnx, quantized to `dtype` with weight plan `plan`
    (then NAME_DTYPE.onnx, the fp32 one removed), its caches in format kv_dtype: the file name."""
    from .quantize import quantize
    from .target import export_onnx, kv_layout

    fp32_path = folder / f"{name}.onnx"
    export_onnx(model, tap_ids, max_len, attention, fp32_path, batched=batched)
    graph = fp32_path.name
    if dtype != "fp32":
        progress(f"quantizing to {dtype} ({ {'q4': 'MatMulQ4', 'q8': 'MatMulQ8'}.get(matmul, 'MatMulNBits')})")
        graph = f"{name}_{dtype}.onnx"
        quantize(fp32_path, folder / graph, dtype, matmul, plan=plan)
        fp32_path.unlink()
        (folder / f"{name}.onnx.data").unlink()
    store_graph_kv_as(folder / graph, kv_dtype, kv_layout(model.config)["head_dim"])
    return graph


@main.command("draft-lm")
@click.argument("src", required=False)
@click.option("--target", "target_dir", required=True, type=click.Path(path_type=Path),
              help="the target bundle the drafter is added to")
@click.option("--self", "self_dtype", type=click.Choice(["int8", "int4"]),
              help="draft with the target's own weights quantized to this type (no SRC)")
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True,
              help="the drafter's dtype (with SRC)")
def draft_lm(src, target_dir, self_dtype, dtype):
    """Add a draft model to a target bundle: SRC, a small causal LM with the target's
    tokenizer (HF folder or .gguf), as drafter `draft-lm`; or with --self the target
    quantized, as drafter `self-int4` (or `self-int8`)."""
    try:
        export_draft_lm(src, target_dir, self_dtype, dtype)
    except (SourceError, DiskFullError, FileExistsError) as e:
        raise click.ClickException(str(e))


def export_draft_lm(src, target_dir, self_dtype=None, dtype="fp32"):
    """Export the drafter as a complete bundle in a subfolder of the target bundle (named
    as the drafter) and list it in the target's manifest."""
    from . import sources
    from .bundle import write_manifest

    target_dir = Path(target_dir)
    manifest = read_target_manifest(target_dir)
    if (src is None) == (self_dtype is None):
        raise SourceError("give either SRC (a draft model) or --self int4|int8 (the target quantized)")
    name = f"self-{self_dtype}" if self_dtype else "draft-lm"
    if self_dtype:
        src, dtype = manifest["source"], self_dtype
    source = sources.load(src)
    check_same_tokenizer(source.tokenizer, target_dir / manifest["tokenizer"], src)
    export_target(src, target_dir / name, dtype, manifest["max_len"], "auto",
                  manifest["attention"], overwrite=True, source=source)
    manifest.pop("format_version", None)
    manifest["drafters"] = {**manifest.get("drafters", {}), name: {
        "dir": name, "model_id": source.model_id, "dtype": dtype}}
    write_manifest(target_dir, manifest)
    click.echo(f"drafter {name} ({source.model_id}, {dtype}) added to {target_dir}", err=True)


@main.command("drafter")
@click.argument("src")
@click.option("--target", "target_dir", required=True, type=click.Path(path_type=Path),
              help="the target bundle the drafter is added to")
@click.option("--dtype", type=click.Choice(DTYPES), default="int4", show_default=True,
              help="the drafter's weights: int4 / int8 run its MatMuls with MatMulQ4 / MatMulQ8 (MatMulNBits "
                   "without the op library). A drafter needs speed, not exactness (the target checks every "
                   "token): int4 drafts 2.6x (DFlash) to 4x (EAGLE-3) faster than fp32 for the default model "
                   "and is right about as often")
@click.option("--draft-vocab", type=int, help="score only the N most frequent tokens (a smaller lm_head)")
@click.option("--vocab-text", multiple=True, type=click.Path(path_type=Path),
              help="text or prompts .jsonl to count token frequencies in (default: an offline corpus)")
def drafter(src, target_dir, dtype, draft_vocab, vocab_text):
    """Add a drafter to a target bundle. SRC is a DFlash checkpoint folder in z-lab's layout
    (config.json + safetensors, e.g. z-lab/Qwen3-4B-DFlash-b16) trained for that target,
    'default' (the DFlash drafter this project trained for the default model), an EAGLE-3
    head folder (SafeAILab's `midlayer.*` layout or vllm-project/speculators' `layers.0.*`), or
    'default-eagle3' (the EAGLE-3 head this project trained for the default model)."""
    from .eagle3 import is_eagle3

    try:
        if src == "default-eagle3":
            export_eagle3(shipped(DEFAULT_EAGLE3), target_dir, dtype)
        elif src != "default" and is_eagle3(Path(src)):
            export_eagle3(src, target_dir, dtype)
        else:
            export_dflash(src, target_dir, dtype, draft_vocab=draft_vocab, vocab_text=vocab_text)
    except (SourceError, DiskFullError, FileExistsError) as e:
        raise click.ClickException(str(e))


DEFAULT_DRAFTER = Path(__file__).parent / "default_drafter"  # trained for the default model (issue 15)
DEFAULT_EAGLE3 = Path(__file__).parent / "default_eagle3"  # likewise, an EAGLE-3 head (issue 17)


def shipped(folder: Path) -> Path:
    """A drafter folder shipped with the package, or a clear error if the install lacks it."""
    if not (folder / "config.json").is_file():
        raise SourceError(f"the shipped drafter is missing from {folder}; reinstall dflash-ort")
    return folder


def export_dflash(src, target_dir, dtype="fp32", draft_vocab=None, vocab_text=()):
    """Export the drafter graph into the target bundle (drafter.onnx) and list it in the manifest;
    with `draft_vocab` N, the drafter scores only the N most frequent tokens of `vocab_text`."""

    from . import sources
    from .bundle import disk_full, write_manifest
    from .dflash import DFlashDrafter, export_onnx
    from .quantize import kernel_for

    target_dir = Path(target_dir)
    progress = Progress(4 + (dtype != "fp32") + bool(draft_vocab))
    manifest = read_target_manifest(target_dir)
    if src == "default":
        src = shipped(DEFAULT_DRAFTER)
    progress(f"loading the drafter {src} and the target's embedding and lm_head")
    drafter = DFlashDrafter.load(src)
    c = drafter.config
    target_config, embed, lm_head = sources.vocab_weights(manifest["source"])
    check_drafter_fits(c, target_config, manifest, src)
    if draft_vocab:
        from .draft_vocab import corpus_texts, frequent_tokens

        progress(f"choosing the {draft_vocab} most frequent tokens for the draft vocabulary")
        drafter.d2t = frequent_tokens(target_dir / "tokenizer.json", draft_vocab, corpus_texts(vocab_text),
                                      within=drafter.d2t)
    lm_head = lm_head.t().contiguous()
    capacity = manifest["max_len"] + c.block_size  # the block's scratch rows follow the context
    work = target_dir / ".drafter.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        progress(f"exporting the drafter graph ({c.layers} layers, block {c.block_size}, "
                 f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M parameters)")
        graph = "drafter.onnx"
        export_onnx(drafter, embed, lm_head, capacity, manifest["attention"], work / graph)
        if dtype != "fp32":
            graph = quantize_drafter(work, graph, dtype, manifest, progress)
        store_graph_kv_as(work / graph, kv_dtype_of(manifest), c.head_dim)
        progress("checking ONNX Runtime against the torch reference")
        diff = check_drafter(drafter, embed, lm_head, capacity, work / graph, manifest)
        click.echo(f"  max |logits(ORT) - logits(torch)| = {diff:.3g}", err=True)
        for old in target_dir.glob("drafter*.onnx*"):
            old.unlink()
        for name in (graph, graph + ".data"):
            (work / name).replace(target_dir / name)
    except OSError as e:
        clear = disk_full(e, target_dir)
        if clear:
            raise clear from e
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress("writing the manifest")
    manifest.pop("format_version", None)
    manifest["graphs"]["drafter"] = {"file": graph, "dtype": dtype, "matmul": kernel_for(dtype, manifest["attention"])}
    manifest.update(block_size=c.block_size, mask_token_id=c.mask_token_id)
    manifest["dflash"] = {"source": str(Path(src).resolve()), "block_size": c.block_size,
                          "mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids,
                          "capacity": capacity, "draft_vocab": None if drafter.d2t is None else len(drafter.d2t),
                          "refine": c.refine, "copy": c.copy,
                          "kv": {"layers": c.layers, "kv_heads": c.kv_heads, "heads": c.heads,
                                 "head_dim": c.head_dim, "dtype": kv_dtype_of(manifest)},
                          "export_check": {"logits": diff}}
    write_manifest(target_dir, manifest)
    return manifest


def quantize_drafter(work: Path, graph: str, dtype: str, manifest: dict, progress) -> str:
    """Quantize the drafter graph work/graph to `dtype`: the file name of the quantized graph. With
    the op library, MatMulQ8 / MatMulQ4 (the target's own kernels, the fastest here), else ORT's
    MatMulNBits. A drafter's rounding need not match anything: the target verifies every token."""
    from .quantize import kernel_for, quantize

    kernel = kernel_for(dtype, manifest["attention"])
    progress(f"quantizing to {dtype} ({ {'q4': 'MatMulQ4', 'q8': 'MatMulQ8'}.get(kernel, 'MatMulNBits')})")
    quantized = graph.replace(".onnx", f"_{dtype}.onnx")
    quantize(work / graph, work / quantized, dtype, kernel)
    return quantized


def export_eagle3(src, target_dir, dtype: str = "fp32") -> dict:
    """Export an EAGLE-3 head into the target bundle (eagle3.onnx, or eagle3_DTYPE.onnx) and list
    it in the manifest."""
    from . import sources
    from .bundle import write_manifest
    from .eagle3 import Eagle3Head, export_onnx
    from .quantize import kernel_for

    target_dir = Path(target_dir)
    progress = Progress(4 + (dtype != "fp32"))
    manifest = read_target_manifest(target_dir)
    progress(f"loading the EAGLE-3 head {src} and the target's embedding")
    tc, embed, _ = sources.vocab_weights(manifest["source"])
    head = Eagle3Head.load(src, tc.num_hidden_layers)
    c = head.config
    check_eagle3_fits(c, tc, manifest, src, target_dir)
    capacity = manifest["max_len"] + EAGLE3_SCRATCH_ROWS
    progress(f"exporting the head's graph ({c.layout} layout, taps {c.taps}, draft vocabulary "
             f"{c.draft_vocab_size})")
    work = target_dir / ".eagle3.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        graph = "eagle3.onnx"
        export_onnx(head, embed, capacity, manifest["attention"], work / graph)
        store_graph_kv_as(work / graph, kv_dtype_of(manifest), c.head_dim)  # kept by the quantization
        progress("checking ONNX Runtime against the torch reference")
        diff = check_eagle3(head, embed, capacity, work / graph, manifest)
        click.echo(f"  max |logits(ORT) - logits(torch)| = {diff:.3g}", err=True)
        if not diff <= 1e-3:
            raise SourceError(f"the exported EAGLE-3 graph differs from the torch head by {diff:.3g} (bound 1e-3)")
        if dtype != "fp32":
            graph = quantize_drafter(work, graph, dtype, manifest, progress)
            click.echo(f"  {dtype}: max |logits(ORT) - logits(torch fp32)| = "
                       f"{check_eagle3(head, embed, capacity, work / graph, manifest):.3g}", err=True)
        for old in target_dir.glob("eagle3*.onnx*"):
            old.unlink()
        for name in (graph, graph + ".data"):
            (work / name).replace(target_dir / name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress("writing the manifest")
    manifest.pop("format_version", None)
    manifest["graphs"]["eagle3"] = {"file": graph, "dtype": dtype, "matmul": kernel_for(dtype, manifest["attention"])}
    manifest["eagle3"] = {"source": str(Path(src).resolve()), "taps": c.taps, "capacity": capacity,
                          "hidden_size": c.hidden_size, "draft_vocab": c.draft_vocab_size,
                          "kv": {"kv_heads": c.kv_heads, "head_dim": c.head_dim, "dtype": kv_dtype_of(manifest)},
                          "export_check": {"logits": diff}}
    write_manifest(target_dir, manifest)
    return manifest


EAGLE3_SCRATCH_ROWS = 64  # rows past the committed ones that a tree draft may write


def check_eagle3_fits(c, target_config, manifest: dict, src, target_dir) -> None:
    """The head must match the target's width, vocabulary and depth, and the bundle must export
    the target states it reads."""
    other = "this head was made for another target"
    if c.target_hidden_size != target_config.hidden_size:
        raise SourceError(f"{src}: it reads target states {c.target_hidden_size} wide but the target's hidden size "
                          f"is {target_config.hidden_size}: {other}")
    if c.vocab_size != target_config.vocab_size:
        raise SourceError(f"{src}: vocabulary {c.vocab_size} differs from the target's {target_config.vocab_size}: "
                          f"{other}")
    layers = target_config.num_hidden_layers
    if not all(0 <= t < layers for t in c.taps):
        raise SourceError(f"{src}: it reads the outputs of layers {c.taps} but the target has {layers} layers: {other}")
    missing = [t for t in c.taps if t not in manifest["taps"]]
    if missing:
        taps = ",".join(map(str, sorted(set(manifest["taps"]) | set(c.taps))))
        raise SourceError(f"the head reads the outputs of target layers {c.taps} but the bundle's taps are "
                          f"{manifest['taps']}: re-export the target with `dflash-export target {manifest['source']} --out "
                          f"{target_dir} --taps {taps} --overwrite` (it keeps every drafter's taps)")


def check_eagle3(head, embed, capacity: int, graph: Path, manifest: dict) -> float:
    """Max |ORT - torch| of the head's logits for target rows, own rows and both."""
    import numpy as np
    import torch

    from .eagle3 import DrafterGraph, example_inputs

    session = check_session(graph, manifest)
    reference = DrafterGraph(head, embed, capacity)
    worst = 0.0
    for n, m in ((5, 0), (0, 3), (2, 2)):
        inputs = example_inputs(head.config, capacity, n=n, m=m, past=7, seed=n + m)
        feeds, inputs = cache_feeds(session, inputs, 2, manifest)
        out = session.run(["logits"], feeds)[0]
        with torch.no_grad(), kv_stored_as(kv_dtype_of(manifest)):
            worst = max(worst, float(np.abs(out - reference(*inputs)[3].numpy()).max()))
    return worst


def kv_dtype_of(manifest: dict) -> str:
    """The target's KV cache format: its drafters' caches store rows alike."""
    return manifest["kv"].get("dtype", "fp32")


def cache_feeds(session, inputs, caches: int, manifest: dict):
    """A drafter check's ORT feeds and reference inputs: its last `caches` inputs are its KV
    caches, fed in the bundle's format and given to the reference as the graph reads them."""
    from .check import stored_caches

    stored, as_read = stored_caches(inputs[-caches:], kv_dtype_of(manifest))
    inputs = (*inputs[:-caches], *as_read)
    values = [t.numpy() for t in inputs[:-caches]] + stored
    return {i.name: v for i, v in zip(session.get_inputs(), values)}, inputs


def read_target_manifest(target_dir: Path) -> dict:
    """The manifest of the target bundle a drafter or corpus is added to."""
    from .bundle import MANIFEST

    try:
        return json.loads((Path(target_dir) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SourceError(f"{target_dir} is not a readable dflash bundle ({e}); export the target first "
                          "with `dflash-export target`")


@main.command("corpus")
@click.argument("data", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--target", "target_dir", required=True, type=click.Path(path_type=Path),
              help="the target bundle the corpus is added to")
def corpus(data, target_dir):
    """Add the `suffix` drafter's corpus to a target bundle: the answers in the shard folders DATA
    (written by `dflash-train data` with this target, e.g. campaign/smollm2/answers)."""
    try:
        export_corpus(data, target_dir)
    except SourceError as e:
        raise click.ClickException(str(e))


CORPUS_FILE = "suffix_corpus.npy"


def export_corpus(folders, target_dir) -> dict:
    """Write the answers of the shard `folders` as one int32 array (answers separated by -1) into
    the target bundle and list it in the manifest."""
    import numpy as np
    from tokenizers import Tokenizer

    from dflash.runtime.suffix import END
    from dflash.train.shards import read_all

    from .bundle import write_manifest

    target_dir = Path(target_dir)
    manifest = read_target_manifest(target_dir)
    answers = [row["answer"] for folder in folders for row in read_all(Path(folder))]
    if not answers:
        raise SourceError(f"no answer shards (shard-*.npz) in {', '.join(map(str, folders))}; "
                          "write some with `dflash-train data`")
    tokens = np.concatenate([np.append(np.asarray(a, np.int32), END) for a in answers])
    vocab = Tokenizer.from_file(str(target_dir / manifest["tokenizer"])).get_vocab_size()
    if tokens.max() >= vocab:
        raise SourceError(f"the answers hold token id {tokens.max()} but {target_dir}'s tokenizer has "
                          f"{vocab} tokens: they were written by another target")
    np.save(target_dir / CORPUS_FILE, tokens)
    manifest.pop("format_version", None)
    manifest["suffix_corpus"] = {"file": CORPUS_FILE, "answers": len(answers),
                                 "tokens": int(len(tokens) - len(answers))}
    write_manifest(target_dir, manifest)
    click.echo(f"suffix corpus of {len(answers)} answers ({len(tokens) - len(answers)} tokens) added to "
               f"{target_dir}", err=True)
    return manifest


def check_drafter_fits(c, target_config, manifest: dict, src) -> None:
    """The drafter must read taps the target bundle produces, and embed a mask id it has."""
    layers = target_config.num_hidden_layers
    bad = [t for t in c.target_layer_ids if not 0 <= t < layers]
    if bad:
        raise SourceError(f"{src}: target_layer_ids {c.target_layer_ids} exceed the target's {layers} layers "
                          "(ids are layer outputs 0..N-1): this drafter was trained for another target")
    if c.hidden_size != target_config.hidden_size:
        raise SourceError(f"{src}: hidden size {c.hidden_size} differs from the target's "
                          f"{target_config.hidden_size}: this drafter was trained for another target")
    if not 0 <= c.mask_token_id < target_config.vocab_size:
        raise SourceError(f"{src}: mask_token_id {c.mask_token_id} lies outside the target's embedding "
                          f"(0..{target_config.vocab_size - 1}): this drafter was trained for another target")
    if not set(c.target_layer_ids) <= set(manifest["taps"]):
        taps = ",".join(map(str, sorted(set(manifest["taps"]) | set(c.target_layer_ids))))
        raise SourceError(f"the drafter reads target layers {c.target_layer_ids} but the bundle's taps are "
                          f"{manifest['taps']}: re-export the target with `--taps {taps}` (it keeps the "
                          "taps of the bundle's other drafters)")


def check_session(graph: Path, manifest: dict):
    """An ORT session on a freshly exported drafter graph, with the op library if the target uses it."""
    from types import SimpleNamespace

    from dflash.runtime.session import make_session

    # make_session reads only the op library from the manifest
    info = SimpleNamespace(manifest={"ops_library": "dflash_ops" if manifest["attention"] == "custom" else None})
    return make_session(graph, info, threads=None)


def check_drafter(drafter, embed, lm_head, capacity: int, graph: Path, manifest: dict) -> float:
    """Max |ORT - torch| of the drafter's logits for 0, 1 and B new context rows."""
    import numpy as np
    import torch

    from .dflash import DrafterGraph, example_inputs

    session = check_session(graph, manifest)
    reference = DrafterGraph(drafter, embed, lm_head, capacity)
    worst = 0.0
    for n in (0, 1, drafter.config.block_size):
        inputs = example_inputs(drafter.config, capacity, n=n, past=7, seed=n)
        feeds, inputs = cache_feeds(session, inputs, 2 * drafter.config.layers, manifest)
        out = session.run(["logits"], feeds)[0]
        with torch.no_grad(), kv_stored_as(kv_dtype_of(manifest)):
            worst = max(worst, float(np.abs(out - reference(*inputs)[0].numpy()).max()))
    return worst


def check_same_tokenizer(tokenizer, target_tokenizer_file: Path, src) -> None:
    """A draft model proposes token ids: they must mean the same strings to the target."""
    from tokenizers import Tokenizer

    ours, theirs = tokenizer.get_vocab(), Tokenizer.from_file(str(target_tokenizer_file)).get_vocab()
    if ours != theirs:
        differ = sum(theirs.get(token) != i for token, i in ours.items()) + abs(len(theirs) - len(ours))
        raise SourceError(f"{src} has another tokenizer than the target ({len(ours)} vs {len(theirs)} "
                          f"tokens, {differ} differ): a draft model must share the target's tokenizer; "
                          "pick one from the target's model family, or use --self int4")


if __name__ == "__main__":
    sys.exit(main())
