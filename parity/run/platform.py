"""The one place of the harness that knows vendors, architectures and versions, and fingerprints numerics.

Nothing else in the harness inspects ``torch.version.hip``, device capabilities or Triton's
environment variables: ask this module. The compile targets and the device questions the kernel
itself needs (the targets' :class:`ArchSpec` table, :func:`arch_of`, :func:`vendor_of`,
:func:`triton_interpreter_enabled`) are answered by the kernel layer (``parity.kernels.targets``)
and handed on from here.
"""
from __future__ import annotations

import ctypes
import os
import platform as _py_platform
import threading
from typing import Any

import torch

from parity.base.errors import UsageError
from parity.kernels import targets
from parity.kernels.targets import ArchSpec, arch_of, triton_interpreter_enabled, vendor_of


def arch_spec(name: str) -> ArchSpec:
    """The facts of a compile target (``parity.kernels.targets.ARCHS``); UsageError naming the known ones otherwise."""
    try:
        return targets.arch_spec(name)
    except ValueError as err:
        raise UsageError(str(err)) from None


def gpu_available() -> bool:
    return torch.cuda.is_available()


def default_device() -> torch.device:
    return torch.device("cuda") if gpu_available() else torch.device("cpu")


def prefetch_imports() -> threading.Thread:
    """Import, on a daemon thread, the modules :func:`fingerprint` reads that the caller may not
    have imported yet (Triton: 0.15-0.27 s on the H200 host, where a 2 GB capture takes 2 s), so
    a caller can overlap the import with its own work. Join it before :func:`fingerprint`, which
    reads every value itself: a failed import here is left for it to meet (and report) again."""

    def run() -> None:
        try:
            triton_version()
        except Exception:  # noqa: BLE001 - fingerprint() imports again and says what went wrong
            pass

    thread = threading.Thread(target=run, name="parity-imports", daemon=True)
    thread.start()
    return thread


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def fingerprint(device: torch.device | str | None = None) -> dict[str, Any]:
    """A numerics-aware description of this host, recorded in bundles and diffed by compare.

    Everything here can change the bits a kernel produces: vendor and arch, library versions,
    TF32 and reduced-precision reduction flags, deterministic mode, Triton's FP-fusion (FMA
    contraction) and fp32 dot precision defaults, whether Triton runs in the interpreter, and
    which GPU libraries torch uses (:func:`gpu_library_fingerprint`: BLAS, ROCm flash attention,
    TunableOp, cuDNN/MIOpen, the numerics environment variables).
    """
    device = torch.device(device) if device is not None else default_device()
    vendor = vendor_of(device)
    info: dict[str, Any] = {
        "vendor": vendor,
        "arch": arch_of(device),
        "device": str(device),
        "device_name": _py_platform.processor() or _py_platform.machine(),
        "host_os": f"{_py_platform.system()} {_py_platform.release()}",
        "python": _py_platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "cuda_version": torch.version.cuda,
        "hip_version": torch.version.hip,
        "driver": None,  # kernel driver (nvidia-smi's version); driver_api: CUDA driver API
        "triton_interpreter": triton_interpreter_enabled(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        # Triton reads these at compile time; unset means the Triton version's default.
        "triton_default_fp_fusion": os.environ.get("TRITON_DEFAULT_FP_FUSION"),
        "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT"),
    }
    info.update(gpu_library_fingerprint(device))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device_name"] = props.name
        info["multiprocessors"] = props.multi_processor_count
        info["driver"] = _driver_version()
        info["driver_api"] = _driver_api_version()
    return info


