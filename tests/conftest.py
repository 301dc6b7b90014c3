"""Test-suite setup: the Triton interpreter on machines without a GPU, the gpu marker, and which
tests are slow.

The test files follow the rooms of the code: ``test_base_*``, ``test_bundle_*``, ``test_run_*``,
``test_judge_*``, ``test_report_*``, ``test_cli_*``, ``test_testing_*``, ``test_kernels_*``,
``test_integrations_*``; ``test_bench_*`` test the lab beside the package (bench/, not installed).

Slow tests (seconds each on a 2-core machine: the Triton interpreter, real processes, forked
writers) carry the ``slow`` marker: ``make test`` (CI) runs everything, ``make test-fast``
(``pytest -n 2 -m "not slow"``) the rest, in under a minute on an idle 2-core machine.
"""
import os

import pytest


def pytest_configure(config):
    # Without a GPU, Triton kernels run on CPU tensors through the interpreter. It must be
    # enabled before triton is first imported, which happens inside tests, not at collection.
    from parity.run import platform

    if not platform.gpu_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    share_cores_between_workers()


def share_cores_between_workers() -> None:
    """Under xdist, gives each worker its share of the cores for torch's intra-op threads (and
    OMP_NUM_THREADS for the processes its tests start). torch's default is one thread per core
    in every worker: two workers on 2 cores run 4 OpenMP threads that spin-wait on each other's
    cores. Measured on the 2-core machine (loaded by other jobs), tests/test_judge_metrics.py in
    one process: 56 CPU-s with 2 threads, 15 with 1. A plain (single-process) run keeps torch's
    default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1:
        return
    import torch

    threads = max(1, (os.cpu_count() or 1) // workers)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


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
    "test_wheel.py": "builds and installs the wheel, then runs the README's commands from it in processes of its own",
    "test_kernels_decode.py": "the decode path at every split count through the Triton interpreter",
    "test_distributed.py": "rank processes (2 and 4) importing torch and DTensor",
    "test_judge_fault_matrix.py": "a fault-injected model compared per case",
    "test_kernels_op.py": "opcheck and torch.compile of the operator through the Triton interpreter",
    "test_kernels_host_tma.py": "the host_tma option's loads through the Triton interpreter",
    "test_kernels_launch_cache.py": "every key field checked against Triton's own binder through the interpreter",
    "test_testing_strategies.py": "Hypothesis searches that reach every edge case, the fuzz CLI in processes",
    "test_report_html.py": "HTML reports of real captures and of the committed H200 report",
}
# Single slow tests of otherwise fast files (file::function, every parametrization), each with why.
SLOW_TESTS = {
    "test_judge_structure.py::test_eager_golden_against_the_kernel_calls_the_weights_absent":
        "a transformers Llama captured, then compared through the Triton interpreter",
    "test_base_report_paths.py::test_two_reports_on_stdout_are_refused_however_stdout_is_named":
        "real processes with stdout as a pipe, a file and a terminal",
    "test_base_report_paths.py::test_a_fifo_without_a_reader_does_not_hold_up_an_error_report":
        "a real process writing into a FIFO, waited on",
    "test_base_report_paths.py::test_a_trace_is_written_as_every_report_is": "a profile in a real process",
    "test_base_report_paths.py::test_dev_stdout_is_the_stream_after_what_it_holds": "real processes",
    "test_report_json_schemas.py::test_committed_compare_reports_still_validate": "150-case committed reports",
    "test_report_json_schemas.py::test_isolated_report_validates": "a compare with every layer replayed",
    "test_judge_metrics.py::test_chunked_scan_equals_a_straightforward_float64_computation":
        "float64 scans of tensors up to 40k elements in every dtype",
    "test_speed_bench.py::test_faster_but_wrong_is_refused_with_exit_1": "bench in a real process",
    "test_packaging.py::test_an_installed_kernels_package_wins_over_the_checkout_folder": "a real process",
    "test_packaging.py::test_without_an_installed_one_the_folder_still_imports":
        "a real process that may import transformers",
    "test_base_report_paths.py::test_a_gz_trace_is_compressed_and_streamed_beside_its_target": "a profile run",
    "test_speed_bench.py::test_valid_speedup_and_slowdown": "timed rounds of three implementations",
    "test_speed_bench.py::test_device_time_next_to_wall_time": "timed rounds",
    "test_speed_bench.py::test_cases_give_a_fast_p_line": "timed rounds over a case set",
    "test_distributed_placement.py::test_placements_of_parallel_styles": "imports DTensor and its parallel styles",
    "test_run_capture.py::test_cli_decoder_and_attention_options": "decoder and attention captures through the CLI",
    "test_run_scale.py::test_capture_and_compare_memory_does_not_grow_with_the_recorded_tensors":
        "four processes writing and reading bundles of up to 0.5 GB",
    "test_testing_plugin.py::test_a_broken_subject_is_a_one_line_failure_never_a_pass": "a pytest run in a process",
}
# The lab's tests (bench/: benchmarks, probes, device scripts, the harness benchmark) are slow as a
# room: they check the programs that measured the kernel, not what a user installs.
SLOW_PREFIXES = {"test_bench_": "the lab beside the package (bench/), not the installed harness"}
# Markers whose tests are slow too: the full mutation run of the bundle reader; headless Chromium
# rendering the HTML pages (a browser start per page and width).
SLOW_MARKERS = ("mutation", "browser")
# A test whose every check is the first part of another test's (file::function -> file::function):
# skipped, with the reason shown, in a session that selects the other, so nothing runs twice; run
# alone where the other is deselected.
PREFIX_OF = {
    "test_bundle_mutation.py::test_mutation_fast": "test_bundle_mutation.py::test_mutation_full",
}


def _key(item) -> str:
    return f"{item.path.name}::{getattr(item, 'originalname', item.name)}"


@pytest.hookimpl(tryfirst=True)  # before -m selects: `-m "not slow"` sees these markers
def pytest_collection_modifyitems(config, items):
    from parity.run import platform

    for item in items:
        if (item.path.name in SLOW_FILES or item.path.name.startswith(tuple(SLOW_PREFIXES))
                or _key(item) in SLOW_TESTS
                or any(marker in item.keywords for marker in SLOW_MARKERS)):
            item.add_marker(pytest.mark.slow)
    slow_files_first(items)
    if platform.gpu_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA or ROCm GPU (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def slow_files_first(items) -> None:
    """Moves every file with a slow test before the others, each file's tests in their order (the
    sort is stable). xdist hands tests out in this order, so the quick tests come last and keep
    both workers busy to the end, instead of one worker finishing a long kernel or process test
    while the other waits."""
    has_slow = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in has_slow)


def pytest_collection_finish(session):
    # After -m and -k have deselected (pytest_collection_modifyitems above runs before them): only
    # the final selection says whether the longer test runs in this session. Under xdist every
    # worker collects the same selection, so each decides the same.
    selected = {_key(item) for item in session.items}
    for item in session.items:
        longer = PREFIX_OF.get(_key(item))
        if longer in selected:
            item.add_marker(pytest.mark.skip(reason=f"its checks are the first part of {longer}, selected too"))
