"""`dflash-train`: train a DFlash drafter for an exported target, on a CPU.

    dflash-train data --target bundles/smollm2 --out train/data          # the target's own answers
    dflash-train fit  --target bundles/smollm2 --data train/data --out train/drafter
    dflash-export drafter train/drafter --target bundles/smollm2
    dflash-train eval --bundle bundles/smollm2 --prompts prompts.jsonl   # acceptance through ORT

The objective (DFlash): random anchors inside the answers; each anchor opens a block
[anchor, MASK x (B-1)] at the anchor's positions, which sees the target's tap features
of every token before the anchor and its own rows (both directions), never another
block; position k of the block is trained to predict the token k after the anchor, with
weight exp(-(k-1)/gamma).  The target (embedding, lm_head, taps) stays frozen.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import click

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's position decay per block size


# ---- data -------------------------------------------------------------------

def load_sequences(data: Path) -> list[dict]:
    path = Path(data) / "sequences.jsonl"
    if not path.is_file():
        raise click.ClickException(f"{path} is missing: run `dflash-train data` first")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if len(r["answer"]) >= 2]


def tap_features(model, rows: list[dict], taps: list[int], cache: Path, echo=print):
    """The target's tap features (fp16) of every sequence, computed once and kept in `cache`."""
    import torch

    if cache.is_file():
        saved = torch.load(cache)
        if saved["ids"] == [r["id"] for r in rows]:
            return saved["features"]
    features, start = [], time.perf_counter()
    with torch.no_grad():
        for i, r in enumerate(rows):
            out = model(torch.tensor([r["prompt"] + r["answer"]]), output_hidden_states=True)
            features.append(torch.cat([out.hidden_states[t + 1][0] for t in taps], dim=-1).half())
            if (i + 1) % 50 == 0 or i + 1 == len(rows):
                echo(f"  tap features: {i + 1}/{len(rows)} sequences, {time.perf_counter() - start:.0f} s")
    torch.save({"ids": [r["id"] for r in rows], "features": features}, cache)
    return features


# ---- the objective ----------------------------------------------------------

def block_mask(length: int, anchors: list[int], block: int):
    """Which keys each block row sees: keys are the `length` context rows, then every
    block's rows; block j sees context rows before its anchor and its own B rows."""
    import torch

    n = len(anchors)
    anchor = torch.tensor(anchors).repeat_interleave(block)  # per query row
    mask = torch.zeros(n * block, length + n * block, dtype=torch.bool)
    mask[:, :length] = torch.arange(length)[None, :] < anchor[:, None]
    own = torch.arange(n).repeat_interleave(block)
    mask[:, length:] = own[:, None] == own[None, :]
    return mask


def _rms(x, weight, eps):
    import torch

    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, cos, sin):
    import torch

    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def block_logits(drafter, features, tokens, anchors, embed, lm_head, cos, sin):
    """Logits [n_blocks, B-1, V'] of every block for one sequence (plain torch, differentiable)."""
    import torch

    c = drafter.config
    b, length = c.block_size, features.shape[0]
    ctx = _rms(drafter.fc(features), drafter.hidden_norm.weight, c.eps)
    block_ids = torch.full((len(anchors), b), c.mask_token_id)
    block_ids[:, 0] = tokens[torch.tensor(anchors)]
    x = embed[block_ids.view(-1)] * c.embedding_scale
    block_pos = (torch.tensor(anchors)[:, None] + torch.arange(b)[None, :]).view(-1)
    positions = torch.cat([torch.arange(length), block_pos])
    mask = block_mask(length, anchors, b)
    group = c.heads // c.kv_heads
    for layer in drafter.layers:
        a = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight, c.eps)
        q = _rms(a.q_proj(h).view(-1, c.heads, c.head_dim), a.q_norm.weight, c.eps)
        k = _rms(torch.cat([a.k_proj(ctx), a.k_proj(h)]).view(-1, c.kv_heads, c.head_dim), a.k_norm.weight, c.eps)
        v = torch.cat([a.v_proj(ctx), a.v_proj(h)]).view(-1, c.kv_heads, c.head_dim)
        q = _rotate(q, cos[block_pos][:, None], sin[block_pos][:, None])
        k = _rotate(k, cos[positions][:, None], sin[positions][:, None])
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, 0),
            v.transpose(0, 1).repeat_interleave(group, 0), attn_mask=mask)
        x = x + a.o_proj(out.transpose(0, 1).reshape(len(block_pos), -1))
        x = x + layer.mlp(_rms(x, layer.post_attention_layernorm.weight, c.eps))
    hidden = _rms(x.view(len(anchors), b, -1)[:, 1:], drafter.norm.weight, c.eps)
    return hidden @ lm_head * c.output_multiplier


