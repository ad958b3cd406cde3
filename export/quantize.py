"""Weight-only quantization of a graph's constant-weight MatMuls.

Three kernels:
- `q4` / `q8` (int4 / int8 targets with the op library): our MatMulQ4 and MatMulQ8
  (ops/matmul_q4.cc, ops/matmul_q8.cc), whose rows round the same whatever the row count, so
  one-token steps and multi-row verifies agree bit for bit;
- `nbits`: ONNX Runtime's own MatMulNBits (drafters, and bundles without the op library).
  Its one-row kernel rounds differently from its multi-row one; the runtime pads target calls to
  two rows to stay exact (runtime/target.py).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .sources import SourceError

DTYPES = ("fp32", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
OPS_DOMAIN = "ai.dflash"
# The project's own kernels: dtype -> (kernel, op type).
OWN_KERNELS = {"int4": ("q4", "MatMulQ4"), "int8": ("q8", "MatMulQ8")}


def kernel_for(dtype: str, attention: str, requested: str | None = None) -> str | None:
    """The MatMul kernel of a `dtype` target: MatMulQ4 for int4 and MatMulQ8 for int8 when the
    bundle loads the op library (`--attention custom`), else MatMulNBits; None for fp32.
    `requested` overrides where it can run."""
    for own_dtype, (kernel, _) in OWN_KERNELS.items():
        if requested == kernel and (dtype != own_dtype or attention != "custom"):
            raise SourceError(f"--matmul {kernel} needs --dtype {own_dtype} and --attention custom "
                              f"(got {dtype}, {attention})")
    if dtype == "fp32":
        if requested:
            raise SourceError(f"--matmul {requested} applies to quantized targets (--dtype int4 or int8)")
        return None
    if requested:
        return requested
    return OWN_KERNELS[dtype][0] if attention == "custom" else "nbits"


def quantize(src: Path, dst: Path, dtype: str, kernel: str = "nbits", block_size: int = 32) -> None:
    """Rewrite every constant-weight MatMul of `src` for `dtype` with `kernel` and save to `dst`."""
    if kernel in ("q4", "q8"):
        if OWN_KERNELS[dtype][0] != kernel:
            raise ValueError(f"the {kernel} kernel does not quantize {dtype}")
        quantize_own(src, dst, dtype)
        return
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # accuracy_level 4 lets ORT run the products with int8 activations (its fastest CPU path);
    # symmetric blocks of 32 keep the error small on small models.
    quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), bits=BITS[dtype], block_size=block_size,
                                     is_symmetric=True, accuracy_level=4)
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=True)


def quantize_own(src: Path, dst: Path, dtype: str) -> None:
    """Replace each MatMul whose weight is a constant [K, N] with K a multiple of 32 by
    ai.dflash MatMulQ4 (int4) or MatMulQ8 (int8)."""
    import onnx
    from onnx import helper, numpy_helper

    from dflash.ops.reference import Q4_BLOCK, pack_q4, pack_q8

    kernel, op_type = OWN_KERNELS[dtype]
    pack = {"q4": pack_q4, "q8": pack_q8}[kernel]

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
        packed, scales = pack(numpy_helper.to_array(w))
        base = node.input[1]
        graph.initializer.extend([numpy_helper.from_array(packed, f"{base}_{kernel}"),
                                  numpy_helper.from_array(scales, f"{base}_{kernel}_scales")])
        nodes.append(helper.make_node(op_type, [node.input[0], f"{base}_{kernel}", f"{base}_{kernel}_scales"],
                                      list(node.output), name=f"{node.name}_{kernel}", domain=OPS_DOMAIN, K=K, N=N))
        uses[base] -= 1
    del graph.node[:]
    graph.node.extend(nodes)
    unused = [init for init in graph.initializer if uses.get(init.name, 1) == 0]
    for init in unused:
        graph.initializer.remove(init)
    if not any(o.domain == OPS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(OPS_DOMAIN, 1))
    onnx.save(model, str(dst), save_as_external_data=True, location=Path(dst).name + ".data")
