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


def _preallocated_cache(layers: int, capacity: int):
    """A transformers DynamicCache whose layers append into buffers with room for `capacity` rows:
    the stock layer concatenates its whole cache every step (a third of a batched step here)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class Layer(DynamicLayer):
        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            b, h, _, d = key_states.shape
            self.buffers = (key_states.new_empty(b, h, capacity, d), value_states.new_empty(b, h, capacity, d))
            self.length = 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            self.buffers[0][:, :, self.length:end] = key_states
            self.buffers[1][:, :, self.length:end] = value_states
            self.length = end
            self.keys, self.values = (b[:, :, :end] for b in self.buffers)
            return self.keys, self.values

        def batch_select_indices(self, indices):
            if self.is_initialized:
                self.buffers = tuple(b[indices] for b in self.buffers)
                self.keys, self.values = (b[:, :, :self.length] for b in self.buffers)

    cache = DynamicCache()
    cache.layers = [Layer() for _ in range(layers)]
    return cache


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

    generator = torch.Generator().manual_seed(seed)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding: every row's last prompt token is at column -1
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    results = [Sampled([], [], False) for _ in prompts]
    cache = _preallocated_cache(model.config.num_hidden_layers, width + max_new_tokens)
    live = list(range(len(prompts)))  # result row of each batch row; None once it has finished
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       use_cache=True).logits[:, -1].float()
        next_pos = positions[:, -1] + 1
        for _ in range(max_new_tokens):
            token = _pick(logits, temperature, top_p, generator)
            greedy = logits.argmax(-1)
            for b, r in enumerate(live):
                if r is None:
                    continue
                t = int(token[b])
                results[r].tokens.append(t)
                results[r].greedy.append(int(greedy[b]))
                if t in end_ids:
                    results[r].ended = True
                    live[b] = None
                elif looping(results[r].tokens):
                    live[b] = None
            keep = [b for b, r in enumerate(live) if r is not None]
            if not keep:
                break
            if len(live) - len(keep) >= max(1, len(live) // 8):  # drop finished rows now and then, not every step
                index = torch.tensor(keep)
                cache.batch_select_indices(index)
                token, mask, next_pos = token[index], mask[index], next_pos[index]
                live = [live[b] for b in keep]
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=torch.long)], dim=1)
            logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                           past_key_values=cache, use_cache=True).logits[:, -1].float()
            next_pos = next_pos + 1
    return results
