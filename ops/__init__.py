"""dflash.ops: the custom op library for ONNX Runtime (TreeAttention, PackedTreeAttention,
MatMulQ4), and its loader.

The ops live in ``libdflash_ops.so`` (C++, built by ``bash ops/build.sh`` or ``make ops``).
Typical use::

    import onnxruntime as ort
    import dflash.ops

    so = ort.SessionOptions()
    dflash.ops.register(so)          # raises OpsLibraryError with a fix if the library is missing
    sess = ort.InferenceSession("target.onnx", so)

Each op's semantics are documented in its source (``tree_attention.cc``, ``matmul_q4.cc``) and
mirrored by a numpy function in ``dflash.ops.reference``.
"""

from __future__ import annotations

import os
from pathlib import Path

DOMAIN = "ai.dflash"
OP = "TreeAttention"
OP_VERSION = 1
LIBRARY_NAME = "libdflash_ops.so"
ENV_VAR = "DFLASH_OPS_LIB"

_BUILD_HINT = "run `make ops` (or `bash ops/build.sh`) in the dflash-ort source tree"

# The KV cache formats TreeAttention stores rows in (kv_format.h): the name users give
# (`--kv-dtype`), the cache arrays' numpy dtype and ONNX element type. int8 rows hold D codes,
# then one float32 scale per block of KV_INT8_BLOCK values.
KV_DTYPES = {"fp32": ("float32", 1), "fp16": ("float16", 10), "int8": ("uint8", 2)}
KV_INT8_BLOCK = 32


def kv_row_width(kv_dtype: str, head_dim: int) -> int:
    """The caches' last dimension for rows of head_dim values in format kv_dtype."""
    return head_dim + 4 * -(-head_dim // KV_INT8_BLOCK) if kv_dtype == "int8" else head_dim

__all__ = ["DOMAIN", "KV_DTYPES", "OP", "OP_VERSION", "OpsLibraryError", "kv_row_width", "library_path", "register"]


class OpsLibraryError(RuntimeError):
    """The custom op library is missing or does not load into this onnxruntime."""


def _candidates() -> list[Path]:
    here = Path(__file__).resolve().parent
    # the build folder of a source tree (bash ops/build.sh), or a copy shipped beside this file
    return [here / "build" / LIBRARY_NAME, here / LIBRARY_NAME]


def library_path() -> str:
    """Path of the built op library: ``$DFLASH_OPS_LIB`` if set, else ``ops/build/libdflash_ops.so``
    (or ``libdflash_ops.so`` beside this file)."""
    env = os.environ.get(ENV_VAR)
    if env:
        p = Path(env)
        if not p.is_file():
            raise OpsLibraryError(
                f"{ENV_VAR} points at {p}, which does not exist. Build the op library "
                f"({_BUILD_HINT}) and point {ENV_VAR} at the built {LIBRARY_NAME}, or unset {ENV_VAR}."
            )
        return str(p)
    candidates = _candidates()
    for p in candidates:
        if p.is_file():
            return str(p)
    raise OpsLibraryError(
        f"the TreeAttention op library is not built (no {candidates[0]}): {_BUILD_HINT}, "
        f"or set {ENV_VAR} to a built {LIBRARY_NAME}."
    )


def register(sess_options) -> str:
    """Register the op library in an ``onnxruntime.SessionOptions``; returns the library path."""
    path = library_path()
    try:
        sess_options.register_custom_ops_library(path)
    except Exception as e:  # onnxruntime raises its own pybind exception types
        try:
            import onnxruntime

            ort_version = onnxruntime.__version__
        except Exception:  # pragma: no cover - onnxruntime is imported by the caller anyway
            ort_version = "unknown"
        raise OpsLibraryError(
            f"onnxruntime {ort_version} could not load the op library {path}: {e}. "
            f"It was probably built for another onnxruntime version or machine; rebuild it "
            f"({_BUILD_HINT})."
        ) from e
    return path


KERNELS_VAR = "DFLASH_OPS_KERNELS"  # portable | avx2: caps the quantized MatMul kernel path
PATHS = ("avx512", "avx2", "portable")


def native_kernel_path() -> str:
    """The quantized MatMul path this CPU runs by default (the op library's own choice)."""
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return "portable"
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "portable"


def resolve_kernel_path(path: str) -> str:
    """"native" -> this CPU's path; a path the CPU cannot run is an error (it cannot be forced up)."""
    native = native_kernel_path()
    if path == "native":
        return native
    if path not in PATHS:
        raise ValueError(f"unknown kernel path {path!r}; choose native, {', '.join(PATHS)}")
    if PATHS.index(path) < PATHS.index(native):
        raise ValueError(f"this CPU cannot run the {path} path (its best is {native}); choose {native} or below")
    return path


class kernel_path:
    """``with kernel_path("avx2"): ...``: sessions created inside run that quantized MatMul path
    (the op library reads it when a session creates its kernels)."""

    def __init__(self, path: str):
        self.path = resolve_kernel_path(path)

    def __enter__(self):
        self.before = os.environ.pop(KERNELS_VAR, None)
        if self.path != native_kernel_path():
            os.environ[KERNELS_VAR] = self.path
        return self

    def __exit__(self, *exc):
        os.environ.pop(KERNELS_VAR, None)
        if self.before is not None:
            os.environ[KERNELS_VAR] = self.before
