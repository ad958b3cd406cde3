"""Fit an EAGLE-3 head on the campaign's label cache, with training-time test.

Step 0 runs the head over a sequence as drafting starts: row j pairs the target's tap states
of position j with token j+1 and learns the target's distribution of token j+2. Step k
(1..STEPS-1) replays drafting k tokens past the committed text: row j reads the head's OWN
output of row j-1 from step k-1 instead of the target's states, and attends to the target
rows up to j-k and to its own chain (the rows of steps 1..k at positions j-k+1..j), exactly
what it sees at draft depth k+1. Without these steps a head is rarely accepted past its first
draft (EAGLE-3, HASS). Loss: soft cross-entropy against the target's distribution over the
draft vocabulary, step k weighted 0.8^k. The target's embedding stays frozen; the lm_head
starts from the target's rows of the draft vocabulary.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from .objective import _rms, _rotate  # the same plain-torch helpers as DFlash's objective

STEPS = 4           # training-time test: drafting depths replayed per sequence
STEP_DECAY = 0.8
MAX_ROWS = 384      # a longer sequence trains on a random window of this many rows (CPU time)

def ttt_mask(length: int, step: int):
    """Which keys row j of `step` sees, keys being `step + 1` blocks of `length` rows (block i
    = the rows of step i): step 0's rows at positions <= j-step, and step i's row at position
    j-step+i for i = 1..step."""
    import torch

    j = torch.arange(length)[:, None]
    q = torch.arange(length)[None, :]
    blocks = [q <= j - step] + [q == j - step + i for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def ttt_logits(head, features, tokens, embed, cos, sin, steps: int = STEPS):
    """Logits [steps, L-1, Vd] of every step's rows j = 0..L-2 (plain differentiable torch)."""
    import torch

    c = head.config
    length = len(tokens) - 1
    emb = _rms(embed[tokens[1:]], head.input_layernorm.weight, c.eps)  # row j's token is j+1
    positions = torch.arange(length)
    rc, rs = cos[positions][:, None], sin[positions][:, None]
    group = c.heads // c.kv_heads
    h = head.fc(features[:length])
    keys, values, logits = [], [], []
    for step in range(steps):
        if step:  # row j reads the previous step's output of row j-1
            h = torch.cat([torch.zeros_like(out[:1]), out[:-1]])
        normed = _rms(h, head.hidden_norm.weight, c.eps)
        x = torch.cat([emb, normed], dim=-1)
        q = _rotate(head.q_proj(x).view(length, c.heads, c.head_dim), rc, rs)
        keys.append(_rotate(head.k_proj(x).view(length, c.kv_heads, c.head_dim), rc, rs))
        values.append(head.v_proj(x).view(length, c.kv_heads, c.head_dim))
        k, v = torch.cat(keys), torch.cat(values)
        mask = ttt_mask(length, step)
        attended = torch.nn.functional.scaled_dot_product_attention(  # 4-D: the fused kernel (objective.py)
            q.transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(group, 0)[None],
            v.transpose(0, 1).repeat_interleave(group, 0)[None], attn_mask=mask)[0]
        residual = normed if c.norm_before_residual else h
        out = residual + head.o_proj(attended.transpose(0, 1).reshape(length, -1))
        out = out + head.mlp(_rms(out, head.post_attention_layernorm.weight, c.eps))
        logits.append(head.lm_head(_rms(out, head.norm.weight, c.eps)))
    return torch.stack(logits)


def ttt_loss(logits, label_ids, label_probs, answer_start: int):
    """Soft cross-entropy per step against the target's distribution of token j+2 (label row
    j+1), over rows inside the answer that step k can reach (j >= k), weighted 0.8^k."""
    import torch

    steps, length = logits.shape[0], logits.shape[1]
    ids, probs = label_ids[1:length + 1], label_probs[1:length + 1].float()
    inside = ids >= 0
    p = probs * inside
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    total, weight = 0.0, 0.0
    rows = torch.arange(length)
    for step in range(steps):
        logp = torch.log_softmax(logits[step].float(), dim=-1)
        per_row = -(logp.gather(-1, ids.clamp(min=0)) * p).sum(-1)
        use = ((rows >= step) & (rows + 2 >= answer_start) & inside.any(-1)).float()
        w = STEP_DECAY ** step
        total = total + w * (per_row * use).sum() / use.sum().clamp(min=1)
        weight += w
    return total / weight


