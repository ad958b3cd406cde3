"""The smallest program that embeds the runtime (onnxruntime, numpy, tokenizers only).

    python samples/edge_app.py bundles/smollm2 "What is 2 + 2?"
"""

import sys

from dflash.runtime import Model

bundle, question = sys.argv[1], " ".join(sys.argv[2:]) or "Say hello in French."
model = Model(bundle)
for piece in model.stream(messages=[{"role": "user", "content": question}], max_new_tokens=64):
    print(piece, end="", flush=True)
print()
