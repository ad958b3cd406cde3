"""Fit a DFlash drafter to the campaign's data (see objective.py for the loss).

The target's tap features and its top-k distribution at every position come from one
teacher-forced forward per sequence, kept in memory-mapped files in a local cache folder
(recomputable, never committed); building the cache and fitting both resume after an
interruption.  The target (embedding, lm_head, taps) stays frozen.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from pathlib import Path

import numpy as np

from . import shards, texts
from .objective import (block_logits, first_pass_drafts, label_rows, labelled_rows, position_weights, sample_anchors,
                        soft_loss)

SOFT_K = 16  # soft labels kept per position: the target's 16 most likely tokens


def load_sequences(folders, target, from_round=0) -> list[dict]:
    """Every shard row (of rounds `from_round` on: one round for all folders, or a list with one
    per folder) as {id, kind, source, prompt, answer} token ids, prompts rebuilt with the target's
    chat template from the row's provenance (a follow-up's parent may lie in an earlier round)."""
    starts = first_rounds(from_round, len(folders))
    read = [(r, start) for folder, start in zip(folders, starts, strict=True) for r in shards.read_all(folder)]
    rows = [r for r, _ in read]
    if not rows:
        raise FileNotFoundError(f"no shards in {', '.join(map(str, folders))}: run `dflash-train data` first")
    by_id = {r["id"]: r for r in rows}
    if len(by_id) < len(rows):
        raise ValueError(f"rows with the same id in {', '.join(map(str, folders))}: give each data folder "
                         "its own target dtype (row ids r... and q4r...), or fit one folder of each kind")
    out = []
    for r, start in read:
        if len(r["answer"]) < 2 or shards.round_of(r["id"]) < start:
            continue
        prompt = target.encode(target.render(shards.messages(r, by_id, target.decode)))
        out.append({"id": r["id"], "kind": r["kind"], "source": r["source"], "prompt": prompt, "answer": r["answer"]})
    return out


def first_rounds(from_round, folders: int) -> list[int]:
    """The first round to read of each of `folders` folders: `from_round` is one for all (an int or a
    one-item list), or a list of one per folder."""
    rounds = list(from_round) if isinstance(from_round, (list, tuple)) else [from_round]
    return rounds * folders if len(rounds) == 1 else rounds


def text_sequences(target, tokens: int, seed: int = 0, length: int = 384) -> list[dict]:
    """About `tokens` tokens of offline text (texts.py) in sequences of `length` tokens, for
    teacher-forced labelling: the target's distribution at every position is a label, whatever
    wrote the text.  Paragraphs are drawn in a seeded order from every source."""
    paragraphs = [p for source in texts.SOURCES for p in texts.paragraphs(source)]
    random.Random(seed).shuffle(paragraphs)
    rows, current, made = [], [], 0
    for paragraph in paragraphs:
        if made >= tokens:
            break
        current += target.encode(paragraph + "\n\n")
        if len(current) >= length:
            rows.append({"id": f"text{len(rows):06d}", "kind": "text", "source": "offline-text", "prompt": [],
                         "answer": current[:length]})
            made, current = made + length, []
    return rows


def draft_vocabulary(rows, size: int, vocab: int):
    """The `size` most frequent tokens of the answers (EAGLE-3's reduced vocabulary: the tokens
    a drafter has to draft; prompts, which multi-turn rows repeat, would skew the counts towards
    what prompt lookup copies anyway), ascending ids."""
    import torch

    counts = torch.zeros(vocab, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(torch.tensor(r["answer"]), minlength=vocab)
    return torch.sort(torch.topk(counts, min(size, vocab)).indices).values


def target_to_draft(d2t):
    """The inverse of a draft vocabulary (d2t: draft id -> target id): target id -> draft id, -1
    for every target id outside it (its last entry stands for all ids past the largest in d2t)."""
    import torch

    t2d = torch.full((int(d2t.max()) + 2,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    return t2d


def draft_ids(t2d, ids):
    """Target ids as draft ids (-1 outside the draft vocabulary); all of them when t2d is None."""
    return ids if t2d is None else t2d[ids.clamp(max=len(t2d) - 1)]


class LabelCache:
    """Per token of every sequence: the target's tap features (int8, one fp16 scale per tap) and
    its top-k distribution over the whole vocabulary (target ids), in memory-mapped files under
    `folder`.  A draft vocabulary `d2t` applies when a sequence is read, so one cache serves
    drafters of any draft vocabulary (caches from before stop 37 kept draft ids: they are labelled
    again).  int8 features take half of fp16's ~6 KB a token and leave the drafter's held-out
    estimate where it was (fit 9: 1.6637 fp16, 1.6654 int8).

    Sequences are stored by id in the order they were first labelled, and a later run keeps every
    labelled one it still uses: new answers and more offline text (a larger --text-tokens) are
    appended and labelled, nothing is rebuilt (~40 min per 1M tokens on 2 cores)."""

    ARRAYS = {"features": np.int8, "scales": np.float16, "soft_ids": np.int32, "soft_p": np.float16}

    def __init__(self, folder: Path, rows, taps, hidden: int, d2t=None, target_dtype: str = "fp32"):
        self.folder, self.taps, self.d2t = Path(folder), list(taps), d2t
        self.t2d = None if d2t is None else target_to_draft(d2t)
        identity = [self.taps, "whole-vocabulary labels"] + ([target_dtype] if target_dtype != "fp32" else [])
        kind = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.state_file = self.folder / "state.json"
        state = json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}
        labelled = [tuple(r) for r in state.get("rows", [])[:state.get("done", 0)]] if state.get("kind") == kind else []
        wanted = [(r["id"], len(r["prompt"]) + len(r["answer"])) for r in rows]
        lengths = dict(wanted)
        if any(rid in lengths and lengths[rid] != n for rid, n in labelled):
            labelled = []  # a sequence under the same id has another length: the cache is stale
        known = set(labelled)
        self.kind, self.done = kind, len(labelled)
        self.stored = labelled + [w for w in wanted if w not in known]  # storage order
        self.storage_offsets = np.cumsum([0] + [n for _, n in self.stored])
        where = {rid: k for k, (rid, _) in enumerate(self.stored)}
        self.slot = [where[rid] for rid, _ in wanted]  # training row i -> storage slot
        self.rows_by_id = {r["id"]: r for r in rows}
        kept_tokens = int(self.storage_offsets[self.done])
        widths = {"features": len(self.taps) * hidden, "scales": len(self.taps), "soft_ids": SOFT_K, "soft_p": SOFT_K}
        for name, dtype in self.ARRAYS.items():
            setattr(self, name, self._open(name, dtype, (int(self.storage_offsets[-1]), widths[name]), kept_tokens))

    def _open(self, name, dtype, shape, kept_tokens):
        """The array `name`, its first `kept_tokens` rows carried over from the cache on disk."""
        path = self.folder / f"{name}.npy"
        if kept_tokens and path.is_file():
            old = np.load(path, mmap_mode="r")
            if old.shape == shape:
                return np.lib.format.open_memmap(path, "r+")
            grown = np.lib.format.open_memmap(self.folder / f"{name}.grow.npy", "w+", dtype, shape)
            grown[:kept_tokens] = old[:kept_tokens]
            grown.flush()
            del old, grown
            (self.folder / f"{name}.grow.npy").replace(path)
            return np.lib.format.open_memmap(path, "r+")
        return np.lib.format.open_memmap(path, "w+", dtype, shape)

    def build(self, model, echo=print) -> None:
        """Run the target over every sequence not labelled yet, in storage order (resumable).
        `model`: a transformers model, or an OrtLabeller (the exported graph in ONNX Runtime)."""
        import torch

        start, first, total = time.perf_counter(), self.done, len(self.stored)
        with torch.inference_mode():
            for k in range(self.done, total):
                row = self.rows_by_id[self.stored[k][0]]
                features, logits = self._forward(model, row["prompt"] + row["answer"])
                lo, hi = self.storage_offsets[k], self.storage_offsets[k + 1]
                self.features[lo:hi], self.scales[lo:hi] = quantize_features(features.float().numpy(), len(self.taps))
                top = torch.softmax(logits.float(), -1).topk(SOFT_K, dim=-1)
                self.soft_ids[lo:hi] = top.indices.numpy()
                self.soft_p[lo:hi] = top.values.half().numpy()
                if (k + 1) % 50 == 0 or k + 1 == total:
                    self._save(k + 1)
                    rate = (self.storage_offsets[k + 1] - self.storage_offsets[first]) / (time.perf_counter() - start)
                    echo(f"  target labels: {k + 1}/{total} sequences, {rate:.0f} tok/s, "
                         f"ETA {(self.storage_offsets[-1] - self.storage_offsets[k + 1]) / rate / 60:.0f} min")

    def _forward(self, model, ids):
        """(tap features [L, T*H], logits [L, V]) of the sequence `ids`."""
        import torch

        if not isinstance(model, torch.nn.Module):
            return model(ids)
        out = model(torch.tensor([ids]), output_hidden_states=True)
        # tap id t is the OUTPUT of decoder layer t: hidden_states[t + 1]
        return torch.cat([out.hidden_states[t + 1][0] for t in self.taps], -1), out.logits[0]

    def _save(self, done: int) -> None:
        for array in (self.features, self.scales, self.soft_ids, self.soft_p):
            array.flush()
        self.done = done
        self.state_file.write_text(json.dumps({"kind": self.kind, "rows": self.stored[:done], "done": done}))

    def sequence(self, i: int):
        """(features [L, T*H] float32, soft ids [L, K] in the draft vocabulary (-1 outside it), soft
        probs [L, K]) of training row i."""
        import torch

        lo, hi = self._span(i)
        features = np.asarray(self.features[lo:hi], np.float32).reshape(hi - lo, len(self.taps), -1)
        features *= np.asarray(self.scales[lo:hi], np.float32)[..., None]
        ids = torch.from_numpy(np.asarray(self.soft_ids[lo:hi], np.int64))
        return (torch.from_numpy(features.reshape(hi - lo, -1)), draft_ids(self.t2d, ids),
                torch.from_numpy(np.asarray(self.soft_p[lo:hi])))

    def argmax(self, i: int):
        """[L] the target's argmax after each token of training row i (target ids)."""
        import torch

        lo, hi = self._span(i)
        return torch.from_numpy(np.asarray(self.soft_ids[lo:hi, 0], np.int64))

    def _span(self, i: int) -> tuple[int, int]:
        return self.storage_offsets[self.slot[i]], self.storage_offsets[self.slot[i] + 1]