def head_config(tc, taps: list[int], draft_vocab: int) -> dict:
    """A reference-layout config for a head of the target's width. Its layer ids say layer
    outputs only when they start at 0 or 1 (the convention loaders infer), so other taps are
    written as the inputs of the next layers."""
    aux = list(taps) if min(taps) <= 1 else [t + 1 for t in taps]
    heads = tc.num_attention_heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": tc.hidden_size,
            "num_attention_heads": heads, "num_key_value_heads": tc.num_key_value_heads, "head_dim": head_dim,
            "intermediate_size": tc.intermediate_size, "rms_norm_eps": tc.rms_norm_eps,
            "rope_theta": getattr(tc, "rope_theta", None) or 10000.0, "max_position_embeddings":
                tc.max_position_embeddings, "vocab_size": tc.vocab_size, "num_hidden_layers": 1,
            "hidden_act": "silu", "draft_vocab_size": draft_vocab, "target_hidden_size": tc.hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}


def new_head(tc, taps, d2t, lm_head, seed: int):
    """A head in the reference layout, small random weights, lm_head = the target's draft rows."""
    import torch

    from dflash.export.eagle3 import Eagle3Config, Eagle3Head

    raw = head_config(tc, taps, len(d2t))
    hd = raw["head_dim"]
    shapes = {"q_proj.weight": torch.zeros(raw["num_attention_heads"] * hd, 1),
              "k_proj.weight": torch.zeros(raw["num_key_value_heads"] * hd, 1)}
    head = Eagle3Head(Eagle3Config.from_dict(raw, shapes, tc.num_hidden_layers))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        head.lm_head.weight.copy_(lm_head[d2t])
        head.d2t.copy_(d2t - torch.arange(len(d2t)))  # target id = draft id + d2t[draft id]
    return head


def warm_start(head, folder, layers: int, echo) -> None:
    """Copy the weights of the head in `folder` (same taps, sizes and draft vocabulary)."""
    import torch

    from dflash.export.eagle3 import Eagle3Head

    source = Eagle3Head.load(folder, layers)
    mine, theirs = head.state_dict(), source.state_dict()
    differ = sorted(k for k in mine if k not in theirs or theirs[k].shape != mine[k].shape)
    if differ or not torch.equal(mine["d2t"], theirs["d2t"].to(mine["d2t"].dtype)):
        raise ValueError(f"--init {folder} is a head of another shape or draft vocabulary "
                         f"({', '.join(differ) or 'd2t'} differ): drop --init or give a head fitted on this cache")
    head.load_state_dict(theirs)
    echo(f"started from the weights in {folder}")


def head_vocabulary(folder, layers: int, size: int):
    """The draft vocabulary (target ids) of the head saved in `folder`, if there is one of `size` tokens."""
    import torch

    from dflash.export.eagle3 import Eagle3Head

    if folder is None or not (Path(folder) / "model.safetensors").is_file():
        return None
    d2t = Eagle3Head.load(folder, layers).d2t
    return d2t + torch.arange(len(d2t)) if len(d2t) == size else None


def save(head, out: Path) -> None:
    """The head in the reference layout: config.json + model.safetensors (midlayer.*, d2t), its
    weights in bf16 like the published heads (half the size; the exporter runs them in fp32)."""
    from safetensors.torch import save_file

    import torch

    top = ("fc.", "norm.", "lm_head.", "d2t")
    state = {}
    for name, tensor in head.state_dict().items():
        if name.startswith(("q_proj", "k_proj", "v_proj", "o_proj")):
            name = "midlayer.self_attn." + name
        elif not name.startswith(top):
            name = "midlayer." + name
        tensor = tensor.detach()
        state[name] = (tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor).contiguous()
    (out / "config.json").write_text(json.dumps(head.config.raw, indent=1))
    save_file(state, str(out / "model.safetensors"))


