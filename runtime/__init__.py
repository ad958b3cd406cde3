"""dflash runtime: generation on ONNX Runtime with onnxruntime, numpy and tokenizers only."""

from .bundle import Bundle, BundleError, load_bundle
from .model import Generation, Model, Result, Stats
from .sampling import SamplingParams

__all__ = ["Bundle", "BundleError", "Generation", "Model", "Result", "SamplingParams", "Stats",
           "load_bundle"]