def quantize_features(x: np.ndarray, taps: int) -> tuple[np.ndarray, np.ndarray]:
    """Tap features [L, taps*H] as int8 with one scale per token and tap (its absmax / 127)."""
    x = x.reshape(len(x), taps, -1)
    scales = (np.abs(x).max(-1) / 127).astype(np.float16)
    step = scales.astype(np.float32)[..., None]
    q = np.clip(np.rint(x / np.where(step > 0, step, 1)), -127, 127).astype(np.int8)
    return q.reshape(len(x), -1), scales


def block_labels(cache: LabelCache, i: int, anchors, block: int, greedy_tokens=None):
    """Soft labels [n, B-1, K] (ids, probs) and which block positions have one.  With the
    sequence's `greedy_tokens`, a position also needs the data between the anchor and it to be
    the target's greedy choices (greedy_path)."""
    _, ids, probs = cache.sequence(i)
    rows = label_rows(anchors, block, len(ids))
    valid = rows >= 0
    if greedy_tokens is not None:
        valid &= greedy_path(cache.argmax(i), greedy_tokens, rows, cache.t2d)
    return ids[rows.clamp(min=0)], probs[rows.clamp(min=0)], valid.float()


def greedy_path(argmax, tokens, rows, t2d=None):
    """[n, B-1] whether block position k's label is on the target's greedy path: every data token
    between the anchor and position k is the target's argmax (`argmax`: target ids), and one the
    draft vocabulary holds (`t2d`: target id -> draft id, -1 outside).  A verify accepts position
    k only then, so a label past a sampled detour, or past a token the drafter cannot draft,
    trains the drafter on a prefix it never drafts from."""
    import torch

    on = torch.zeros(len(tokens), dtype=torch.bool)  # on[r]: token r+1 is row r's argmax
    on[:-1] = tokens[1:] == argmax[:-1]
    on[:-1] &= draft_ids(t2d, tokens[1:]) >= 0
    steps = on[rows.clamp(min=0)]
    keep = torch.ones_like(steps)
    keep[:, 1:] = steps[:, :-1].int().cumprod(-1).bool()
    return keep