def train(target_source, manifest: dict, data_dirs, out, cache_dir, taps=None, draft_vocab=8192, minutes=30.0,
          lr=3e-4, seed=0, resume=False, max_steps=None, text_tokens=0, init_from=None, echo=print) -> dict:
    """Fit an EAGLE-3 head on the same rows and label cache as the DFlash fit; `init_from`: a
    head folder of the same shape to start from (a warm start, fresh optimizer)."""
    import torch

    from dflash.runtime.bundle import tap_columns

    from .data import Target
    from .fit import (LabelCache, draft_vocabulary, learning_rate, load_sequences, native_bf16, next_eval_at,
                      plot_history, resume_from, step_seconds, text_sequences)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    target = target_source.model.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tc = target.config
    taps = taps or _default_taps(manifest["taps"], tc.num_hidden_layers)
    missing = [t for t in taps if t not in manifest["taps"]]
    if missing:
        raise ValueError(f"the head's taps {taps} are not all among the bundle's {manifest['taps']}")
    rows = text_sequences(Target(target_source), text_tokens, seed) + load_sequences(data_dirs, Target(target_source))
    # the head's lm_head rows are its own: a resumed or warm-started head keeps its vocabulary
    d2t = head_vocabulary(out if resume else init_from, tc.num_hidden_layers, draft_vocab)
    d2t = draft_vocabulary(rows, draft_vocab, tc.vocab_size) if d2t is None else d2t
    cache = LabelCache(cache_dir, rows, manifest["taps"], tc.hidden_size, d2t)
    cache.build(target, echo)
    columns = torch.from_numpy(tap_columns(manifest["taps"], tc.hidden_size, taps))
    head = new_head(tc, taps, d2t, target.lm_head.weight.detach().float(), seed)
    if init_from and not resume:
        warm_start(head, init_from, tc.num_hidden_layers, echo)
    embed = target.get_input_embeddings().weight.detach().float()
    cos, sin = head.config.rotary_tables(max(len(r["prompt"]) + len(r["answer"]) for r in rows) + 1)
    held = max(1, len(rows) // 20)
    train_ids, held_ids = list(range(len(rows) - held)), list(range(len(rows) - held, len(rows)))
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    checkpoint = out / "checkpoint.pt"
    state = resume_from(checkpoint, "head", head, optimizer, rng, echo) if resume else None
    state = state or {"step": 0, "seconds": 0.0, "history": []}
    bf16, budget, eval_due = native_bf16(), minutes * 60, time.perf_counter() + 120
    while state["seconds"] < budget and (max_steps is None or state["step"] < max_steps):
        start = time.perf_counter()
        i = rng.choice(train_ids)
        features, tokens, label_ids, label_p, answer_start = _window(cache, rows, i, columns, rng)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(lr, state, budget)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = ttt_logits(head, features, tokens, embed, cos, sin)
        loss = ttt_loss(logits, label_ids, label_p, answer_start)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optimizer.step()
        state["step"] += 1
        state["seconds"] += step_seconds(start)
        if time.perf_counter() > eval_due or state["seconds"] >= budget or state["step"] == max_steps:
            eval_start = time.perf_counter()
            tau = held_out_tau(head, cache, rows, held_ids, columns, embed, cos, sin)
            state["history"].append({"step": state["step"], "minutes": state["seconds"] / 60, "loss": loss.item(),
                                     "tau": tau})
            echo(f"  step {state['step']}, {state['seconds'] / 60:.1f}/{minutes:.0f} min, loss {loss.item():.3f}, "
                 f"held-out tau {tau:.2f}")
            save(head, out)
            torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "state": state,
                        "rng": rng.getstate()}, checkpoint)
            eval_due = next_eval_at(eval_start)
    save(head, out)
    plot_history(state["history"], out / "training.png")
    return state


def _default_taps(bundle_taps: list[int], layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers, moved to the nearest taps the bundle already has."""
    wanted = [1, layers // 2 - 1, layers - 4]
    return [min(bundle_taps, key=lambda t: (abs(t - w), t)) for w in wanted]


def _window(cache, rows, i, columns, rng):
    """One sequence's (features, tokens, soft label ids, probs, answer start), cut to a random
    window of MAX_ROWS rows that keeps some answer."""
    import torch

    features, label_ids, label_p = cache.sequence(i)
    tokens = torch.tensor(rows[i]["prompt"] + rows[i]["answer"])
    start, answer = 0, len(rows[i]["prompt"])
    if len(tokens) > MAX_ROWS:
        start = rng.randrange(0, len(tokens) - MAX_ROWS + 1)
        start = min(start, max(answer - 1, 0)) if start + MAX_ROWS <= answer else start
    end = start + MAX_ROWS
    return (features[start:end, columns], tokens[start:end], label_ids[start:end], label_p[start:end],
            max(answer - start, 0))


def held_out_tau(head, cache, rows, held_ids, columns, embed, cos, sin) -> float:
    """Simulated greedy chain acceptance on held-out sequences: at every answer position, how
    many of the TTT steps' argmaxes in a row equal the target's argmax (1 + mean accepted).
    An estimate: `dflash-bench generate` measures through the runtime."""
    import torch

    accepted = []
    with torch.no_grad():
        for i in held_ids:
            features, tokens, ids, _, answer = _window(cache, rows, i, columns, random.Random(i))
            logits = ttt_logits(head, features, tokens, embed, cos, sin)
            drafts = logits.argmax(-1)  # [steps, L-1]
            want = ids[1:len(tokens), 0]
            for j in range(max(answer - 1, 0), len(tokens) - 1 - STEPS):
                run = 0
                while run < STEPS and drafts[run, j + run] == want[j + run]:
                    run += 1
                accepted.append(run)
    return 1 + sum(accepted) / max(len(accepted), 1)
