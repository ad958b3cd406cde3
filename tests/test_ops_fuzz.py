"""Fuzz test of the TreeAttention op: random shapes, masks, past lengths, GQA ratios, cache
formats (float32, float16, int8) and kernel paths must match the numpy reference, and a row must give the same bits as its query decoded
alone; wrong inputs must raise a clean onnxruntime error. Every
fourth case also runs MatMulQ4 or MatMulQ8 (in turn) at a random size against its bit-exact
reference, and another fourth SkipRMSNorm and SwiGLU against their float64 references.

The cases run in a child process, so a crash is a test failure with the last case named, not a
dead pytest. `make test` also runs them against the AddressSanitizer/UBSan build of the library
(ops/build-asan, `DFLASH_OPS_SANITIZE=1 bash ops/build.sh`). By hand:

    python tests/test_ops_fuzz.py [--cases 600] [--seed 0] [--case I]
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

ROOT = Path(__file__).resolve().parents[1]
ASAN_LIB = ROOT / "ops" / "build-asan" / "libdflash_ops.so"
KERNELS = ["", "portable", "avx2"]  # "" = the best the CPU has

# A wrong input -> what the error message must contain.
MUTATIONS = {
    "past+S>C": "exceeds cache capacity",
    "negative past": "is negative",
    "huge past": "exceeds cache capacity",
    "query width": "query width",
    "query rank": "query must have shape",
    "query batch": "key must have shape",  # the batch is the query's: the key's then differs
    "query dtype": "data type",  # refused by onnxruntime itself before the op runs
    "key width": "TreeAttention: ",
    "key zero width": "key width 0",
    "value shape": "value shape",
    "cache heads": "key_cache must have shape",
    "cache head_dim": "key_cache must have shape",
    "cache rank": "key_cache must have shape",
    "value_cache capacity": "value_cache shape",
    "mask shape": "mask must have shape",
    "mask rank": "mask must have shape",
    "mask dtype": "input parameter (mask)",  # refused by onnxruntime at load: one type allowed
    "past dtype": "input parameter (past_len)",
    "past shape": "past_len must be a scalar",
    "heads not a multiple": "must be a positive multiple of kv_num_heads",
    "zero kv heads": "must be a positive multiple of kv_num_heads",
    "missing attribute": "TreeAttention: ",
}


def valid_case(rng, kv: str | None = None) -> dict:
    """A random valid configuration and its inputs (caches in format `kv`, else a random one)."""
    from dflash.ops.reference import kv_store

    G = int(rng.choice([1, 1, 2, 3, 4, 8, 16]))
    Hkv = int(rng.choice([1, 2, 3, 4]))
    D = int(rng.choice([1, 3, 7, 8, 16, 17, 32, 48, 64, 80, 128, 130]))
    kind = str(rng.choice(["causal", "tree", "all-true", "random"]))
    S = int(rng.integers(0, 41)) if rng.random() < 0.1 else int(rng.integers(1, 41))
    Skv = S if kind in ("causal", "tree") else int(rng.integers(0, 41))
    past = int(rng.choice([0, int(rng.integers(0, 64)), int(rng.integers(0, 400)), int(rng.integers(200, 1500))]))
    C = past + Skv + int(rng.choice([0, int(rng.integers(0, 20))]))  # sometimes exactly full
    if kind == "causal":
        mask = np.tril(np.ones((S, S), bool))
    elif kind == "tree":
        mask = np.zeros((S, S), bool)
        for i in range(S):  # ancestor-or-self of a random tree in topological order
            mask[i, i] = True
            if i:
                mask[i] |= mask[int(rng.integers(0, i))]
    elif kind == "all-true":
        mask = np.ones((S, Skv), bool)
    else:
        mask = rng.random((S, Skv)) < rng.random()  # includes rows that see nothing
    H = G * Hkv
    B = int(rng.choice([1, 1, 1, 2, 3]))  # sequences, each with its own cache
    pasts = [past] * B if rng.random() < 0.5 else [past] + [int(rng.integers(0, C - Skv + 1)) for _ in range(B - 1)]
    c = dict(H=H, Hkv=Hkv, D=D, S=S, Skv=Skv, past=past, C=C, B=B, pasts=pasts, kind=kind,
             threads=int(rng.integers(1, 3)), past_type="int64", kv=kv or str(rng.choice(["fp32", "fp16", "int8"])),
             past_shape=[B] if len(set(pasts)) > 1 else [] if rng.random() < 0.7 else [1],
             scale=None if rng.random() < 0.3 else float(rng.uniform(0.5, 1.5) / np.sqrt(D)))
    c["feeds"] = dict(
        query=rng.standard_normal((B, S, H * D), dtype=np.float32),
        key=rng.standard_normal((B, Skv, Hkv * D), dtype=np.float32),
        value=rng.standard_normal((B, Skv, Hkv * D), dtype=np.float32),
        key_cache=kv_store(rng.standard_normal((B, Hkv, C, D), dtype=np.float32), c["kv"]),
        value_cache=kv_store(rng.standard_normal((B, Hkv, C, D), dtype=np.float32), c["kv"]),
        past_len=np.array(pasts if len(set(pasts)) > 1 else past, dtype=c["past_type"]).reshape(c["past_shape"]),
        mask=mask,
    )
    return c


def mutate(c: dict, what: str, rng) -> dict:
    """The valid case `c` with one thing wrong: returns (graph options, feeds)."""
    f = dict(c["feeds"])
    H, Hkv, D, S, Skv, C = c["H"], c["Hkv"], c["D"], c["S"], c["Skv"], c["C"]
    graph = {}
    k = int(rng.integers(1, 5))

    def past(value, dtype=None):
        return np.full(c["past_shape"], value, dtype or c["past_type"])

    if what == "past+S>C":
        f["past_len"] = past(C - Skv + k)
    elif what == "negative past":
        f["past_len"] = past(-k)
    elif what == "huge past":
        f["past_len"] = past(np.iinfo(c["past_type"]).max)
    elif what == "query width":
        f["query"] = np.zeros((c["B"], S, H * D + k), np.float32)
    elif what == "query rank":
        f["query"] = f["query"][0] if rng.random() < 0.5 else f["query"][None]
    elif what == "query batch":
        f["query"] = np.zeros((c["B"] + 1, S, H * D), np.float32)
    elif what == "query dtype":
        f["query"] = f["query"].astype(np.float64)
    elif what == "key width":  # no longer num_heads * head_dim (or not a multiple of kv_num_heads)
        f["key"] = f["value"] = np.zeros((c["B"], Skv, Hkv * D + k * Hkv + 1), np.float32)
    elif what == "key zero width":
        f["key"] = f["value"] = np.zeros((c["B"], Skv, 0), np.float32)
    elif what == "value shape":
        f["value"] = np.zeros((c["B"], Skv + k, Hkv * D), np.float32)
    elif what == "cache heads":
        f["key_cache"] = f["value_cache"] = np.zeros((c["B"], Hkv + k, C, D), np.float32)
    elif what == "cache head_dim":
        f["key_cache"] = f["value_cache"] = np.zeros((c["B"], Hkv, C, D + k), np.float32)
    elif what == "cache rank":
        f["key_cache"] = f["value_cache"] = np.zeros((Hkv, C, D), np.float32)
    elif what == "value_cache capacity":
        f["value_cache"] = np.zeros((c["B"], Hkv, C + k, D), np.float32)
    elif what == "mask shape":
        f["mask"] = np.ones((S, Skv + k) if rng.random() < 0.5 else (S + k, Skv), bool)
    elif what == "mask rank":
        f["mask"] = np.ones((S * Skv,), bool) if rng.random() < 0.5 else np.ones((1, S, Skv), bool)
    elif what == "mask dtype":
        dtype, graph["mask_type"] = [(np.float32, TensorProto.FLOAT), (np.uint8, TensorProto.UINT8),
                                     (np.int64, TensorProto.INT64)][int(rng.integers(0, 3))]
        f["mask"] = f["mask"].astype(dtype)
    elif what == "past dtype":
        f["past_len"] = past(c["past"], np.float32)
        graph["past_type"] = TensorProto.FLOAT
    elif what == "past shape":
        f["past_len"] = [np.array([c["past"]] * (c["B"] + 1), np.int64), np.zeros((0,), np.int64),
                         np.full((1, 1), c["past"], np.int64)][int(rng.integers(0, 3))]
        graph["past_type"], graph["past_shape"] = TensorProto.INT64, None
    elif what == "heads not a multiple":
        graph["attrs"] = dict(kv_num_heads=H + 1)
    elif what == "zero kv heads":
        graph["attrs"] = dict(kv_num_heads=0)
    elif what == "missing attribute":
        graph["drop"] = "kv_num_heads"
    else:
        raise ValueError(what)
    return graph, f


def model_for(c: dict, graph: dict):
    """A one-node TreeAttention model with untyped shapes (bad shapes reach the op)."""
    import dflash.ops
    from onnx import helper

    F = TensorProto.FLOAT
    cache = {"fp32": F, "fp16": TensorProto.FLOAT16, "int8": TensorProto.UINT8}[c["kv"]]
    types = [("query", F), ("key", F), ("value", F), ("key_cache", cache), ("value_cache", cache),
             ("past_len", graph.get("past_type", TensorProto.INT64)),
             ("mask", graph.get("mask_type", TensorProto.BOOL))]
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in types]
    outputs = [helper.make_tensor_value_info(n, t, None)
               for n, t in (("output", F), ("present_key", cache), ("present_value", cache))]
    attrs = dict(num_heads=c["H"], kv_num_heads=c["Hkv"])
    if c["scale"] is not None:
        attrs["scale"] = c["scale"]
    attrs.update(graph.get("attrs", {}))
    attrs.pop(graph.get("drop"), None)
    node = helper.make_node("TreeAttention", [n for n, _ in types], [o.name for o in outputs],
                            domain=dflash.ops.DOMAIN, **attrs)
    return helper.make_model(helper.make_graph([node], "fuzz", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(dflash.ops.DOMAIN, 1)])


def op_session(model, threads: int):
    """A session of a one-node model with the op library, on `threads` threads."""
    import onnxruntime as ort

    import dflash.ops

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.enable_cpu_mem_arena = False  # every tensor its own allocation: the sanitizer sees overruns
    so.log_severity_level = 4
    dflash.ops.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def session_for(c: dict, graph: dict | None = None):
    return op_session(model_for(c, graph or {}), c["threads"])


def check_valid(sess, c: dict) -> str | None:
    """Against the reference over the widened caches, the new rows as stored; the presents must
    hold the input caches with the new rows stored in the format."""
    from dflash.ops.reference import kv_load, kv_store, tree_attention

    f, kv, D, Hkv, Skv = c["feeds"], c["kv"], c["D"], c["Hkv"], c["Skv"]
    out, pk, pv = sess.run(None, f)
    scale = c["scale"] if c["scale"] is not None else 1.0 / np.sqrt(D)
    for b, past in enumerate(c["pasts"]):  # each sequence against the reference alone
        one = {k: v[b : b + 1] for k, v in f.items() if k not in ("past_len", "mask")}
        stored = {name: kv_store(one[name].reshape(Skv, Hkv, D).transpose(1, 0, 2), kv) for name in ("key", "value")}
        as_read = {name: kv_load(rows, kv, D).transpose(1, 0, 2).reshape(1, Skv, Hkv * D)
                   for name, rows in stored.items()}
        ref_out, _, _ = tree_attention(one["query"], as_read["key"], as_read["value"],
                                       kv_load(one["key_cache"], kv, D), kv_load(one["value_cache"], kv, D),
                                       np.array(past), f["mask"], scale, c["H"], c["Hkv"])
        if out[b : b + 1].shape != ref_out.shape:
            return f"sequence {b}: output shape {out[b : b + 1].shape}, reference {ref_out.shape}"
        diff = float(np.abs(out[b : b + 1] - ref_out).max(initial=0.0))
        if not diff <= 1e-5:
            return f"sequence {b}: max |output - reference| = {diff:.3g}"
        for got, name in ((pk[b], "key"), (pv[b], "value")):
            want = one[f"{name}_cache"][0].copy()
            want[:, past:past + Skv] = stored[name]
            if not np.array_equal(got, want):
                return f"sequence {b}: present_{name} differs from the cache with the new rows stored ({kv})"
    return check_rows_alone(sess, f, out) if c["B"] == 1 else None


def check_rows_alone(sess, f: dict, out) -> str | None:
    """A few rows (those that see new rows with gaps first) must be bit-identical to the same
    query decoded alone: the new rows it sees right after the cache, itself the only query."""
    mask = f["mask"]
    gapped = [i for i in range(mask.shape[0]) if not mask[i, :mask[i].sum()].all()]
    others = [i for i in range(mask.shape[0]) if i not in gapped]
    for i in (gapped + others)[:3]:
        seen = np.flatnonzero(mask[i])
        alone = dict(f, query=f["query"][:, [i]], key=f["key"][:, seen], value=f["value"][:, seen],
                     mask=np.ones((1, len(seen)), bool))
        if not np.array_equal(sess.run(["output"], alone)[0][0, 0], out[0, i]):
            return f"row {i} (sees new rows {seen.tolist()}) differs from the same query decoded alone"
    return None


def check_quantized_matmul(rng, threads: int, bits: int) -> str | None:
    """MatMulQ4 (bits 4) or MatMulQ8 (bits 8), symmetric or asymmetric (with offsets), float or
    float16 parameters, split activations or not, at random, at a
    random size (partial last tile, 0..70 rows: every row group and remainder of the
    register-blocked kernels) on a random kernel path against its numpy reference, and a random
    slice of the rows alone against the same rows of the full call."""
    from dflash.ops import models, reference

    asymmetric, half, split = bool(rng.integers(2)), bool(rng.integers(2)), bool(rng.integers(2))
    op = f"MatMulQ{bits}" + (" asymmetric" if asymmetric else "") + (" float16" if half else "") + \
        (" split" if split else "")
    one_node = getattr(models, f"q{bits}_model")

    K, N, M = 32 * int(rng.integers(1, 33)), int(rng.integers(1, 100)), int(rng.integers(0, 71))
    kernels = KERNELS[int(rng.integers(len(KERNELS)))]
    os.environ["DFLASH_OPS_KERNELS"] = kernels  # read when the session creates the kernel
    w = rng.standard_normal((K, N)).astype(np.float32)
    if asymmetric:
        packed, scales, offsets = reference.pack_asymmetric(w, bits)
    else:
        (packed, scales), offsets = getattr(reference, f"pack_q{bits}")(w), None
    if half:
        scales, offsets = scales.astype(np.float16), None if offsets is None else offsets.astype(np.float16)
    sess = op_session(one_node(K, N, packed, scales, offsets=offsets, split=split), threads)  # untyped input
    a = rng.standard_normal((M, K)).astype(np.float32)
    where = f"{op} K={K} N={N} M={M} kernels={kernels or 'best'}"
    full = sess.run(None, {"a": a})[0]
    if not np.array_equal(full, reference.quantized_matmul(a, packed, scales, N, bits, offsets, split=split)):
        return f"{where}: differs from the reference"
    start = int(rng.integers(0, M + 1))
    stop = int(rng.integers(start, M + 1))
    if not np.array_equal(sess.run(None, {"a": a[start:stop]})[0], full[start:stop]):
        return f"{where}: rows {start}:{stop} alone differ from the same rows of the full call"
    return None


def check_skip_rms_norm(rng, threads: int) -> str | None:
    """SkipRMSNorm at a random size (0..300 rows: both the inline and the thread-pool call) against
    its reference, and a random slice of the rows alone against the same rows of the full call."""
    from dflash.ops import models, reference

    M, H = int(rng.integers(0, 301)), int(rng.integers(1, 1200))
    gamma = rng.standard_normal(H).astype(np.float32)
    sess = op_session(models.skip_rms_norm_model(1e-5, gamma), threads)
    x, skip = (rng.standard_normal((M, H)).astype(np.float32) for _ in range(2))
    where = f"SkipRMSNorm M={M} H={H}"
    out, total = sess.run(None, {"input": x, "skip": skip})
    want_out, want_total = reference.skip_rms_norm(x, skip, gamma, 1e-5)
    if not (np.array_equal(total, want_total) and np.allclose(out, want_out, rtol=1e-5, atol=1e-5)):
        return f"{where}: differs from the reference"
    start = int(rng.integers(0, M + 1))
    stop = int(rng.integers(start, M + 1))
    alone = sess.run(None, {"input": x[start:stop], "skip": skip[start:stop]})
    if not (np.array_equal(alone[0], out[start:stop]) and np.array_equal(alone[1], total[start:stop])):
        return f"{where}: rows {start}:{stop} alone differ from the same rows of the full call"
    return None


def check_swiglu(rng, threads: int) -> str | None:
    """SwiGLU at a random size on a random kernel path against its reference, and a random slice
    of the rows alone against the same rows of the full call."""
    from dflash.ops import models, reference

    M, I = int(rng.integers(0, 120)), int(rng.integers(1, 2000))
    kernels = KERNELS[int(rng.integers(len(KERNELS)))]
    os.environ["DFLASH_OPS_KERNELS"] = kernels  # read when the session creates the kernel
    sess = op_session(models.swiglu_model(), threads)
    x = (rng.standard_normal((M, 2 * I)) * 5).astype(np.float32)
    where = f"SwiGLU M={M} I={I} kernels={kernels or 'best'}"
    y = sess.run(None, {"x": x})[0]
    if not np.allclose(y, reference.swiglu(x), rtol=1e-5, atol=1e-5):
        return f"{where}: differs from the reference"
    start = int(rng.integers(0, M + 1))
    stop = int(rng.integers(start, M + 1))
    if not np.array_equal(sess.run(None, {"x": x[start:stop]})[0], y[start:stop]):
        return f"{where}: rows {start}:{stop} alone differ from the same rows of the full call"
    return None


def run_case(i: int, seed: int) -> str | None:
    """Case i: two in three are valid cases, every third a wrong input; returns a failure or None."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    errors = (ort_state.Fail, ort_state.InvalidArgument, ort_state.RuntimeException, ort_state.InvalidGraph)
    rng = np.random.default_rng([seed, i])
    os.environ["DFLASH_OPS_KERNELS"] = KERNELS[i % len(KERNELS)]
    c = valid_case(rng, kv=None if i % 3 != 2 else "fp32")  # wrong inputs: float32 caches
    if i % 3 != 2:
        problem = check_valid(session_for(c), c)
        if problem is None and i % 4 == 1:
            problem = check_quantized_matmul(rng, c["threads"], bits=4 if i % 8 == 1 else 8)
        if problem is None and i % 4 == 3:
            problem = check_skip_rms_norm(rng, c["threads"]) or check_swiglu(rng, c["threads"])
        return problem
    what = list(MUTATIONS)[i // 3 % len(MUTATIONS)]  # each in turn
    graph, feeds = mutate(c, what, rng)
    print(f"           wrong input: {what}", flush=True)
    try:
        sess = session_for(c, graph)
        sess.run(None, feeds)
    except errors as e:
        if MUTATIONS[what] not in str(e):
            return f"{what}: error without {MUTATIONS[what]!r}: {e}"
    else:
        return f"{what}: no error"
    if not graph:  # the session that refused the input still computes the right answer
        return check_valid(sess, c)
    return None


def describe(i: int, seed: int) -> str:
    c = valid_case(np.random.default_rng([seed, i]), kv=None if i % 3 != 2 else "fp32")
    keys = ("H", "Hkv", "D", "S", "Skv", "past", "C", "kind", "threads", "kv", "past_shape", "scale")
    return f"case {i} (seed {seed}, kernels {KERNELS[i % len(KERNELS)] or 'best'}): " + \
        ", ".join(f"{k}={c[k]}" for k in keys)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", type=int, help="run only this case")
    args = p.parse_args(argv)
    cases = [args.case] if args.case is not None else range(args.cases)
    failures = []
    for i in cases:
        print(describe(i, args.seed), flush=True)  # the last line names the case if we crash
        try:
            problem = run_case(i, args.seed)
        except Exception as e:  # noqa: BLE001 - an unexpected exception is a failure of this case
            problem = f"{type(e).__name__}: {e}"
        if problem:
            failures.append(f"{describe(i, args.seed)}\n    {problem}")
    for f in failures:
        print("FAILED " + f)
    print(f"fuzz: {len(cases) - len(failures)}/{len(cases)} cases passed")
    return 1 if failures else 0


# ------------------------------------------------------------------------------------------------
# pytest: the cases in a child process


def run_child(env: dict, timeout=240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(Path(__file__)), "--cases", "600"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)
    tail = "\n".join(proc.stdout.splitlines()[-15:])
    assert proc.returncode == 0, f"fuzz child exited with {proc.returncode}:\n{tail}\n{proc.stderr[:3000]}"
    assert "600/600 cases passed" in proc.stdout
    return proc


def test_fuzz_release_library():
    import dflash.ops

    try:
        lib = dflash.ops.library_path()
    except dflash.ops.OpsLibraryError as e:
        pytest.skip(f"op library not built ({e})")
    run_child({"DFLASH_OPS_LIB": lib})


def sanitizer_preload(lib: Path) -> str:
    """libasan first, and libstdc++ (python does not link it: without it ASan cannot intercept
    C++ throws in a library loaded later)."""
    out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, check=True).stdout
    paths = {line.split()[0].split(".so")[0]: line.split("=>")[1].split()[0]
             for line in out.splitlines() if "=>" in line and "/" in line}
    assert "libasan" in paths, f"{lib} is not linked with AddressSanitizer: {out}"
    return " ".join(paths[name] for name in ("libasan", "libstdc++") if name in paths)


def test_fuzz_under_sanitizers():
    """The same cases against the ASan+UBSan build; any sanitizer report fails. `make test` builds
    it; DFLASH_OPS_ASAN_LIB (set by `make test`) makes it required rather than skipped."""
    required = os.environ.get("DFLASH_OPS_ASAN_LIB")
    lib = Path(required or ASAN_LIB)
    if not lib.is_file():
        if required:
            pytest.fail(f"DFLASH_OPS_ASAN_LIB={required} does not exist: run DFLASH_OPS_SANITIZE=1 bash ops/build.sh")
        pytest.skip(f"no sanitizer build at {lib} (DFLASH_OPS_SANITIZE=1 bash ops/build.sh)")
    proc = run_child({"DFLASH_OPS_LIB": str(lib), "LD_PRELOAD": sanitizer_preload(lib),
                      "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0",
                      "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"})
    assert "Sanitizer" not in proc.stderr and "runtime error:" not in proc.stderr, proc.stderr[:3000]


if __name__ == "__main__":
    sys.exit(main())