class MixedCaches:
    """Training rows labelled by two targets, each kind in its own LabelCache: rows
    0..len(first)-1 are the first cache's, the rest the second's."""

    def __init__(self, first: LabelCache, second: LabelCache):
        self.parts, self.d2t, self.t2d = (first, second), first.d2t, first.t2d
        self.split = len(first.slot)

    def sequence(self, i: int):
        return self.parts[0].sequence(i) if i < self.split else self.parts[1].sequence(i - self.split)

    def argmax(self, i: int):
        return self.parts[0].argmax(i) if i < self.split else self.parts[1].argmax(i - self.split)


def draw_row(pools, int4_share, rng) -> int:
    """A training row: from the second pool (the int4 answers) with probability `int4_share`."""
    if len(pools) > 1 and rng.random() < int4_share:
        return rng.choice(pools[1])
    return rng.choice(pools[0])


def held_out_split(n: int, start: int = 0) -> tuple[list[int], list[int]]:
    """(training, held-out) row ids of rows start..start+n-1: the newest 5% are held out."""
    held = max(1, n // 20)
    return list(range(start, start + n - held)), list(range(start + n - held, start + n))


def train(target_source, manifest: dict, data_dirs, out, cache_dir, layers=1, block=16, draft_vocab=None,
          minutes=30.0, anchors=32, lr=6e-4, mask_token_id=0, seed=0, resume=False, max_steps=None,
          text_tokens=0, init_from=None, greedy_only=False, target_dtype="fp32", int4_data_dirs=(),
          int4_share=None, int4_bundle=None, refine=False, copy=False, from_round=0, intermediate=None,
          echo=print) -> dict:
    """Fit a drafter; checkpoints (resumable) and the z-lab-layout drafter folder in `out`.
    `init_from`: a drafter folder to start from (a warm start, fresh optimizer; see warm_start);
    `greedy_only`: learn only labels on the target's greedy path (see greedy_path);
    `target_dtype` "int4": features and labels from the target computing as an int4 bundle does
    (int4_target.py); the drafter still reads the fp32 embedding and lm_head it is exported with.
    `int4_data_dirs`: answers an int4 target wrote (`data --target-dtype int4`, or `--engine ort` on an
    int4 bundle), labelled by the int4-emulating target in `cache_dir`/int4 and trained on alongside
    the others (one drafter for both);
    `int4_share`: the fraction of steps that draw one of those rows (default: by row count);
    `int4_bundle`: label those rows with this int4 bundle in ONNX Runtime instead (the taps the
    runtime's drafter reads, exactly, and several times faster than the emulation);
    `refine`: also learn the refining second pass (objective.py); each step costs two passes;
    `copy`: a copy-aware drafter (DFlashDrafter.block_input); its copy weights, new, learn at COPY_LR_SCALE
    times the rate;
    `from_round`: train on rounds N on only, one N for every folder or a list of one per folder
    (data_dirs, then int4_data_dirs);
    `intermediate`: the MLP's width (default: the target's); a warm start may grow it (see warm_start)."""
    import torch

    from dflash.export.dflash import DFlashConfig, DFlashDrafter

    from .data import Target

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    target = target_source.model.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tokenizer = Target(target_source)
    # offline text first: the held-out sequences are the newest answers (the last ones)
    starts = first_rounds(from_round, len(data_dirs) + len(int4_data_dirs))  # data_dirs, then int4_data_dirs
    rows = text_sequences(tokenizer, text_tokens, seed) + load_sequences(data_dirs, tokenizer, starts[:len(data_dirs)])
    tc = target.config
    # the drafter first: a --init of another shape is refused before any labelling (which can take an hour)
    config = DFlashConfig.from_dict(_zlab_config(tc, manifest, layers, block, mask_token_id, refine, copy,
                                                 intermediate))
    drafter = DFlashDrafter(config)
    _init(drafter, seed)
    if init_from and not resume:
        warm_start(drafter, init_from, echo)
    d2t = None
    if draft_vocab:
        # a resumed fit keeps its vocabulary; any other takes this data's most frequent tokens (a
        # warm start too: the drafter scores them with the target's own lm_head rows)
        d2t = saved_vocabulary(out, draft_vocab) if resume else None
        d2t = draft_vocabulary(rows, draft_vocab, tc.vocab_size) if d2t is None else d2t
    cache = LabelCache(cache_dir, rows, manifest["taps"], tc.hidden_size, d2t, target_dtype)
    if cache.done < len(cache.stored):
        cache.build(labeller(target, target_dtype, source_path=target_source.path), echo)
    train_ids, held_ids = held_out_split(len(rows))  # for the acceptance estimate
    pools = [train_ids]  # training rows by kind; a step draws a kind, then a row of it
    if int4_data_dirs:
        rows4 = load_sequences(int4_data_dirs, tokenizer, starts[len(data_dirs):])
        # the kind names the labeller: a cache the emulation labelled is relabelled by the bundle
        kind = "int4 bundle" if int4_bundle else "int4"
        cache4 = LabelCache(Path(cache_dir) / "int4", rows4, manifest["taps"], tc.hidden_size, d2t, kind)
        if cache4.done < len(cache4.stored):
            cache4.build(labeller(target, "int4", int4_bundle, manifest["taps"], target_source.path), echo)
        train4, held4 = held_out_split(len(rows4), len(rows))
        rows, cache = rows + rows4, MixedCaches(cache, cache4)
        held_ids = held_ids + held4
        pools = [train_ids, train4] if int4_share is not None else [train_ids + train4]
    # answers it trains on, scored like the held-out ones: the gap between the two says whether more
    # data (a wide gap: it memorizes) or a larger drafter (none) would help
    seen_ids = [i for pool in pools for i in pool if rows[i]["kind"] != "text"]
    seen_ids = random.Random(seed + 1).sample(seen_ids, min(64, len(seen_ids)))
    embed = target.get_input_embeddings().weight.detach().float()
    lm_head = target.lm_head.weight.detach().float().t().contiguous()
    if d2t is not None:
        lm_head = lm_head[:, d2t].contiguous()
    cos, sin = config.rotary_tables(max(len(r["prompt"]) + len(r["answer"]) for r in rows) + block + 1)
    # fused: one kernel over all parameters, its step ~7x faster than the default's
    new = [p for name, p in drafter.named_parameters() if name.startswith("copy_")]
    rest = [p for name, p in drafter.named_parameters() if not name.startswith("copy_")]
    groups = [{"params": rest, "scale": 1.0}] + ([{"params": new, "scale": COPY_LR_SCALE}] if new else [])
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.01, fused=True)
    checkpoint = out / "checkpoint.pt"
    state = resume_from(checkpoint, "drafter", drafter, optimizer, rng, echo) if resume else None
    state = state or {"step": 0, "seconds": 0.0, "history": []}
    weights = position_weights(block)
    bf16 = native_bf16()
    echo(f"training in {'bf16 autocast' if bf16 else 'fp32 (this CPU has no native bf16)'}")
    budget = minutes * 60
    eval_due = time.perf_counter() + 120
    while state["seconds"] < budget and (max_steps is None or state["step"] < max_steps):
        start = time.perf_counter()
        i = draw_row(pools, int4_share, rng)
        tokens = torch.tensor(rows[i]["prompt"] + rows[i]["answer"])
        picked = sample_anchors(len(rows[i]["prompt"]), len(tokens), anchors, rng)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(lr, state, budget) * group.get("scale", 1.0)  # none in older checkpoints
        features = cache.sequence(i)[0]
        label_ids, label_p, valid = block_labels(cache, i, picked, block, tokens if greedy_only else None)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if refine:  # the second pass reads the first pass's drafts at every position
                logits = block_logits(drafter, features, tokens, picked, embed, lm_head, cos, sin)
                refined = block_logits(drafter, features, tokens, picked, embed, lm_head, cos, sin,
                                       filled=first_pass_drafts(logits, d2t))
                loss = (soft_loss(logits, label_ids, label_p, valid, weights)
                        + soft_loss(refined, label_ids, label_p, valid, weights))
            else:  # the head only where a label weighs: the same loss, ~25% less time a step
                keep = labelled_rows(valid, label_ids)
                logits = block_logits(drafter, features, tokens, picked, embed, lm_head, cos, sin, rows=keep)
                loss = soft_loss(logits, label_ids[keep], label_p[keep], valid[keep], weights.expand_as(valid)[keep])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        state["step"] += 1
        state["seconds"] += step_seconds(start)
        if time.perf_counter() > eval_due or state["seconds"] >= budget or state["step"] == max_steps:
            eval_start = time.perf_counter()
            tau = held_out_tau(drafter, rows, cache, held_ids, embed, lm_head, cos, sin)
            seen_tau = held_out_tau(drafter, rows, cache, seen_ids, embed, lm_head, cos, sin)
            state["history"].append({"step": state["step"], "minutes": state["seconds"] / 60,
                                     "loss": loss.item(), "tau": tau, "train_tau": seen_tau})
            echo(f"  step {state['step']}, {state['seconds'] / 60:.1f}/{minutes:.0f} min, loss {loss.item():.3f}, "
                 f"held-out tau {tau:.2f} (on {len(seen_ids)} training answers {seen_tau:.2f})")
            save(drafter, config, d2t, out)
            torch.save({"drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(), "state": state,
                        "rng": rng.getstate()}, checkpoint)
            eval_due = next_eval_at(eval_start)
    save(drafter, config, d2t, out)
    plot_history(state["history"], out / "training.png")
    return state


