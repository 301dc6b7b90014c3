# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite, what CI
# runs); `make test-fast` runs the tests not marked slow, for while you work.
# Each creates the virtual environment in .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.parity-installed
# CPU machines: the CPU build of torch 2.13.0 (a bare `torch` would pull a multi-GB CUDA build).
# On the public index (PyPI) torch 2.13.0 is that CUDA build, which requires triton==3.7.1 and so
# cannot be installed with TRITON_SPEC. Set TORCH_INDEX to PyTorch's CPU index and torch (with its
# own dependencies) is installed from there alone, before anything else; its CPU wheel requires no
# Triton, so TRITON_SPEC then comes from the usual index:
#     make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Unset (the default), everything comes from the configured pip index in one command, which works
# where that index or a find-links folder holds the CPU wheel (as on the project's CPU machines).
# An existing .venv is kept: `make clean` first to reinstall.
TORCH_INDEX ?=
TORCH_SPEC ?= torch==2.13.0
# Triton 3.9.0's interpreter works with numpy 2.4 (3.6.0's does not: parity/NUMERICS.md). 3.9.0 has no
# wheel for Python 3.10, whose newest numpy is 2.2 and newest Triton 3.8.0: the markers pick one.
TRITON_SPEC ?= triton==3.9.0; python_version >= "3.11"
TRITON_SPEC_PY310 ?= triton==3.8.0; python_version < "3.11"
PYTEST_ARGS ?= -n 2
PIP_INSTALL := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test test-fast venv clean browser

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
ifeq ($(strip $(TORCH_INDEX)),)
	$(PIP_INSTALL) '$(TORCH_SPEC)' '$(TRITON_SPEC)' '$(TRITON_SPEC_PY310)'
else
	$(PIP_INSTALL) --index-url '$(strip $(TORCH_INDEX))' '$(TORCH_SPEC)'
	$(PIP_INSTALL) '$(TRITON_SPEC)' '$(TRITON_SPEC_PY310)'
endif
	$(PIP_INSTALL) -e ".[triton,test]"
	touch $@

# The Triton kernel on whatever device is here (the interpreter on a CPU) against the goldens
# captured on an NVIDIA H200, under the default rule (the error budget wherever the bundle has a
# reference): the attention cases, the decoder model layer by layer, the 150-case fuzz corpus.
demo: $(STAMP)
	$(PY) -m parity compare --bundle golden/h200-attention --impl triton
	$(PY) -m parity compare --bundle golden/h200-decoder --impl triton --isolate
	$(PY) -m parity compare --bundle golden/h200-fuzz --impl triton --max-rows 20

# The browser layout tests render the HTML reports in headless Chromium: found on PATH, else
# Debian's installed where this runs as root, else one line saying those tests will be skipped.
test: $(STAMP) browser
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP) browser
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow"

browser:
	@sh tests/ensure_chromium.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