# Environment variables that change which library or algorithm computes a GPU op, or its
# precision, on either vendor (logging and memory-size knobs are left out):
# - TORCH_BLAS_PREFER_CUBLASLT / TORCH_BLAS_PREFER_HIPBLASLT: torch's initial preferred BLAS
#   library (torch.backends.cuda.preferred_blas_library).
# - TORCH_ROCM_FA_PREFER_CK: CK instead of AOTriton for flash attention on ROCm;
#   TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL: AOTriton's SDPA kernels on architectures it marks
#   experimental.
# - HIPBLASLT_ALLOW_TF32: ROCm's TF32 (xf32) for fp32 GEMMs, which torch honours only with it set
#   (pytorch/pytorch#143549); TORCH_ALLOW_TF32_CUBLAS_OVERRIDE and NVIDIA_TF32_OVERRIDE force TF32
#   on or off on CUDA whatever torch.backends says.
# - CUBLAS_WORKSPACE_CONFIG: cuBLAS's deterministic reductions; ROCBLAS_DEFAULT_ATOMICS_MODE: the
#   same for rocBLAS; ROCBLAS_USE_HIPBLASLT: rocBLAS's GEMM backend (Tensile or hipBLASLt).
# - MIOPEN_FIND_MODE / MIOPEN_FIND_ENFORCE: which MIOpen solver is searched for and picked.
# - PYTORCH_TUNABLEOP_*: TunableOp, which picks a GEMM kernel per shape by timing it (a different
#   reduction order per machine) or replays a results file.
NUMERICS_ENV_NAMES = (
    "TORCH_BLAS_PREFER_CUBLASLT",
    "TORCH_BLAS_PREFER_HIPBLASLT",
    "TORCH_ROCM_FA_PREFER_CK",
    "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL",
    "HIPBLASLT_ALLOW_TF32",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "NVIDIA_TF32_OVERRIDE",
    "CUBLAS_WORKSPACE_CONFIG",
    "ROCBLAS_DEFAULT_ATOMICS_MODE",
    "ROCBLAS_USE_HIPBLASLT",
    "MIOPEN_FIND_MODE",
    "MIOPEN_FIND_ENFORCE",
)
NUMERICS_ENV_PREFIXES = ("PYTORCH_TUNABLEOP_",)
_NOT_NUMERICS_ENV = ("PYTORCH_TUNABLEOP_VERBOSE", "PYTORCH_TUNABLEOP_VERBOSE_FILENAME")


def numerics_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The numerics-relevant environment variables that are set (``NUMERICS_ENV_NAMES`` and the
    ``PYTORCH_TUNABLEOP_`` family), sorted by name."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in sorted(environ)
            if (name in NUMERICS_ENV_NAMES or name.startswith(NUMERICS_ENV_PREFIXES)) and name not in _NOT_NUMERICS_ENV}


def _backend_name(getter: Any) -> str | None:
    """``torch.backends.cuda.preferred_*_library()``'s answer in lower case (``cublaslt``,
    ``default``, ``ck``); None where this torch lacks the function or the call fails."""
    if getter is None:
        return None
    try:
        backend = getter()
    except (RuntimeError, AttributeError, TypeError):
        return None
    name = getattr(backend, "name", None)
    return str(name).lower() if name is not None else None


def _tunableop_state() -> dict[str, Any]:
    """TunableOp's state: on (GEMMs use tuned kernels), tuning (new shapes are timed now) and the
    results file. CPU builds of torch lack the bindings (AttributeError): None each."""
    tunable = getattr(torch.cuda, "tunable", None)
    state: dict[str, Any] = {"tunableop_enabled": None, "tunableop_tuning": None, "tunableop_filename": None}
    if tunable is None:
        return state
    for key, name in (("tunableop_enabled", "is_enabled"), ("tunableop_tuning", "tuning_is_enabled"),
                      ("tunableop_filename", "get_filename")):
        try:
            state[key] = getattr(tunable, name)()
        except (AttributeError, RuntimeError):
            state[key] = None
    return state


