"""A reduced draft vocabulary (EAGLE-3's trick): the drafter scores only the N most frequent
tokens, which cuts its lm_head (the largest matrix of a small drafter) by V/N.

Frequencies come from text tokenized with the target's tokenizer: the user's own files, or by
default this project's offline corpus (Python stdlib docstrings and code, and the drafter-training
request templates).
Special tokens (end of turn, end of text) are always kept so the drafter can propose a stop."""

import json
from pathlib import Path

from .sources import SourceError


def corpus_texts(files=()) -> list[str]:
    """Plain-text files (or .jsonl of prompts/messages) given by the user, else the offline corpus."""
    if not files:
        import random

        from dflash.train import prompts, texts

        rng = random.Random(0)
        requests = [prompts.template_request(rng)[1] for _ in range(800)]
        return list(texts.paragraphs("stdlib-docstrings")) + texts.stdlib_functions() + requests
    texts = []
    for f in map(Path, files):
        if not f.is_file():
            raise SourceError(f"vocabulary text {f} does not exist")
        if f.suffix == ".jsonl":
            for line in f.read_text().splitlines():
                row = json.loads(line) if line.strip() else {}
                texts += [row.get("prompt", "")] + [m.get("content", "") for m in row.get("messages", [])]
        else:
            texts.append(f.read_text())
    return texts


def frequent_tokens(tokenizer_file: Path, size: int, texts: list[str], within=None):
    """The `size` most frequent token ids of `texts` (ties: lower id first) plus the special
    tokens, ascending; restricted to the ids in `within` (a drafter's existing d2t) if given."""
    import torch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    vocab = tokenizer.get_vocab_size()
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[within[within < vocab] if within is not None else slice(None)] = True
    if not 0 < size <= int(allowed.sum()):
        raise SourceError(f"--draft-vocab {size} must lie in 1..{int(allowed.sum())} (the drafter's vocabulary)")
    counts = torch.zeros(vocab, dtype=torch.float64)
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        counts += torch.bincount(torch.tensor(encoding.ids, dtype=torch.long), minlength=vocab)[:vocab]
    specials = [i for i in tokenizer.get_added_tokens_decoder() if i < vocab]
    counts[specials] = float("inf")
    counts[~allowed] = -1
    # Ties (tokens the text never shows) go to the lower id: in a BPE vocabulary that is an
    # earlier merge, a more frequent piece of the tokenizer's own training text.
    order = torch.sort(-counts, stable=True).indices[:size]
    return torch.sort(order).values
