"""Micro-benchmark of MatMulQ4 against ONNX Runtime's MatMulNBits (4-bit, block 32, symmetric,
accuracy level 4: the settings of `dflash-export --dtype int4` before MatMulQ4 and of
onnxruntime-genai's int4 CPU models), each as a one-node model on the same random weights; and
MatMulQ4 with asymmetric blocks (`q4a`: float16 scale and offset, as a GGUF Q4_1 file is kept)
against its symmetric form (`q4`), every forced kernel path alike."""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from dflash.ops.models import q4_model

IMPLS = ("q4", "q4a", "nbits")  # "q4" runs the CPU's own kernel path; "q4 avx2" etc. a forced one


def build_model(impl: str, weight: np.ndarray) -> bytes:
    K, N = weight.shape
    if impl == "q4":
        from dflash.ops.reference import pack_q4

        return q4_model(K, N, *pack_q4(weight), a_shape=["M", K]).SerializeToString()
    if impl == "q4a":
        from dflash.ops.reference import pack_asymmetric

        packed, scales, offsets = pack_asymmetric(weight, 4)
        return q4_model(K, N, packed, scales.astype(np.float16), a_shape=["M", K],
                        offsets=offsets.astype(np.float16)).SerializeToString()
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["M", K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])

    graph = helper.make_graph([helper.make_node("MatMul", ["a", "w"], ["y"])], "mm", [a], [y],
                              [numpy_helper.from_array(weight, "w")])
    quantizer = MatMulNBitsQuantizer(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                     bits=4, block_size=32, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    return quantizer.model.model.SerializeToString()


def make_session(impl: str, weight: np.ndarray, threads: int) -> ort.InferenceSession:
    from dflash.ops import kernel_path

    impl, _, path = impl.partition(" ")
    with kernel_path(path or "native"):  # the op library reads it when the session creates the kernel
        return _session(impl, weight, threads)


def _session(impl: str, weight: np.ndarray, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    if impl in ("q4", "q4a"):
        from dflash import ops

        ops.register(opts)
    return ort.InferenceSession(build_model(impl, weight), opts, providers=["CPUExecutionProvider"])


def bench_pair(K: int, N: int, rows: list[int], threads: int, repeats: int = 7, calls: int = 50,
               impls=IMPLS) -> list[dict]:
    """µs per call of each implementation for each row count, interleaved, median of `repeats`."""
    weight = np.random.default_rng(0).standard_normal((K, N), dtype=np.float32) * 0.05
    sessions = {impl: make_session(impl, weight, threads) for impl in impls}
    out = []
    for m in rows:
        a = np.random.default_rng(m).standard_normal((m, K), dtype=np.float32)
        times = {impl: [] for impl in sessions}
        for _ in range(repeats):
            for impl, sess in sessions.items():
                sess.run(None, {"a": a})
                start = time.perf_counter()
                for _ in range(calls):
                    sess.run(None, {"a": a})
                times[impl].append((time.perf_counter() - start) / calls * 1e6)
        out += [{"impl": impl, "K": K, "N": N, "M": m, "threads": threads, "us": statistics.median(t)}
                for impl, t in times.items()]
    return out


SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # SmolLM2: qkv, o, gate|up, down, lm_head


def run_grid(threads: int, forced_paths=()) -> list[dict]:
    """`dflash-bench matmul`: both implementations at the default model's shapes, 1 to 64 rows,
    and MatMulQ4 on each forced kernel path (e.g. "avx2")."""
    import click

    impls = IMPLS + tuple(f"{q} {p}" for p in forced_paths for q in ("q4", "q4a"))
    rows = []
    with click.progressbar(SHAPES, label="matmul", file=sys.stderr) as bar:
        for K, N in bar:
            rows += bench_pair(K, N, [1, 2, 4, 8, 16, 64], threads, impls=impls)
    return rows


def print_grid(rows: list[dict], nbits_over_q4: dict) -> None:
    import click

    forced = [i for i in dict.fromkeys(r["impl"] for r in rows) if i not in IMPLS]
    click.echo(f"{'K':>5s} {'N':>6s} {'M':>3s} {'q4 us':>9s} {'q4a us':>9s} {'q4a/q4':>7s} {'nbits us':>9s} "
               f"{'nbits/q4':>9s}" + "".join(f" {i + ' us':>14s}" for i in forced))
    for (K, N, m), ratio in nbits_over_q4.items():
        us = {r["impl"]: r["us"] for r in rows if (r["K"], r["N"], r["M"]) == (K, N, m)}
        click.echo(f"{K:5d} {N:6d} {m:3d} {us['q4']:9.1f} {us['q4a']:9.1f} {us['q4a'] / us['q4']:7.2f} "
                   f"{us['nbits']:9.1f} {ratio:9.2f}" + "".join(f" {us[i]:14.1f}" for i in forced))
