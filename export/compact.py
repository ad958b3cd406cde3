"""Drafter weights stored compactly: each matrix as int8 with one fp16 scale per output row.

Half the size of bf16, for the drafters shipped inside the package (the repository carries
every version it ever shipped). Nothing is lost that matters: the export runs a drafter's
MatMuls at int4 by default, and the target checks every token it drafts. A matrix `name` is
stored as `name` (int8) beside `name_scale` (fp16), the names compressed-tensors uses.
"""

from __future__ import annotations

SCALE = "_scale"


def compact_state(state: dict) -> dict:
    """Float matrices -> int8 + per-row scale; other float tensors -> bf16; the rest unchanged."""
    import torch

    out = {}
    for name, t in state.items():
        if t.is_floating_point() and t.dim() == 2:
            w = t.detach().float()
            scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
            out[name] = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            out[name + SCALE] = scale.to(torch.float16)
        elif t.is_floating_point():
            out[name] = t.detach().to(torch.bfloat16).contiguous()
        else:
            out[name] = t.contiguous()
    return out


def expand_state(state: dict) -> dict:
    """The inverse of compact_state, in fp32 (a state without int8 matrices comes back as it was)."""
    import torch

    out = dict(state)
    for name in [n for n in state if n.endswith(SCALE)]:
        matrix = name.removesuffix(SCALE)
        if matrix in state and state[matrix].dtype == torch.int8:
            out[matrix] = state[matrix].float() * out.pop(name).float()[:, None]
    return out
