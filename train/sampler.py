"""Batched sampling from the target (a transformers model) with its own labels.

Every step's forward gives both the sampled token (temperature / top-p, for varied text)
and the target's argmax at that position (the label a greedy verify checks), so the labels
are exact whatever was sampled.  Rows that finish leave the batch (the KV cache is
compacted), so a long answer does not keep short ones' slots busy; a row stuck in a loop
is stopped early for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sampled:
    tokens: list[int]  # the sampled answer, ending with an end token if it ended
    greedy: list[int]  # the target's argmax at each of those positions
    ended: bool  # False: cut at max_new_tokens, or stopped in a loop


LOOP_WINDOW, LOOP_DISTINCT = 64, 8  # a row whose last 64 tokens hold <= 8 distinct ids is looping


def looping(tokens: list[int]) -> bool:
    return len(tokens) >= LOOP_WINDOW and len(set(tokens[-LOOP_WINDOW:])) <= LOOP_DISTINCT


def _pick(logits, temperature: float, top_p: float, generator):
    import torch

    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest head with mass >= top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(sorted_probs, 1, generator=generator)
    return order.gather(-1, choice).squeeze(-1)


def sample(model, prompts: list[list[int]], max_new_tokens: int, end_ids: set[int], pad_id: int,
           temperature: float = 0.7, top_p: float = 0.95, seed: int = 0) -> list[Sampled]:
    """Sample an answer to every prompt (token ids, chat template applied) in one batch."""
    import torch
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(seed)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding: every row's last prompt token is at column -1
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    results = [Sampled([], [], False) for _ in prompts]
    live = list(range(len(prompts)))  # result row of each batch row
    cache = DynamicCache()
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       use_cache=True).logits[:, -1].float()
        next_pos = positions[:, -1] + 1
        for _ in range(max_new_tokens):
            token = _pick(logits, temperature, top_p, generator)
            greedy = logits.argmax(-1)
            keep = []
            for b, r in enumerate(live):
                t = int(token[b])
                results[r].tokens.append(t)
                results[r].greedy.append(int(greedy[b]))
                if t in end_ids:
                    results[r].ended = True
                elif not looping(results[r].tokens):
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(live):
                index = torch.tensor(keep)
                cache.batch_select_indices(index)
                token, mask, next_pos = token[index], mask[index], next_pos[index]
                live = [live[b] for b in keep]
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=torch.long)], dim=1)
            logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                           past_key_values=cache, use_cache=True).logits[:, -1].float()
            next_pos = next_pos + 1
    return results
