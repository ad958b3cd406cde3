"""Weight-only quantization with ONNX Runtime's own quantizer (MatMulNBits)."""

from __future__ import annotations

from pathlib import Path

DTYPES = ("fp32", "int8", "int4")
BITS = {"int8": 8, "int4": 4}


def quantize(src: Path, dst: Path, dtype: str, block_size: int = 32) -> None:
    """Rewrite every constant-weight MatMul of `src` as MatMulNBits and save to `dst`.

    accuracy_level 4 lets ORT run the products with int8 activations (its fastest CPU
    path); symmetric blocks of 32 keep the error small on small models.
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), bits=BITS[dtype], block_size=block_size,
                                     is_symmetric=True, accuracy_level=4)
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=True)
