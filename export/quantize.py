"""Weight-only quantization of a graph's constant-weight MatMuls.

Two kernels:
- `q4` (int4 targets with the op library): our MatMulQ4 (ops/matmul_q4.cc), whose rows round the
  same whatever the row count, so one-token steps and multi-row verifies agree bit for bit;
- `nbits`: ONNX Runtime's own MatMulNBits (int8, drafters, and bundles without the op library).
  Its one-row kernel rounds differently from its multi-row one; the runtime pads target calls to
  two rows to stay exact (runtime/target.py).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .sources import SourceError

DTYPES = ("fp32", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
Q4_DOMAIN = "ai.dflash"


def kernel_for(dtype: str, attention: str, requested: str | None = None) -> str | None:
    """The MatMul kernel of a `dtype` target: MatMulQ4 for int4 when the bundle loads the op
    library (`--attention custom`), else MatMulNBits; None for fp32. `requested` overrides
    where it can run."""
    if requested == "q4" and (dtype != "int4" or attention != "custom"):
        raise SourceError(f"--matmul q4 needs --dtype int4 and --attention custom (got {dtype}, {attention})")
    if dtype == "fp32":
        if requested:
            raise SourceError(f"--matmul {requested} applies to quantized targets (--dtype int4 or int8)")
        return None
    if requested:
        return requested
    return "q4" if dtype == "int4" and attention == "custom" else "nbits"


def quantize(src: Path, dst: Path, dtype: str, kernel: str = "nbits", block_size: int = 32) -> None:
    """Rewrite every constant-weight MatMul of `src` for `dtype` with `kernel` and save to `dst`."""
    if kernel == "q4":
        if dtype != "int4":
            raise ValueError(f"the q4 kernel is 4-bit only, not {dtype}")
        quantize_q4(src, dst)
        return
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # accuracy_level 4 lets ORT run the products with int8 activations (its fastest CPU path);
    # symmetric blocks of 32 keep the error small on small models.
    quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), bits=BITS[dtype], block_size=block_size,
                                     is_symmetric=True, accuracy_level=4)
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=True)


def quantize_q4(src: Path, dst: Path) -> None:
    """Replace each MatMul whose weight is a constant [K, N] with K a multiple of 32 by
    ai.dflash MatMulQ4."""
    import onnx
    from onnx import helper, numpy_helper

    from dflash.ops.reference import Q4_BLOCK, pack_q4

    model = onnx.load(str(src))
    graph = model.graph
    weights = {init.name: init for init in graph.initializer}
    uses = Counter(name for node in graph.node for name in node.input)
    nodes = []
    for node in graph.node:
        w = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or len(w.dims) != 2 or w.dims[0] % Q4_BLOCK or w.data_type != onnx.TensorProto.FLOAT:
            nodes.append(node)
            continue
        K, N = (int(d) for d in w.dims)
        packed, scales = pack_q4(numpy_helper.to_array(w))
        base = node.input[1]
        graph.initializer.extend([numpy_helper.from_array(packed, f"{base}_q4"),
                                  numpy_helper.from_array(scales, f"{base}_q4_scales")])
        nodes.append(helper.make_node("MatMulQ4", [node.input[0], f"{base}_q4", f"{base}_q4_scales"],
                                      list(node.output), name=node.name + "_q4", domain=Q4_DOMAIN, K=K, N=N))
        uses[base] -= 1
    del graph.node[:]
    graph.node.extend(nodes)
    unused = [init for init in graph.initializer if uses.get(init.name, 1) == 0]
    for init in unused:
        graph.initializer.remove(init)
    if not any(o.domain == Q4_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(Q4_DOMAIN, 1))
    onnx.save(model, str(dst), save_as_external_data=True, location=Path(dst).name + ".data")
