"""The DFlash training objective, in plain differentiable torch.

Random anchors inside the answers; each anchor opens a block [anchor, MASK x (B-1)] at the
anchor's positions, which sees the target's tap features of every token before the anchor
and its own rows (both directions), never another block; position k of the block learns
the target's distribution at token anchor+k, weighted exp(-(k-1)/gamma).

A drafter trained to refine (`fit --refine`) also learns a second pass whose block rows hold the
first pass's drafts (the argmax at each position, as the runtime drafts them) in place of the masks:
position k then sees the drafts before it, which are right whenever a verify reaches k.

A copy-aware drafter (`fit --copy`) also reads, on each masked row, the token prompt lookup copies there
from the text up to the anchor (copy_candidates; see DFlashDrafter.block_input), as the runtime gives it.
"""

from __future__ import annotations

import random

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's position decay per block size


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


def copy_candidates(tokens, anchors, block: int):
    """[n_blocks, B] what prompt lookup copies into each block (-1 where nothing): the tokens after
    the latest earlier match of the last n-gram of the text up to the anchor, on rows 1.., as the
    runtime's DFlash drafter feeds a copy-aware drafter."""
    import torch

    from dflash.runtime.drafters import lookup_draft

    text = tokens.tolist()
    ids = torch.full((len(anchors), block), -1, dtype=torch.long)
    for n, a in enumerate(anchors):
        copied = lookup_draft(text[: a + 1], block - 1)[0]
        ids[n, 1 : 1 + len(copied)] = torch.tensor(copied, dtype=torch.long)
    return ids


def block_logits(drafter, features, tokens, anchors, embed, lm_head, cos, sin, filled=None, rows=None,
                 copy_ids=None):
    """Logits [n_blocks, B-1, V'] of every block for one sequence (plain torch, differentiable).
    `filled` [n_blocks, B-1] (target token ids): a refining pass, whose block rows 1..B-1 hold a
    first pass's drafts instead of the mask token.  `copy_ids` [n_blocks, B]: a copy-aware drafter's
    lookup copies (copy_candidates; computed here when not given).  `rows` [n_blocks, B-1] (bool): only those
    positions' logits [m, V'] (the head over the draft vocabulary is over half a step's work, and
    most positions of a block carry no label; see labelled_rows)."""
    import torch

    c = drafter.config
    b, length = c.block_size, features.shape[0]
    ctx = _rms(drafter.fc(features), drafter.hidden_norm.weight, c.eps)
    block_ids = torch.full((len(anchors), b), c.mask_token_id)
    block_ids[:, 0] = tokens[torch.tensor(anchors)]
    if filled is not None:
        block_ids[:, 1:] = filled
    if c.copy and copy_ids is None:
        copy_ids = copy_candidates(tokens, anchors, b)
    x = drafter.block_input(block_ids, copy_ids, embed).view(len(anchors) * b, -1)
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
        # With a batch dimension (4-D) torch takes its fused CPU attention kernel; 3-D inputs go
        # the unfused way, ~2x slower forward and backward at these sizes.
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(group, 0)[None],
            v.transpose(0, 1).repeat_interleave(group, 0)[None], attn_mask=mask)[0]
        x = x + a.o_proj(out.transpose(0, 1).reshape(len(block_pos), -1))
        x = x + layer.mlp(_rms(x, layer.post_attention_layernorm.weight, c.eps))
    hidden = x.view(len(anchors), b, -1)[:, 1:]
    hidden = _rms(hidden if rows is None else hidden[rows], drafter.norm.weight, c.eps)
    return hidden @ lm_head * c.output_multiplier


def first_pass_drafts(logits, d2t=None):
    """The first pass's argmax at each block position, as target token ids (no gradient)."""
    drafts = logits.detach().argmax(-1)
    return drafts if d2t is None else d2t[drafts]


def sample_anchors(answer_start: int, length: int, count: int, rng: random.Random) -> list[int]:
    """Anchors inside the answer with at least one token after them."""
    choices = list(range(max(answer_start - 1, 0), length - 1))
    return sorted(rng.sample(choices, min(count, len(choices))))


def label_rows(anchors, block: int, length: int):
    """For block position k (1..B-1) of each anchor, the row of the target's forward that
    predicts token anchor+k (row anchor+k-1), or -1 past the end: [n, B-1]."""
    import torch

    rows = torch.tensor(anchors)[:, None] + torch.arange(block - 1)[None, :]
    return torch.where(rows + 1 < length, rows, torch.tensor(-1))


def labelled_rows(valid, label_ids):
    """[n, B-1] the block positions the loss weighs: a label on the greedy path (`valid`) with some
    of its mass inside the draft vocabulary.  With --greedy-only ~60% of positions have none."""
    return (valid > 0) & (label_ids >= 0).any(-1)


def soft_loss(logits, label_ids, label_probs, valid, weights):
    """Soft cross-entropy of the drafter's logits [..., V'] against the target's top-k
    distribution (ids in the draft vocabulary, -1 outside it; probabilities renormalised over
    what the draft vocabulary holds), weighted by block position (`weights` broadcasts against
    `valid`: [B-1] for whole blocks [n, B-1], or one weight per row for selected rows [m])."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    inside = label_ids >= 0
    p = label_probs.float() * inside
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    per_row = -(logp.gather(-1, label_ids.clamp(min=0)) * p).sum(-1)  # [n, B-1]
    w = weights * valid * inside.any(-1)
    return (per_row * w).sum() / w.sum().clamp(min=1e-9)


def position_weights(block: int):
    import torch

    gamma = GAMMA.get(block, block / 2.3)
    return torch.exp(-torch.arange(block - 1) / gamma)
