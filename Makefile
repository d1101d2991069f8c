# w4pack: two commands on a fresh machine.
#   make test   create .venv, install w4pack + test extras, build the native module(s), run the suite
#   make demo   same setup, then convert/pack/inspect/validate a small model end to end
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.w4pack-installed
NVCC   ?= $(shell command -v nvcc 2>/dev/null)
PYTEST_ARGS ?=

.PHONY: test demo native cuda clean bench-cpu bench-gpu

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

# The CUDA library is built when nvcc exists (CI has nvcc but no GPU: it must still compile and load).
cuda: $(STAMP)
	@if [ -n "$(NVCC)" ] && [ -f native/cuda/build.sh ]; then NVCC="$(NVCC)" bash native/cuda/build.sh; \
	else echo "nvcc not found or no CUDA sources: skipping the CUDA library"; fi

test: native cuda
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: native cuda
	$(PY) tools/demo.py

bench-cpu: native
	$(PY) tools/bench_cpu.py

bench-gpu: native cuda
	$(PY) tools/bench_gpu.py

clean:
	rm -rf build w4pack/_w4p_cpu*.so w4pack/_lib *.egg-info .pytest_cache
