"""The platform fingerprint's GPU-library fields (BLAS, ROCm flash attention, TunableOp, cuDNN/MIOpen,
numerics environment): present everywhere, null where they do not apply, read through torch's own
functions on CUDA and ROCm (monkeypatched here), and warned about by compare when they differ."""
import json
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from parity.run import platform
from parity.bundle.reader import open_bundle
from parity.judge.results import fingerprint_differences

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
LIBRARY_KEYS = ("blas_library", "linalg_library", "rocm_fa_library", "sdp_backends", "tunableop_enabled",
                "tunableop_tuning", "tunableop_filename", "cudnn_version", "miopen_version", "rocm_version",
                "numerics_env")


def _named(name):
    return lambda: SimpleNamespace(name=name)


def _fail(*args, **kwargs):
    raise AssertionError("a GPU library was queried for a CPU device")


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name in platform.NUMERICS_ENV_NAMES or name.startswith(platform.NUMERICS_ENV_PREFIXES):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def fake_gpu_torch(clean_env):
    """torch's library queries answering as a GPU build would."""
    m = clean_env
    m.setattr(torch.backends.cuda, "preferred_blas_library", _named("Cublaslt"))
    m.setattr(torch.backends.cuda, "preferred_linalg_library", _named("Default"))
    m.setattr(torch.backends.cuda, "preferred_rocm_fa_library", _named("Ck"))
    m.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: True)
    m.setattr(torch.backends.cuda, "mem_efficient_sdp_enabled", lambda: False)
    m.setattr(torch.backends.cuda, "math_sdp_enabled", lambda: True)
    m.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    m.setattr(torch.cuda.tunable, "is_enabled", lambda: True)
    m.setattr(torch.cuda.tunable, "tuning_is_enabled", lambda: False)
    m.setattr(torch.cuda.tunable, "get_filename", lambda: "tunableop_results0.csv")
    m.setattr(torch.backends.cudnn, "is_available", lambda: True)
    m.setattr(torch.backends.cudnn, "version", lambda: 91002)
    return m


def test_cpu_device_has_every_field_null_and_queries_no_gpu_library(clean_env):
    for name in ("preferred_blas_library", "preferred_linalg_library", "preferred_rocm_fa_library"):
        clean_env.setattr(torch.backends.cuda, name, _fail)
    clean_env.setattr(torch.backends.cudnn, "version", _fail)
    info = platform.fingerprint("cpu")
    assert set(LIBRARY_KEYS) <= set(info)
    assert {key: info[key] for key in LIBRARY_KEYS if key not in ("numerics_env", "rocm_version")} == {
        key: None for key in LIBRARY_KEYS if key not in ("numerics_env", "rocm_version")}
    assert info["numerics_env"] == {}
    json.dumps(info)  # it goes into a JSON manifest as it is


def test_cpu_build_of_torch_without_tunableop_bindings_gives_null(monkeypatch):
    # torch's CPU wheels have torch.cuda.tunable but not its C bindings: AttributeError, not a crash.
    # The bindings are removed here, so the case is tested whatever build of torch runs the suite.
    for name in ("_cuda_tunableop_is_enabled", "_cuda_tunableop_tuning_is_enabled", "_cuda_tunableop_get_filename"):
        monkeypatch.delattr(torch._C, name, raising=False)
    assert platform._tunableop_state() == {"tunableop_enabled": None, "tunableop_tuning": None,
                                          "tunableop_filename": None}


def test_cuda_fields_come_from_torch(fake_gpu_torch):
    fake_gpu_torch.setattr(torch.version, "hip", None)
    fake_gpu_torch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    info = platform.gpu_library_fingerprint("cuda")
    assert info == {
        "blas_library": "cublaslt", "linalg_library": "default", "rocm_fa_library": None,
        "sdp_backends": "flash,math", "tunableop_enabled": True, "tunableop_tuning": False,
        "tunableop_filename": "tunableop_results0.csv", "cudnn_version": 91002, "miopen_version": None,
        "rocm_version": None, "numerics_env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
    }


def test_rocm_fields_come_from_torch_and_the_rocm_install(fake_gpu_torch, tmp_path):
    fake_gpu_torch.setattr(torch.version, "hip", "6.4.43482")
    (tmp_path / ".info").mkdir()
    (tmp_path / ".info" / "version").write_text("6.4.1-1\n")
    fake_gpu_torch.setenv("ROCM_PATH", str(tmp_path))
    fake_gpu_torch.setattr(torch.backends.cudnn, "version", lambda: 30400)  # MIOpen's, on ROCm builds
    fake_gpu_torch.setenv("TORCH_BLAS_PREFER_HIPBLASLT", "0")
    fake_gpu_torch.setenv("PYTORCH_TUNABLEOP_ENABLED", "1")
    info = platform.gpu_library_fingerprint("cuda")
    assert info["rocm_fa_library"] == "ck" and info["miopen_version"] == 30400 and info["cudnn_version"] is None
    assert info["rocm_version"] == "6.4.1-1"
    assert info["numerics_env"] == {"PYTORCH_TUNABLEOP_ENABLED": "1", "TORCH_BLAS_PREFER_HIPBLASLT": "0"}