def sample_anchors(answer_start: int, length: int, count: int, rng: random.Random) -> list[int]:
    """Anchors inside the answer with at least one token after them."""
    choices = list(range(max(answer_start - 1, 0), length - 1))
    return sorted(rng.sample(choices, min(count, len(choices))))


def block_targets(tokens, anchors, block: int, vocab_map=None):
    """Target ids [n, B-1] (token anchor+k; -100 past the end or outside the draft vocabulary)."""
    import torch

    idx = torch.tensor(anchors)[:, None] + torch.arange(1, block)[None, :]
    valid = idx < len(tokens)
    targets = torch.where(valid, tokens[idx.clamp(max=len(tokens) - 1)], torch.tensor(-100))
    if vocab_map is not None:
        mapped = vocab_map[targets.clamp(min=0)]
        targets = torch.where(valid & (mapped >= 0), mapped, torch.tensor(-100))
    return targets


def position_weights(block: int):
    import torch

    gamma = GAMMA.get(block, block / 2.3)
    return torch.exp(-torch.arange(block - 1) / gamma)


# ---- CLI ----------------------------------------------------------------------

@click.group()
def main():
    """Train a DFlash drafter for an exported target (the target stays frozen)."""


def _bundle_source(bundle):
    from dflash.export import sources

    manifest = json.loads((Path(bundle) / "dflash.json").read_text())
    return manifest, sources.load(manifest["source"])


@main.command()
@click.option("--target", "bundle", required=True, type=click.Path(exists=True), help="target bundle")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="data folder (resumable)")
@click.option("--prompts", "n_prompts", default=800, show_default=True, help="how many built-in prompts")
@click.option("--max-new-tokens", default=192, show_default=True)
@click.option("--batch", default=16, show_default=True)
@click.option("--seed", default=0, show_default=True)
def data(bundle, out, n_prompts, max_new_tokens, batch, seed):
    """Generate the target's greedy answers to the built-in prompt set (see train_data.py)."""
    import torch

    from .train_data import build_prompts, generate

    torch.manual_seed(seed)
    _, source = _bundle_source(bundle)
    prompts = build_prompts(n_prompts, seed)
    path = generate(source, prompts, out, max_new_tokens, batch, echo=lambda m: click.echo(m, err=True))
    click.echo(f"{path}: {sum(1 for _ in path.open())} sequences", err=True)


@main.command()
@click.option("--target", "bundle", required=True, type=click.Path(exists=True), help="target bundle")
@click.option("--data", "data_dir", required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="drafter folder (z-lab layout)")
@click.option("--layers", default=1, show_default=True)
@click.option("--block", default=16, show_default=True)
@click.option("--draft-vocab", type=int, help="restrict outputs to the N most frequent answer tokens")
@click.option("--minutes", default=30.0, show_default=True, help="training time budget")
@click.option("--anchors", default=32, show_default=True, help="blocks per sequence and step")
@click.option("--lr", default=6e-4, show_default=True)
@click.option("--mask-token-id", type=int, help="default: the tokenizer's first special token")
@click.option("--seed", default=0, show_default=True)
@click.option("--resume", is_flag=True, help="continue from OUT/checkpoint.pt")
def fit(bundle, data_dir, out, layers, block, draft_vocab, minutes, anchors, lr, mask_token_id, seed, resume):
    """Fit the drafter to the data with the DFlash objective; checkpoints and a plot in OUT."""
    train(bundle, data_dir, out, layers=layers, block=block, draft_vocab=draft_vocab, minutes=minutes,
          anchors=anchors, lr=lr, mask_token_id=mask_token_id, seed=seed, resume=resume)


