"""Test-suite setup: the Triton interpreter on machines without a GPU, the gpu marker, and which
tests are slow.

The test files follow the rooms of the code: ``test_base_*``, ``test_bundle_*``, ``test_run_*``,
``test_judge_*``, ``test_report_*``, ``test_cli_*``, ``test_testing_*``, ``test_kernels_*``,
``test_integrations_*``; ``harness_benchmark/`` holds the harness's own benchmark and its test.

Slow tests (seconds each on a 2-core machine: the Triton interpreter, real processes, forked
writers) carry the ``slow`` marker: ``make test`` (CI) runs everything, ``pytest -m "not slow"``
the rest, in under a minute.
"""
import os

import pytest


def pytest_configure(config):
    # Without a GPU, Triton kernels run on CPU tensors through the interpreter. It must be
    # enabled before triton is first imported, which happens inside tests, not at collection.
    from parity.run import platform

    if not platform.gpu_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device():
    from parity.run import platform

    return platform.default_device()


# Whole files of slow tests, each with why.
SLOW_FILES = {
    "test_bundle_commit.py": "the kill and race tests fork real writers",
    "test_kernels_attention.py": "every layout, dtype and GQA ratio through the Triton interpreter",
    "test_kernels_masks.py": "element masks through the Triton interpreter",
    "test_kernels_aot.py": "ahead-of-time compiles for targets that are not here",
    "test_integrations_transformers.py": "transformers models, layer by layer",
    "test_judge_golden.py": "the kernel against the H200 goldens under the interpreter",
    "test_testing_properties.py": "Hypothesis draws of kernel cases under the interpreter",
    "test_run_trust.py": "real processes through both entry points",
    "test_cli_exit_status.py": "every exit status in real processes",
    "test_install.py": "pip resolves the Makefile's pins",
    "test_harness_benchmark.py": "the harness benchmark in real processes",
    "test_kernels_decode.py": "the decode path at every split count through the Triton interpreter",
    "test_dist.py": "rank processes (2 and 4) importing torch and DTensor",
    "test_report_html_layout.py": "a headless Chromium renders every page",
    "test_judge_fault_matrix.py": "a fault-injected model compared per case",
    "test_kernels_op.py": "opcheck and torch.compile of the operator through the Triton interpreter",
    "test_kernels_host_tma.py": "the host_tma option's loads through the Triton interpreter",
}
# Markers whose tests are slow too: the full mutation run of the bundle reader.
SLOW_MARKERS = ("mutation",)


@pytest.hookimpl(tryfirst=True)  # before -m selects: `-m "not slow"` sees these markers
def pytest_collection_modifyitems(config, items):
    from parity.run import platform

    for item in items:
        if item.path.name in SLOW_FILES or any(marker in item.keywords for marker in SLOW_MARKERS):
            item.add_marker(pytest.mark.slow)
    if platform.gpu_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA or ROCm GPU (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
