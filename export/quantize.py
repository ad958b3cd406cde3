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


class WeightPlan:
    """How each constant MatMul weight of a graph becomes a BlockWeight (export/blocks.py):

    - from a GGUF source, the file's own blocks wherever its tensors hold the weight
      (export/gguf_blocks.py: exact, so the quantized bundle multiplies by the fp32 bundle's
      weights); at int8 they are widened to MatMulQ8, still exact;
    - otherwise int4 weights get searched asymmetric blocks (weighted by `importance`, E[a^2] per
      input row measured on a calibration text, where given) and int8 weights symmetric
      round-to-nearest; the lm_head is int8 at either dtype (as llama.cpp and onnxruntime-genai's
      int8-lm_head modes keep the output layer) unless `lm_head_bits` is 4: then searched int4
      blocks, from the GGUF's values too (faster, but the lm_head costs the most quality of any
      weight);
    - `symmetric_only`: symmetric round-to-nearest everywhere (drafters: speed, not fidelity).

    `split_activations`: every op quantizes its input as two int8 rows (ops/quantized_matmul.h):
    ~15-bit activations, twice the integer work.

    Results are cached by value, so the export check sees exactly the weights the graph holds."""

    def __init__(self, dtype: str, gguf=None, importance: dict | None = None, lm_head_bits: int = 8,
                 symmetric_only: bool = False, split_activations: bool = False):
        self.bits, self.gguf, self.importance = BITS[dtype], gguf, importance or {}
        self.lm_head_bits, self.symmetric_only = max(lm_head_bits, BITS[dtype]), symmetric_only
        self.split_activations = split_activations  # the ops' split_activations attribute
        self.cache: dict[bytes, object] = {}
        self.counts: Counter = Counter()

    def __call__(self, w, lm_head: bool = False):
        from .imatrix import weight_key

        value = weight_key(w)  # hashed once: the lm_head alone is tens of millions of values
        key = value + bytes([lm_head])
        if key not in self.cache:
            weight, kind = self.quantize(w, lm_head, self.importance.get(value))
            self.counts[kind] += 1
            self.cache[key] = weight
        return self.cache[key]

    def quantize(self, w, lm_head: bool = False, importance=None):
        """(BlockWeight, what was done to it) for weight w [K, N], not cached: the streaming
        exporter quantizes a weight a slice of columns at a time (blocks run along K, so columns
        quantize independently) and counts the weight once (`counts`)."""
        from .blocks import searched, symmetric

        found = self.gguf.find(w) if self.gguf is not None and not self.symmetric_only else None
        if found is not None and lm_head and found.bits > self.lm_head_bits:
            found = None  # a narrower lm_head asked for: searched from the file's values
        if found is not None:
            weight = found.widened(self.bits, found.offsets is not None)
            kind = "kept from the GGUF" + ("" if weight.exact else " (near-exact)")
        elif self.symmetric_only:
            weight, kind = symmetric(w, self.bits), "round-to-nearest"
        elif (lm_head and self.lm_head_bits == 8) or self.bits == 8:  # float16 scales, as GGUF's Q8_0
            weight, kind = symmetric(w, 8, half=True), "round-to-nearest"
        else:
            weight = searched(w, self.bits, importance)
            kind = "searched" + (" with the importance matrix" if importance is not None else "")
        return weight, (f"{kind} ({'MatMulQ4' if weight.bits == 4 else 'MatMulQ8'}"
                        f"{', asymmetric' if weight.offsets is not None else ''})")

    def summary(self) -> str:
        return "; ".join(f"{n} {kind}" for kind, n in sorted(self.counts.items()))


def weight_plan(source_path: str, dtype: str, importance: dict | None = None, lm_head: str = "int8",
                split_activations: bool = False) -> WeightPlan:
    """The plan for a target exported from `source_path` (a GGUF file or a model folder); `lm_head`:
    int8 (default) or int4."""
    gguf = None
    if str(source_path).endswith(".gguf"):
        from .gguf_blocks import GGUFBlocks

        gguf = GGUFBlocks(source_path)
    return WeightPlan(dtype, gguf=gguf, importance=importance, lm_head_bits=BITS[lm_head],
                      split_activations=split_activations)


def quantize(src: Path, dst: Path, dtype: str, kernel: str = "nbits", block_size: int = 32,
             plan: WeightPlan | None = None) -> None:
    """Rewrite every constant-weight MatMul of `src` for `dtype` with `kernel` and save to `dst`;
    our kernels take the weights `plan` gives (default: symmetric round-to-nearest)."""
    if kernel in ("q4", "q8"):
        if OWN_KERNELS[dtype][0] != kernel:
            raise ValueError(f"the {kernel} kernel does not quantize {dtype}")
        quantize_own(src, dst, plan or WeightPlan(dtype, symmetric_only=True))
        return
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # accuracy_level 4 lets ORT run the products with int8 activations (its fastest CPU path);
    # symmetric blocks of 32 keep the error small on small models.
    quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), bits=BITS[dtype], block_size=block_size,
                                     is_symmetric=True, accuracy_level=4)
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=True)


def lm_head_weight(graph) -> str | None:
    """The weight initializer of the MatMul that makes the graph's logits (directly or through a
    bias Add), or None."""
    producer = {out: node for node in graph.node for out in node.output}
    node = producer.get("logits")
    if node is not None and node.op_type == "Add":
        node = next((producer[i] for i in node.input if i in producer and producer[i].op_type == "MatMul"), None)
    return node.input[1] if node is not None and node.op_type == "MatMul" else None


def quantize_own(src: Path, dst: Path, plan: WeightPlan) -> None:
    """Replace each MatMul whose weight is a constant [K, N] with K a multiple of 32 by
    ai.dflash MatMulQ4 or MatMulQ8, as `plan` quantizes its weight (with the offsets input for
    asymmetric blocks)."""
    import onnx
    from onnx import helper, numpy_helper

    from dflash.ops.reference import Q4_BLOCK

    model = onnx.load(str(src))
    graph = model.graph
    weights = {init.name: init for init in graph.initializer}
    uses = Counter(name for node in graph.node for name in node.input)
    head = lm_head_weight(graph)
    nodes = []
    for node in graph.node:
        w = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or len(w.dims) != 2 or w.dims[0] % Q4_BLOCK or w.data_type != onnx.TensorProto.FLOAT:
            nodes.append(node)
            continue
        K, N = (int(d) for d in w.dims)
        weight = plan(numpy_helper.to_array(w), lm_head=node.input[1] == head)
        kernel, op_type = ("q4", "MatMulQ4") if weight.bits == 4 else ("q8", "MatMulQ8")
        base = node.input[1]
        names = [f"{base}_{kernel}", f"{base}_{kernel}_scales", f"{base}_{kernel}_offsets"]
        packed = weight.packed()
        graph.initializer.extend(numpy_helper.from_array(a, n) for a, n in zip(packed, names))
        nodes.append(helper.make_node(op_type, [node.input[0], *names[:len(packed)]], list(node.output),
                                      name=f"{node.name}_{kernel}", domain=OPS_DOMAIN, K=K, N=N,
                                      **({"split_activations": 1} if plan.split_activations else {})))
        uses[base] -= 1
    del graph.node[:]
    graph.node.extend(nodes)
    unused = [init for init in graph.initializer if uses.get(init.name, 1) == 0]
    for init in unused:
        graph.initializer.remove(init)
    if not any(o.domain == OPS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(OPS_DOMAIN, 1))
    onnx.save(model, str(dst), save_as_external_data=True, location=Path(dst).name + ".data")
