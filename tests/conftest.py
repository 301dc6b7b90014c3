"""Test-suite setup: the Triton interpreter on machines without a GPU, and the gpu marker."""
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


def pytest_collection_modifyitems(config, items):
    from parity.run import platform

    if platform.gpu_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA or ROCm GPU (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
