# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates the virtual environment in .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.parity-installed
# CPU machines: the CPU build of torch 2.13.0 (a bare `torch` would pull a multi-GB CUDA build).
# Triton 3.9.0's interpreter works with numpy 2.4 (3.6.0's does not: numerics.md).
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.9.0
PYTEST_ARGS ?= -n 2

.PHONY: demo test venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)" "$(TRITON_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[triton,test]"
	touch $@

# The Triton kernel on whatever device is here (the interpreter on a CPU) against the goldens
# captured on an NVIDIA H200, under the default rule (the error budget wherever the bundle has a
# reference): the attention cases, the decoder model layer by layer, the 150-case fuzz corpus.
demo: $(STAMP)
	$(PY) -m parity compare --golden golden/h200-attention --impl triton
	$(PY) -m parity compare --golden golden/h200-decoder --impl triton --isolate
	$(PY) -m parity compare --golden golden/h200-fuzz --impl triton --max-rows 20

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