def labeller(target, target_dtype: str, bundle=None, taps=(), source_path=None):
    """The model whose forward gives the cache its features and labels: `bundle` (an exported
    target, run in ONNX Runtime), else the transformers target (int4: emulating the int4 bundle
    exported from `source_path`)."""
    if bundle is not None:
        import torch

        from .ort_sampler import OrtLabeller

        # as many threads as torch was given (fit --threads), so a data job beside it keeps its core
        return OrtLabeller(bundle, list(taps), target.config.vocab_size, threads=torch.get_num_threads())
    if target_dtype == "fp32":
        return target
    if target_dtype != "int4":
        raise ValueError(f"target_dtype {target_dtype!r}: fp32 or int4")
    import copy

    from .int4_target import emulate_int4

    return emulate_int4(copy.deepcopy(target), source_path)  # a copy: the drafter keeps the fp32 embedding and lm_head


def saved_vocabulary(folder: Path, size: int):
    """The draft vocabulary of the drafter a fit saved in `folder`, if there is one of `size` tokens."""
    from dflash.export.dflash import DFlashDrafter

    if not (Path(folder) / "model.safetensors").is_file():
        return None
    d2t = DFlashDrafter.load(folder).d2t
    return d2t if d2t is not None and len(d2t) == size else None


def warm_start(drafter, folder, echo) -> None:
    """Copy the weights of the drafter in `folder`: the same shape, or fewer layers (a deeper
    drafter grown from it: the layers it lacks start as the identity, their output projections
    zero, so training starts from exactly the drafts of the one in `folder`), or a narrower MLP (a
    wider one grown from it: the new units keep their random input weights and get zero output
    weights, the same drafts again), or a plain one into a copy-aware one (its copy weights start at
    zero: the same drafts, until trained)."""
    import torch

    from dflash.export.dflash import DFlashDrafter

    source = DFlashDrafter.load(folder)
    keys = ("hidden_size", "block_size", "target_layer_ids")
    differ = [k for k in keys if getattr(drafter.config, k) != getattr(source.config, k)]
    if source.config.layers > drafter.config.layers:
        differ.append("layers")
    if source.config.intermediate_size > drafter.config.intermediate_size:
        differ.append("intermediate_size")
    if source.config.copy and not drafter.config.copy:
        differ.append("copy")
    if differ:
        raise ValueError(f"--init {folder} has another shape ({', '.join(differ)} differ): give the same "
                         "--block (and --layers and --intermediate at least its own, --copy if it has it), "
                         "or drop --init")
    own = drafter.state_dict()
    with torch.no_grad():
        for name, weights in source.state_dict().items():
            if name.endswith("mlp.down_proj.weight"):  # [hidden, intermediate]: the new columns read nothing
                own[name].zero_()
            own[name][tuple(slice(0, n) for n in weights.shape)] = weights
        missing = [name for name in own if name not in source.state_dict()]
        assert all(k.startswith(("layers.", "copy_")) for k in missing), missing
        for name, p in drafter.named_parameters():
            if name in missing and name.startswith("copy_"):
                p.zero_()
        for layer in drafter.layers[source.config.layers:]:
            for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                projection.weight.zero_()
                if projection.bias is not None:
                    projection.bias.zero_()
    grown = drafter.config.layers - source.config.layers
    wider = drafter.config.intermediate_size - source.config.intermediate_size
    echo(f"started from the weights in {folder}" + (f", {grown} more layer(s) as the identity" if grown else "")
         + (f", {wider} more MLP units reading nothing yet" if wider else "")
         + (", its copy weights at zero" if drafter.config.copy and not source.config.copy else ""))