def _rocm_version() -> str | None:
    """The ROCm installation's version (``$ROCM_PATH/.info/version``, default /opt/rocm); torch's
    own HIP runtime is ``hip_version``. None where there is no such file."""
    root = os.environ.get("ROCM_PATH") or "/opt/rocm"
    try:
        with open(os.path.join(root, ".info", "version")) as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def gpu_library_fingerprint(device: torch.device | str) -> dict[str, Any]:
    """Which GPU libraries and modes compute torch's ops on ``device``: the preferred BLAS and
    linear-algebra libraries, the ROCm flash-attention backend, the SDPA backends enabled,
    TunableOp, the cuDNN or MIOpen version, the ROCm install, and the numerics environment.

    Every key is always present; a value is None where it does not apply (a CPU device, the other
    vendor) or this torch cannot tell. Nothing here initializes a GPU for a CPU device: the
    library queries run only for a CUDA/ROCm device.
    """
    device = torch.device(device)
    hip = bool(torch.version.hip)
    on_gpu = device.type == "cuda"
    backends = torch.backends.cuda
    info: dict[str, Any] = {
        "blas_library": None,
        "linalg_library": None,
        "rocm_fa_library": None,
        "sdp_backends": None,
        "tunableop_enabled": None,
        "tunableop_tuning": None,
        "tunableop_filename": None,
        "cudnn_version": None,
        "miopen_version": None,
        "rocm_version": _rocm_version() if hip else None,
        "numerics_env": numerics_environment(),
    }
    if not on_gpu:
        return info
    info["blas_library"] = _backend_name(getattr(backends, "preferred_blas_library", None))
    info["linalg_library"] = _backend_name(getattr(backends, "preferred_linalg_library", None))
    if hip:
        info["rocm_fa_library"] = _backend_name(getattr(backends, "preferred_rocm_fa_library", None))
    enabled = []
    for name in ("flash", "mem_efficient", "math", "cudnn"):
        check = getattr(backends, f"{name}_sdp_enabled", None)
        if check is not None and check():
            enabled.append(name)
    info["sdp_backends"] = ",".join(enabled)
    info.update(_tunableop_state())
    try:
        # On ROCm builds torch.backends.cudnn is MIOpen and version() is MIOpen's.
        dnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except (RuntimeError, AttributeError):
        dnn_version = None
    info["miopen_version" if hip else "cudnn_version"] = dnn_version
    return info


def _driver_version() -> str | None:
    """The kernel driver's version as nvidia-smi prints it (NVML, e.g. 580.159.04); on ROCm the
    amdgpu module's version. None when the library or file is not there."""

    if torch.version.hip:
        try:
            with open("/sys/module/amdgpu/version") as handle:
                return handle.read().strip() or None
        except OSError:
            return None
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        try:
            buffer = ctypes.create_string_buffer(96)
            if lib.nvmlSystemGetDriverVersion(buffer, ctypes.c_uint(len(buffer))) != 0:
                return None
            return buffer.value.decode() or None
        finally:
            lib.nvmlShutdown()
    except (OSError, AttributeError):
        return None


def _driver_api_version() -> str | None:
    """The CUDA driver API version the driver supports (cuDriverGetVersion, e.g. 13.0); on ROCm
    the HIP version torch was built with."""
    if torch.version.hip:
        return torch.version.hip
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
        return f"{version.value // 1000}.{(version.value % 1000) // 10}"
    except (OSError, AttributeError):
        return None


# Fingerprint keys whose difference between capture and compare hosts changes numerics; compare
# lists these in its report (a key an older bundle did not record is unknown, not a difference).
# Device names and the torch/Triton/driver versions differ by design between hosts and are
# informational only; the cuDNN and MIOpen versions are here because they pick the convolution
# and attention algorithms, so a change of either changes results on the same GPU.
NUMERICS_KEYS = (
    "tf32_matmul",
    "tf32_cudnn",
    "float32_matmul_precision",
    "fp16_reduced_precision_reduction",
    "bf16_reduced_precision_reduction",
    "deterministic_algorithms",
    "triton_default_fp_fusion",
    "triton_f32_default",
    "blas_library",
    "linalg_library",
    "rocm_fa_library",
    "sdp_backends",
    "tunableop_enabled",
    "tunableop_tuning",
    "tunableop_filename",
    "cudnn_version",
    "miopen_version",
    "numerics_env",
)
