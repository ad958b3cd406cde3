"""One-node models of the project's ops, for tests, the fuzz and the benchmarks."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def q4_model(K: int, N: int, packed: np.ndarray, scales: np.ndarray, a_shape=None):
    """One-node MatMulQ4 model: input "a" (shape `a_shape`; None leaves it untyped, so that bad
    shapes reach the op), weights as initializers, output "y"."""
    node = helper.make_node("MatMulQ4", ["a", "weight", "scales"], ["y"], domain="ai.dflash", K=K, N=N)
    a_dims = None if a_shape is None else list(a_shape)
    graph = helper.make_graph(
        [node], "matmul_q4", [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(packed, "weight"), numpy_helper.from_array(scales, "scales")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.dflash", 1)])
