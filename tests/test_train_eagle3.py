"""EAGLE-3 training-time test: each replayed step is exactly what the head computes while
drafting at that depth."""

import torch


def test_ttt_mask_sees_committed_rows_and_the_own_chain():
    from dflash.train.eagle3 import ttt_mask

    mask = ttt_mask(6, 2)  # keys: step 0, 1, 2 blocks of 6 rows
    for j in range(6):
        want = [q <= j - 2 for q in range(6)] + [q == j - 1 for q in range(6)] + [q == j for q in range(6)]
        assert mask[j].tolist() == want


def test_each_step_equals_drafting_at_that_depth(tmp_path):
    """Step k's row r = the reference head drafting from committed row r-k with the true tokens."""
    from tiny_models import save_eagle3_folder

    from dflash.export.eagle3 import Eagle3Head, Reference
    from dflash.train.eagle3 import ttt_logits

    head = Eagle3Head.load(save_eagle3_folder(tmp_path / "h", 64, 200, draft_vocab=50, std=0.2), 8)
    g = torch.Generator().manual_seed(0)
    embed, length = torch.randn(200, 64, generator=g), 12
    features, tokens = torch.randn(length, 192, generator=g), torch.randint(0, 200, (length,), generator=g)
    cos, sin = head.config.rotary_tables(64)
    with torch.no_grad():
        logits = ttt_logits(head, features, tokens, embed, cos, sin, steps=3)
    for j in (0, 4, 7):  # the committed row
        reference = Reference(head, embed, 64)
        step_logits, out = reference.step(features[: j + 1], torch.zeros(0, 64), tokens[1 : j + 2].tolist(),
                                          list(range(j + 1)))
        assert torch.allclose(logits[0, j], step_logits[-1], atol=1e-4)
        for k in (1, 2):
            step_logits, out = reference.step(torch.zeros(0, 192), out[-1:], [int(tokens[j + k + 1])], [j + k])
            assert torch.allclose(logits[k, j + k], step_logits[-1], atol=1e-4), (j, k)
