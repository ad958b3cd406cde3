"""After export: run the graph in ONNX Runtime and in torch on the same random inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def check_target(model, taps: list[int], bundle: Path, s: int = 5, past: int = 7) -> dict:
    """Max |ORT - torch| of logits and taps for S new rows after `past` random cached rows."""
    from dflash.runtime.bundle import load_bundle
    from dflash.runtime.session import make_session

    from .target import TargetGraph, example_inputs

    info = load_bundle(bundle)
    session = make_session(info.graph_path("target"), info, threads=None)
    inputs = example_inputs(model.config, info.max_len, s=s, past=past, seed=1)
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
    logits, tapped = session.run(["logits", "taps"], feeds)
    with torch.no_grad():
        ref_logits, ref_taps = TargetGraph(model, taps, info.max_len)(*inputs)[:2]
    return {"logits": float(np.abs(logits - ref_logits.numpy()).max()),
            "taps": float(np.abs(tapped - ref_taps.numpy()).max())}
