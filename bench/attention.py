"""Micro-benchmark of TreeAttention against ONNX Runtime's own attention ops.

Three implementations of one attention step (S new rows over `past` cached rows, grouped-query
heads, a mask over the new rows), each as a one-node ONNX model run with IOBinding:

  custom  ai.dflash TreeAttention; key_cache/present_key (and values) bound to one buffer
          [1, Hkv, C, D], so the new rows are written in place.
  gqa     com.microsoft.GroupQueryAttention, the same shared-buffer mode: past_key and
          present_key bound to one [1, Hkv, C, D] buffer; seqlens_k = past+S-1 (int32 [1]),
          total_sequence_length = past+S (int32 scalar), attention_bias [1, 1, S, past+S]
          with 0 where visible and -inf where masked, do_rotary=0. GQA also applies its own
          causal mask unless causal=0 (an attribute this onnxruntime has), so the bias is the
          only mask when `causal=0` is set, which is what we do.
  onnx    ONNX Attention (opset 23): 3-D Q/K/V with q_num_heads/kv_num_heads, past_key/past_value
          = the cache rows < past ([1, Hkv, past, D]), bool attn_mask [S, past+S], is_causal=0;
          present outputs are new [1, Hkv, past+S, D] tensors (a copy, by the op's definition).

Command line: ``python -m dflash.bench.attention`` prints the comparison table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

IMPLS = ("custom", "gqa", "onnx")


def make_inputs(S, past, capacity, heads, kv_heads, head_dim, mask=None, seed=0):
    """Random inputs of one step; `mask` ([S, S] bool over the new rows) defaults to causal."""
    if past + S > capacity:
        raise ValueError(f"past {past} + S {S} exceeds capacity {capacity}")
    rng = np.random.default_rng(seed)
    D = head_dim
    x = {
        "query": rng.standard_normal((1, S, heads * D), dtype=np.float32),
        "key": rng.standard_normal((1, S, kv_heads * D), dtype=np.float32),
        "value": rng.standard_normal((1, S, kv_heads * D), dtype=np.float32),
        "key_cache": rng.standard_normal((1, kv_heads, capacity, D), dtype=np.float32),
        "value_cache": rng.standard_normal((1, kv_heads, capacity, D), dtype=np.float32),
        "mask": np.tril(np.ones((S, S), dtype=bool)) if mask is None else np.asarray(mask, dtype=bool),
    }
    return x


def build_model(impl, heads, kv_heads, head_dim, scale=None):
    """One-node ONNX model of `impl` ("custom", "gqa" or "onnx")."""
    f = TensorProto.FLOAT
    H, Hkv, D = heads, kv_heads, head_dim
    scale = float(scale if scale is not None else 1.0 / np.sqrt(D))

    def vi(name, dtype, shape):
        return helper.make_tensor_value_info(name, dtype, shape)

    qkv = [vi("query", f, [1, "S", H * D]), vi("key", f, [1, "S", Hkv * D]), vi("value", f, [1, "S", Hkv * D])]
    outputs = [vi("output", f, None), vi("present_key", f, None), vi("present_value", f, None)]
    if impl == "custom":
        inputs = qkv + [
            vi("key_cache", f, [1, Hkv, "C", D]),
            vi("value_cache", f, [1, Hkv, "C", D]),
            vi("past_len", TensorProto.INT64, []),
            vi("mask", TensorProto.BOOL, ["S", "S"]),
        ]
        node = helper.make_node(
            "TreeAttention", [i.name for i in inputs], [o.name for o in outputs], domain="ai.dflash",
            num_heads=H, kv_num_heads=Hkv, scale=scale,
        )
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.dflash", 1)]
    elif impl == "gqa":
        inputs = qkv + [
            vi("past_key", f, [1, Hkv, "C", D]),
            vi("past_value", f, [1, Hkv, "C", D]),
            vi("seqlens_k", TensorProto.INT32, [1]),
            vi("total_sequence_length", TensorProto.INT32, []),
            vi("attention_bias", f, [1, 1, "S", "T"]),
        ]
        names = [i.name for i in inputs]
        # inputs 7..9 (cos_cache, sin_cache, position_ids) are absent: empty names
        node = helper.make_node(
            "GroupQueryAttention", names[:7] + ["", "", ""] + names[7:], [o.name for o in outputs],
            domain="com.microsoft", num_heads=H, kv_num_heads=Hkv, scale=scale, do_rotary=0, causal=0,
        )
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    elif impl == "onnx":
        inputs = qkv + [
            vi("attn_mask", TensorProto.BOOL, ["S", "T"]),
            vi("past_key", f, [1, Hkv, "P", D]),
            vi("past_value", f, [1, Hkv, "P", D]),
        ]
        node = helper.make_node(
            "Attention", [i.name for i in inputs], [o.name for o in outputs],
            q_num_heads=H, kv_num_heads=Hkv, scale=scale, is_causal=0,
        )
        opsets = [helper.make_opsetid("", 23)]
    else:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    graph = helper.make_graph([node], f"attention_{impl}", inputs, outputs)
    return helper.make_model(graph, opset_imports=opsets)


def make_session(impl, threads, heads, kv_heads, head_dim, scale=None):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    if impl == "custom":
        from dflash import ops

        ops.register(so)
    model = build_model(impl, heads, kv_heads, head_dim, scale)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


class Step:
    """A session plus IOBinding set up for one step; `run()` executes it, `output()` reads it.

    The cache buffers are the arrays of `inputs` (custom and gqa write the new rows into them).
    """

    def __init__(self, impl, sess, inputs, past):
        self.impl, self.sess = impl, sess
        x = inputs
        S = x["query"].shape[1]
        T = past + S
        io = sess.io_binding()
        keep = []  # OrtValues must outlive the binding

        def bind_in(name, arr):
            v = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr))
            keep.append(v)
            io.bind_ortvalue_input(name, v)
            return v

        def bind_out(name, arr):
            v = ort.OrtValue.ortvalue_from_numpy(arr)
            keep.append(v)
            io.bind_ortvalue_output(name, v)
            return v

        for n in ("query", "key", "value"):
            bind_in(n, x[n])
        self.out = np.zeros_like(x["query"])
        bind_out("output", self.out)
        if impl in ("custom", "gqa"):
            # one OrtValue over the cache array, bound as both input and output: shared buffer
            kc = ort.OrtValue.ortvalue_from_numpy(x["key_cache"])
            vc = ort.OrtValue.ortvalue_from_numpy(x["value_cache"])
            keep += [kc, vc]
            cache_in = ("key_cache", "value_cache") if impl == "custom" else ("past_key", "past_value")
            io.bind_ortvalue_input(cache_in[0], kc)
            io.bind_ortvalue_input(cache_in[1], vc)
            io.bind_ortvalue_output("present_key", kc)
            io.bind_ortvalue_output("present_value", vc)
            if impl == "custom":
                bind_in("past_len", np.array(past, dtype=np.int64))
                bind_in("mask", x["mask"])
            else:
                bind_in("seqlens_k", np.array([T - 1], dtype=np.int32))
                bind_in("total_sequence_length", np.array(T, dtype=np.int32))
                bias = np.zeros((1, 1, S, T), dtype=np.float32)
                bias[0, 0, :, past:] = np.where(x["mask"], 0.0, -np.inf)
                bind_in("attention_bias", bias)
        else:
            attn_mask = np.concatenate([np.ones((S, past), dtype=bool), x["mask"]], axis=1)
            bind_in("attn_mask", attn_mask)
            bind_in("past_key", x["key_cache"][:, :, :past])
            bind_in("past_value", x["value_cache"][:, :, :past])
            Hkv, D = x["key_cache"].shape[1], x["key_cache"].shape[3]
            self.present_k = np.zeros((1, Hkv, T, D), dtype=np.float32)
            self.present_v = np.zeros((1, Hkv, T, D), dtype=np.float32)
            bind_out("present_key", self.present_k)
            bind_out("present_value", self.present_v)
        self.io, self._keep = io, keep
        self._run_opts = ort.RunOptions()

    def run(self):
        self.sess.run_with_iobinding(self.io, self._run_opts)

    def output(self):
        return self.out.copy()


def attention_output(impl, inputs, past, threads=1, scale=None):
    """Run one step of `impl` on copies of `inputs` and return its output [1, S, H*D]."""
    x = {k: v.copy() for k, v in inputs.items()}
    H = x["query"].shape[2] // x["key_cache"].shape[3]
    Hkv, D = x["key_cache"].shape[1], x["key_cache"].shape[3]
    sess = make_session(impl, threads, H, Hkv, D, scale)
    step = Step(impl, sess, x, past)
    step.run()
    return step.output()


def bench_attention(impl, S, past, threads, heads, kv_heads, head_dim, capacity, repeats=50, warmup=5):
    """Median wall time in microseconds of one `impl` step (session run with IOBinding)."""
    sess = make_session(impl, threads, heads, kv_heads, head_dim)
    x = make_inputs(S, past, capacity, heads, kv_heads, head_dim)
    step = Step(impl, sess, x, past)
    for _ in range(warmup):
        step.run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        step.run()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1000.0


SHAPES = [(9, 3, 64), (32, 8, 128)]  # (heads, kv heads, head dim): SmolLM2, Qwen3-8B


def run_grid(repeats: int) -> list[dict]:
    """`dflash-bench attention`: every implementation at every configuration, interleaved per
    configuration; one row per implementation and configuration."""
    import click

    rows = []
    grid = [(h, t, p, s) for h in SHAPES for t in (1, 2) for p in (128, 1024, 4096) for s in (1, 16, 64)]
    with click.progressbar(grid, label="attention", file=sys.stderr) as bar:
        for (heads, kv_heads, dim), threads, past, s in bar:
            for impl in IMPLS:
                us = bench_attention(impl, s, past, threads, heads, kv_heads, dim, past + s + 64, repeats)
                rows.append({"impl": impl, "S": s, "past": past, "threads": threads,
                             "heads": [heads, kv_heads, dim], "us": us})
    return rows


def print_grid(rows: list[dict], gqa_over_custom: dict) -> None:
    import click

    click.echo(f"{'heads':>10s} {'thr':>3s} {'S':>3s} {'past':>5s} {'custom':>8s} {'gqa':>8s} {'onnx':>8s} {'gqa/custom':>10s}")
    for key, ratio in gqa_over_custom.items():
        s, past, threads, heads = key
        us = {r["impl"]: r["us"] for r in rows if (r["S"], r["past"], r["threads"], tuple(r["heads"])) == key}
        click.echo(f"{','.join(map(str, heads)):>10s} {threads:3d} {s:3d} {past:5d} {us['custom']:8.0f} "
                   f"{us['gqa']:8.0f} {us['onnx']:8.0f} {ratio:10.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--S", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--past", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--heads", nargs="+", default=["9,3,64", "32,8,128"], help="H,Hkv,D triples")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS))
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    print("| heads (H,Hkv,D) | threads | S | past | " + " | ".join(f"{i} µs" for i in args.impls) + " |")
    print("|---|---|---|---|" + "---|" * len(args.impls))
    for hs in args.heads:
        H, Hkv, D = (int(t) for t in hs.split(","))
        for threads in args.threads:
            for past in args.past:
                for S in args.S:
                    cap = past + S + 64
                    row = [bench_attention(i, S, past, threads, H, Hkv, D, cap, args.repeats) for i in args.impls]
                    print(f"| {H},{Hkv},{D} | {threads} | {S} | {past} | " + " | ".join(f"{t:.0f}" for t in row) + " |",
                          flush=True)


if __name__ == "__main__":
    main()