def test_missing_torch_functions_give_null(fake_gpu_torch):
    # torch versions without the ROCm flash-attention switch (< 2.6) or with a failing query.
    fake_gpu_torch.setattr(torch.version, "hip", "6.2.0")
    fake_gpu_torch.delattr(torch.backends.cuda, "preferred_rocm_fa_library")

    def broken():
        raise RuntimeError("no HIP GPUs are available")

    fake_gpu_torch.setattr(torch.backends.cuda, "preferred_blas_library", broken)
    fake_gpu_torch.setattr(torch.cuda.tunable, "is_enabled", broken)
    info = platform.gpu_library_fingerprint("cuda")
    assert info["rocm_fa_library"] is None and info["blas_library"] is None
    assert info["tunableop_enabled"] is None and info["tunableop_filename"] == "tunableop_results0.csv"


def test_numerics_environment_keeps_numerics_variables_only():
    environ = {"PYTORCH_TUNABLEOP_TUNING": "1", "PYTORCH_TUNABLEOP_VERBOSE": "3", "HIPBLASLT_ALLOW_TF32": "1",
               "MIOPEN_FIND_MODE": "FAST", "ROCBLAS_LAYER": "2", "HIPBLASLT_LOG_LEVEL": "1", "PATH": "/bin"}
    assert platform.numerics_environment(environ) == {
        "HIPBLASLT_ALLOW_TF32": "1", "MIOPEN_FIND_MODE": "FAST", "PYTORCH_TUNABLEOP_TUNING": "1"}


def test_every_library_field_is_a_numerics_key():
    assert set(LIBRARY_KEYS) - {"rocm_version"} <= set(platform.NUMERICS_KEYS)


def test_diff_warns_naming_each_library_field_that_differs():
    golden = dict(platform.fingerprint("cpu"), blas_library="cublas", cudnn_version=91002, miopen_version=None,
                  tunableop_enabled=False, numerics_env={})
    here = dict(golden, blas_library="default", rocm_fa_library="aotriton", cudnn_version=None,
                miopen_version=30400, tunableop_enabled=True,
                numerics_env={"PYTORCH_TUNABLEOP_ENABLED": "1"})
    differences = fingerprint_differences(golden, here)
    assert [d.key for d in differences] == ["blas_library", "rocm_fa_library", "tunableop_enabled",
                                            "cudnn_version", "miopen_version", "numerics_env"]
    by_key = {d.key: d for d in differences}
    assert by_key["blas_library"].message.startswith("blas_library differs: golden host 'cublas', this host 'default'")
    assert "PYTORCH_TUNABLEOP_ENABLED" in by_key["numerics_env"].message
    assert fingerprint_differences(golden, dict(golden)) == []


def test_old_bundles_without_the_fields_are_unknown_not_different():
    with open_bundle(GOLDEN / "h200-decoder") as bundle:
        golden = bundle.platform
    assert not set(LIBRARY_KEYS) & set(golden)  # captured before these fields existed
    here = dict(platform.fingerprint("cpu"), blas_library="hipblaslt", miopen_version=30400,
                numerics_env={"PYTORCH_TUNABLEOP_ENABLED": "1"})
    keys = {d.key for d in fingerprint_differences(golden, here)}
    assert not keys & set(LIBRARY_KEYS)


def test_prefetch_imports_imports_triton_on_a_thread_and_leaves_failures_to_fingerprint(monkeypatch):
    thread = platform.prefetch_imports()
    thread.join(timeout=120)
    assert not thread.is_alive() and thread.daemon
    assert "triton" in sys.modules and platform.fingerprint("cpu")["triton"] == sys.modules["triton"].__version__
    # A Triton that fails to import: the thread says nothing (no traceback from threading's hook)
    # and fingerprint meets the same error itself.
    hooked = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)

    def broken():
        raise RuntimeError("triton is broken")

    monkeypatch.setattr(platform, "triton_version", broken)
    thread = platform.prefetch_imports()
    thread.join(timeout=10)
    assert not thread.is_alive() and hooked == []
    with pytest.raises(RuntimeError, match="triton is broken"):
        platform.fingerprint("cpu")