# A copy-aware drafter's copy weights start at zero from a warm start, so they learn faster than the
# trained weights around them: the scratch fit that found the idea (stop 42) used ~3x; not tuned
COPY_LR_SCALE = 3.0


# A step takes well under a second; one that took longer than this was paused (SIGSTOP while
# something was timed) and counts as this much, so pausing a fit does not spend its budget.
MAX_STEP_SECONDS = 5.0


def next_eval_at(started: float) -> float:
    """When the held-out estimate that began at `started` (time.perf_counter()) and just ended is
    next due: 2 minutes on, or later where estimates are slow (one thread: ~30 s for the two
    sets), so they take at most a fifth of the wall time."""
    now = time.perf_counter()
    return now + max(120.0, 4 * (now - started))


def step_seconds(start: float) -> float:
    """The seconds of training a step that began at `start` (time.perf_counter()) counts."""
    return min(time.perf_counter() - start, MAX_STEP_SECONDS)


def learning_rate(peak: float, state: dict, budget: float) -> float:
    """Warm-up over 50 steps, then cosine over the time budget (seconds of training)."""
    progress = min(state["seconds"] / budget, 1.0)
    return peak * min(1.0, (state["step"] + 1) / 50) * 0.5 * (1 + math.cos(math.pi * progress))