def train(bundle, data_dir, out, layers=1, block=16, draft_vocab=None, minutes=30.0, anchors=32, lr=6e-4,
          mask_token_id=None, seed=0, resume=False, max_steps=None, echo=None):
    import torch

    from .dflash import DFlashConfig, DFlashDrafter

    echo = echo or (lambda m: click.echo(m, err=True))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    manifest, source = _bundle_source(bundle)
    target = source.model.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    rows = load_sequences(data_dir)
    features = tap_features(target, rows, manifest["taps"], Path(data_dir) / "features.pt", echo)
    held = max(1, len(rows) // 10)  # the last 10% are held out for the acceptance estimate
    train_ids, held_ids = list(range(len(rows) - held)), list(range(len(rows) - held, len(rows)))
    tc = target.config
    if mask_token_id is None:
        mask_token_id = 0
    config = DFlashConfig.from_dict(_zlab_config(tc, manifest, layers, block, mask_token_id))
    drafter = DFlashDrafter(config)
    _init(drafter, seed)
    embed = target.get_input_embeddings().weight.detach().float()
    lm_head = target.lm_head.weight.detach().float().t().contiguous()
    vocab_map = d2t = None
    if draft_vocab:
        d2t = _draft_vocabulary(rows, draft_vocab, tc.vocab_size)
        vocab_map = torch.full((tc.vocab_size,), -1, dtype=torch.long)
        vocab_map[d2t] = torch.arange(len(d2t))
        lm_head = lm_head[:, d2t].contiguous()
    cos, sin = config.rotary_tables(max(len(r["prompt"]) + len(r["answer"]) for r in rows) + block + 1)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.01)
    state = {"step": 0, "seconds": 0.0, "history": []}
    checkpoint = out / "checkpoint.pt"
    if resume and checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=False)
        drafter.load_state_dict(saved["drafter"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]
        rng.setstate(saved["rng"])
        echo(f"resumed at step {state['step']} ({state['seconds'] / 60:.1f} min trained)")
    weights = position_weights(block)
    budget = minutes * 60
    last_eval = time.perf_counter()
    while state["seconds"] < budget and (max_steps is None or state["step"] < max_steps):
        start = time.perf_counter()
        i = rng.choice(train_ids)
        tokens = torch.tensor(rows[i]["prompt"] + rows[i]["answer"])
        picked = sample_anchors(len(rows[i]["prompt"]), len(tokens), anchors, rng)
        for group in optimizer.param_groups:  # warm-up, then cosine over the time budget
            progress = state["seconds"] / budget
            group["lr"] = lr * min(1.0, (state["step"] + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(progress, 1)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = block_logits(drafter, features[i].float(), tokens, picked, embed, lm_head, cos, sin)
        targets = block_targets(tokens, picked, block, vocab_map)
        loss_rows = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                      targets.reshape(-1), reduction="none").view(targets.shape)
        w = weights[None, :] * (targets >= 0)
        loss = (loss_rows * w).sum() / w.sum().clamp(min=1)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        state["step"] += 1
        state["seconds"] += time.perf_counter() - start
        if time.perf_counter() - last_eval > 60 or state["seconds"] >= budget or state["step"] == max_steps:
            tau = held_out_tau(drafter, rows, features, held_ids, embed, lm_head, cos, sin, vocab_map, d2t)
            state["history"].append({"step": state["step"], "minutes": state["seconds"] / 60,
                                     "loss": loss.item(), "tau": tau})
            echo(f"  step {state['step']}, {state['seconds'] / 60:.1f}/{minutes:.0f} min, loss {loss.item():.3f}, "
                 f"held-out tau {tau:.2f}")
            save(drafter, config, d2t, out)
            torch.save({"drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(), "state": state,
                        "rng": rng.getstate()}, checkpoint)
            last_eval = time.perf_counter()
    save(drafter, config, d2t, out)
    _plot(state["history"], out / "training.png")
    return state


def _zlab_config(tc, manifest: dict, layers: int, block: int, mask_token_id: int) -> dict:
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": tc.hidden_size,
            "num_hidden_layers": layers, "num_attention_heads": tc.num_attention_heads,
            "num_key_value_heads": tc.num_key_value_heads, "head_dim": head_dim,
            "intermediate_size": tc.intermediate_size, "rms_norm_eps": tc.rms_norm_eps,
            "rope_theta": getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get(
                "rope_theta", 10000.0),
            "max_position_embeddings": tc.max_position_embeddings, "vocab_size": tc.vocab_size,
            "block_size": block, "num_target_layers": tc.num_hidden_layers, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False,
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": manifest["taps"]}}


def _init(drafter, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    for name, p in drafter.named_parameters():
        if p.dim() == 2:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def _draft_vocabulary(rows, size: int, vocab: int):
    """The `size` most frequent answer tokens (EAGLE-3's reduced vocabulary), ascending ids."""
    import torch

    counts = torch.zeros(vocab, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(torch.tensor(r["answer"] + r["prompt"]), minlength=vocab)
    return torch.sort(torch.topk(counts, min(size, vocab)).indices).values


def held_out_tau(drafter, rows, features, held_ids, embed, lm_head, cos, sin, vocab_map, d2t,
                 per_sequence: int = 16) -> float:
    """Simulated greedy acceptance on held-out answers: the answers are the target's own greedy
    output, so a draft is accepted as far as it matches them.  tau = 1 + mean accepted."""
    import torch

    rng = random.Random(1234)
    block = drafter.config.block_size
    accepted = []
    with torch.no_grad():
        for i in held_ids:
            tokens = torch.tensor(rows[i]["prompt"] + rows[i]["answer"])
            picked = sample_anchors(len(rows[i]["prompt"]), len(tokens), per_sequence, rng)
            drafts = block_logits(drafter, features[i].float(), tokens, picked, embed, lm_head, cos, sin).argmax(-1)
            if d2t is not None:
                drafts = d2t[drafts]
            truth = block_targets(tokens, picked, block)
            for d, t in zip(drafts, truth):
                match = (d == t) & (t >= 0)
                accepted.append(int(match.cumprod(0).sum()))
    return 1 + sum(accepted) / max(len(accepted), 1)


def save(drafter, config, d2t, out: Path) -> None:
    """The drafter as a z-lab-layout folder: config.json + model.safetensors."""
    from safetensors.torch import save_file

    import torch

    # bf16 like the published checkpoints: half the size, and the loader runs it in fp32
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    if d2t is not None:
        state["d2t"] = d2t.contiguous()
    (out / "config.json").write_text(json.dumps(config.raw, indent=1))
    save_file(state, str(out / "model.safetensors"))


def _plot(history: list[dict], path: Path) -> None:
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
    other.set_ylabel("held-out tau (tokens per step)")
    fig.legend(loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@main.command("eval")
@click.option("--bundle", required=True, type=click.Path(exists=True))
@click.option("--prompts", required=True, type=click.Path(exists=True), help="JSONL prompt file")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--drafter", "drafter_name", default="dflash", show_default=True)
def evaluate(bundle, prompts, max_new_tokens, drafter_name):
    """Acceptance per block position and tau on a prompt file, through the ONNX runtime
    (a full block verified every step, so every position is tested)."""
    from dflash.runtime import Model
    from dflash.runtime.bench import load_prompts

    model = Model(bundle)
    block = model.bundle.manifest["dflash"]["block_size"]
    hist, by_kind = [], {}
    for row in load_prompts(prompts):
        kwargs = {"messages": row["messages"]} if "messages" in row else {"prompt": row["prompt"]}
        s = model.generate(max_new_tokens=max_new_tokens, drafter=drafter_name, draft_len=block - 1, **kwargs).stats
        hist = _add_counts(hist, s.accept_hist)
        kind = row.get("kind", "all")
        by_kind[kind] = _add_counts(by_kind.get(kind, []), s.accept_hist)
    click.echo(f"tau {_tau(hist):.2f} over {sum(hist)} steps (block {block})")
    for position in range(1, block):
        reached = sum(hist[position - 1:])
        rate = f"{sum(hist[position:]) / reached:.2f} of the time it was reached" if reached else "never reached"
        click.echo(f"  position {position}: accepted {rate}")
    click.echo("tau by prompt kind: " + ", ".join(f"{kind} {_tau(h):.2f}" for kind, h in sorted(by_kind.items())))


def _add_counts(total: list[int], counts: list[int]) -> list[int]:
    """Element-wise sum of two histograms of accepted drafts per step."""
    total = total + [0] * (len(counts) - len(total))
    return [t + (counts[k] if k < len(counts) else 0) for k, t in enumerate(total)]


def _tau(hist: list[int]) -> float:
    """Tokens committed per step: the accepted drafts plus the target's own token."""
    return 1 + sum(k * c for k, c in enumerate(hist)) / max(1, sum(hist))

if __name__ == "__main__":
    sys.exit(main())
