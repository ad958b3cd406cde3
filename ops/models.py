"""One-node models of the project's ops, for tests, the fuzz and the benchmarks."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def q4_model(K: int, N: int, packed: np.ndarray, scales: np.ndarray, a_shape=None, offsets=None, split=False):
    """One-node MatMulQ4 model: input "a" (shape `a_shape`; None leaves it untyped, so that bad
    shapes reach the op), weights (and, asymmetric, offsets) as initializers, output "y";
    `split`: the split_activations attribute."""
    return quantized_matmul_model("MatMulQ4", K, N, packed, scales, a_shape, offsets, split)


def q8_model(K: int, N: int, packed: np.ndarray, scales: np.ndarray, a_shape=None, offsets=None, split=False):
    """One-node MatMulQ8 model, as q4_model."""
    return quantized_matmul_model("MatMulQ8", K, N, packed, scales, a_shape, offsets, split)


def quantized_matmul_model(op: str, K: int, N: int, packed: np.ndarray, scales: np.ndarray, a_shape=None,
                           offsets=None, split=False):
    inputs = ["a", "weight", "scales"] + ([] if offsets is None else ["offsets"])
    node = helper.make_node(op, inputs, ["y"], domain="ai.dflash", K=K, N=N,
                            **({"split_activations": 1} if split else {}))
    a_dims = None if a_shape is None else list(a_shape)
    initializers = [numpy_helper.from_array(packed, "weight"), numpy_helper.from_array(scales, "scales")]
    if offsets is not None:
        initializers.append(numpy_helper.from_array(offsets, "offsets"))
    graph = helper.make_graph(
        [node], op.lower(), [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.dflash", 1)])


def skip_rms_norm_model(epsilon: float = 1e-5, gamma: np.ndarray | None = None):
    """One-node SkipRMSNorm model: inputs "input", "skip" and "gamma" (untyped shapes, so that bad
    ones reach the op; `gamma` given: an initializer instead), outputs "output" and "sum"."""
    node = helper.make_node("SkipRMSNorm", ["input", "skip", "gamma"], ["output", "sum"], domain="ai.dflash",
                            epsilon=float(epsilon))
    names = ["input", "skip"] + ([] if gamma is not None else ["gamma"])
    graph = helper.make_graph(
        [node], "skip_rms_norm", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("output", "sum")],
        [] if gamma is None else [numpy_helper.from_array(gamma.astype(np.float32), "gamma")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.dflash", 1)])


def swiglu_model():
    """One-node SwiGLU model: input "x" (untyped, so that bad shapes reach the op), output "y"."""
    node = helper.make_node("SwiGLU", ["x"], ["y"], domain="ai.dflash")
    graph = helper.make_graph([node], "swiglu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.dflash", 1)])