def resume_from(checkpoint: Path, key: str, module, optimizer, rng, echo) -> dict | None:
    """Load a checkpoint's weights (under `key`), optimizer and sampling state; its progress, or
    None when there is no checkpoint."""
    import torch

    if not checkpoint.is_file():
        return None
    saved = torch.load(checkpoint, weights_only=False)
    module.load_state_dict(saved[key])
    kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved["optimizer"])
    for group, chosen in zip(optimizer.param_groups, kernels):
        group.update(chosen)  # this run's optimizer kernel, not the one the checkpoint was made with
    rng.setstate(saved["rng"])
    state = saved["state"]
    echo(f"resumed at step {state['step']} ({state['seconds'] / 60:.1f} min trained)")
    return state


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX): there bf16 autocast
    trains ~1.5x faster; without it (e.g. AVX2-only Zen 3) it is ~5x slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _zlab_config(tc, manifest: dict, layers: int, block: int, mask_token_id: int, refine: bool = False,
                 copy: bool = False, intermediate: int | None = None) -> dict:
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": tc.hidden_size,
            "num_hidden_layers": layers, "num_attention_heads": tc.num_attention_heads,
            "num_key_value_heads": tc.num_key_value_heads, "head_dim": head_dim,
            "intermediate_size": intermediate or tc.intermediate_size, "rms_norm_eps": tc.rms_norm_eps,
            "rope_theta": getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get(
                "rope_theta", 10000.0),
            "max_position_embeddings": tc.max_position_embeddings, "vocab_size": tc.vocab_size,
            "block_size": block, "num_target_layers": tc.num_hidden_layers, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False,
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": manifest["taps"],
                              **({"refine": True} if refine else {}), **({"copy": True} if copy else {})}}


def _init(drafter, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    for name, p in drafter.named_parameters():
        if p.dim() == 2:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def held_out_tau(drafter, rows, cache: LabelCache, held_ids, embed, lm_head, cos, sin, per_sequence: int = 16):
    """Simulated greedy acceptance on held-out sequences: a draft at block position k is
    accepted while it equals the target's argmax at that position (given the data's prefix).
    tau = 1 + mean accepted.  Only an estimate: `dflash-train eval` measures through the runtime."""
    import torch

    rng = random.Random(1234)
    block = drafter.config.block_size
    accepted = []
    with torch.no_grad():
        for i in held_ids:
            tokens = torch.tensor(rows[i]["prompt"] + rows[i]["answer"])
            picked = sample_anchors(len(rows[i]["prompt"]), len(tokens), per_sequence, rng)
            features = cache.sequence(i)[0]
            logits = block_logits(drafter, features, tokens, picked, embed, lm_head, cos, sin)
            if drafter.config.refine:  # the drafts the runtime verifies are the second pass's
                logits = block_logits(drafter, features, tokens, picked, embed, lm_head, cos, sin,
                                      filled=first_pass_drafts(logits, cache.d2t))
            drafts = logits.argmax(-1)
            label_ids, _, valid = block_labels(cache, i, picked, block)
            match = (drafts == label_ids[..., 0]) & (valid > 0)
            accepted += match.int().cumprod(-1).sum(-1).tolist()
    return 1 + sum(accepted) / max(len(accepted), 1)


def save(drafter, config, d2t, out: Path, compact: bool = False) -> None:
    """The drafter as a z-lab-layout folder: config.json + model.safetensors; `compact`: its
    matrices int8, as the package ships it (export/compact.py)."""
    from safetensors.torch import save_file

    import torch

    from dflash.export.compact import compact_state

    state = drafter.state_dict()
    # bf16 like the published checkpoints: half the size, and the loader runs it in fp32
    state = compact_state(state) if compact else {k: v.detach().to(torch.bfloat16).contiguous()
                                                  for k, v in state.items()}
    if d2t is not None:
        state["d2t"] = d2t.contiguous()
    (out / "config.json").write_text(json.dumps(config.raw, indent=1))
    save_file(state, str(out / "model.safetensors"))


def plot_history(history: list[dict], path: Path) -> None:
    """Loss and held-out tau against training minutes (skipped without matplotlib)."""
    if not history:
        return
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    minutes = [h["minutes"] for h in history]
    ax.plot(minutes, [h["loss"] for h in history], color="#3b7dd8", label="loss")
    ax.set_xlabel("training minutes")
    ax.set_ylabel("loss")
    other = ax.twinx()
    other.plot(minutes, [h["tau"] for h in history], color="#d8643b", label="held-out tau")
    seen = [h for h in history if "train_tau" in h]
    if seen:
        other.plot([h["minutes"] for h in seen], [h["train_tau"] for h in seen], color="#d8643b", linestyle="--",
                   label="tau on training answers")
    other.set_ylabel("held-out tau (tokens per step)")
    fig.legend(loc="upper center", ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
