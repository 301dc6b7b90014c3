#!/usr/bin/env bash
# One call on an NVIDIA GPU host (the H200 lent through the workplace's device tool) that checks
# and times the kernel, writing everything under $OUT/results.tgz:
#   1. install this checkout (no dependencies: the host's torch and Triton are the ones measured);
#   2. the benchmark against FlexAttention and SDPA (bench/BENCHMARK.md), with the variants
#      given as arguments (each: --config KEY=VALUE,...);
#   3. the GPU-marked tests;
#   4. `parity compare` of the Triton kernel against the committed H200 goldens;
#   5. the property tests under the parity-gpu Hypothesis profile;
#   6. `parity inspect --target sm_90` with this host's Triton (compile report of the pinned configs).
# Each step has a time limit and its own log; a failing step does not stop the later ones, and
# the step's exit status is recorded in status.txt. EXTRA_BENCH (benchmark arguments) adds a
# second benchmark run, e.g. another head dim; MASKS (document,padding or all) adds the
# element-mask benchmark; PROPERTY_EXAMPLES sets the property test's cases; DECODE_ARGS the decode
# benchmark's arguments; SWEEP_CASES, SWEEP_ARGS and TABLE_ARGS the prefill table's (steps "table-sweep",
# "table"); GPU_TESTS which test files the GPU tests take (default: all of tests/). STEPS (names,
# space-separated) runs only those of the steps 2-6 (install always runs). HARNESS (arguments of
# `python bench/harness/harness_benchmark.py`) adds the harness's own benchmark on the GPU (bench/harness/BENCHMARK.md)
# and its profile at the first size (HARNESS_PROFILE=0: not the profile; HARNESS_LIMIT: seconds).
# The host has no network and no `blake3` (a dependency since bundle schema 4): WHEELS (default
# .device-wheels) is a folder of wheels for the host's Python, installed from there without an
# index when blake3 is missing, e.g. made beforehand with
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .device-wheels blake3
#
#   EXTRA_BENCH="--head-dim 64 --seq 4096 --config one_loop=1" \
#       bash bench/h200_run.sh --config block_n=128 --config one_loop=0
set -u
# The lab is not installed (bench/ stays out of the wheel): it runs from the checkout, whose root is
# the working directory and first on the path, so `python -m bench.benchmark` finds it from anywhere.
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-out}
R=$(mktemp -d)/r  # only results.tgz goes under $OUT (the device tool brings back at most 8 files)
mkdir -p "$R" "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

STEPS=${STEPS:-"benchmark benchmark-extra benchmark-masks decode gpu-tests compare-attention compare-decoder gpu-properties inspect inspect-decode"}
# (also: "table-sweep" and "table", the prefill table of bench/benchmark_table.py, and
# "launch-time", "host-parts" and "ncu", where a short case's time goes; "launch-overhead", "probe-merge",
# "hf-host", "hf-layer-host", "hf-generate", "hf-compiled", "hf-window" and "hf-bench", inference; "capture-scale", capture and compare of
# 1-10B Llama shapes; not run by default)

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    case " install harness harness-profile $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    local start=$SECONDS
    timeout "$limit" "$@" >"$R/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc ${SECONDS}s-total $((SECONDS - start))s" | tee -a "$R/status.txt"
    tar czf "$OUT/results.tgz" -C "$(dirname "$R")" r  # after every step: a call cut short still brings back the rest
}

# An editable install: a plain install would be shadowed by the checkout's own parity/ package.
"$PY" -c 'import blake3' 2>/dev/null || "$PY" -m pip install -q --no-index --find-links "${WHEELS:-.device-wheels}" \
    blake3 >"$R/wheels.log" 2>&1
step install 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
    --format=csv >"$R/gpu.csv" 2>&1
"$PY" -c 'import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)' >"$R/versions.txt" 2>&1
step benchmark 330 "$PY" -m bench.benchmark --json "$R/bench.json" "$@"
if [ -n "${EXTRA_BENCH:-}" ]; then
    # shellcheck disable=SC2086  # word splitting of the argument string is intended
    step benchmark-extra 150 "$PY" -m bench.benchmark --json "$R/bench-extra.json" $EXTRA_BENCH
fi
if [ -n "${MASKS:-}" ]; then
    # The element-mask cases against FlexAttention (e.g. MASKS=document,padding or all).
    step benchmark-masks 240 "$PY" -m bench.benchmark --masks "$MASKS" --json "$R/bench-masks.json"
fi
# The prefill kernel's variants on a few cases (step table-sweep: SWEEP_CASES, SWEEP_ARGS), then
# the whole table in one run (step table: TABLE_ARGS, plus the sweep's pick when the sweep ran in
# this call) (bench/benchmark_table.py; each JSON is rewritten after every case). The default
# variants are the spill-free ones of `parity inspect --target sm_90` with Triton 3.6 (BENCHMARK.md).
SWEEP_CASES=${SWEEP_CASES:-d64-s4k-causal,d64-s16k-window1024,d64-s4k-random25,d128-s4k-causal,d128-s16k-causal,d128-s16k-random25}
SWEEP_ARGS=${SWEEP_ARGS:-"--config d64:tma=1 --config d64:num_warps=4,tma=1 --config d64:block_n=128,tma=1 \
--config d64:block_n=128,one_loop=1 --config d128:tma=1 --config d128:block_n=128,tma=1"}
# shellcheck disable=SC2086  # word splitting of the argument strings is intended
step table-sweep "${SWEEP_LIMIT:-540}" "$PY" -m bench.benchmark_table --json "$R/sweep.json" --repeats 3 \
    --cases "$SWEEP_CASES" $SWEEP_ARGS
PICKED=""
if [ -s "$R/sweep.json" ]; then
    PICKED=$("$PY" -m bench.benchmark_table --pick "$R/sweep.json" 2>"$R/pick.log")
    echo "picked: ${PICKED:-nothing beats the pinned configs}" >>"$R/pick.log"
fi
# shellcheck disable=SC2086
step table "${TABLE_LIMIT:-540}" "$PY" -m bench.benchmark_table --json "$R/table.json" ${TABLE_ARGS:-} $PICKED
# Short cases: call time against CUDA-graph device time and host time per call
# (bench/launch_time.py; LAUNCH_CASES); then, with NCU (default: ncu on the PATH or in
# /usr/local/cuda/bin), Nsight Compute's throughput, occupancy and launch sections of each
# implementation of NCU_CASES, clocks left alone (the device notes ask for --clock-control none);
# NCU_SECTIONS adds sections (e.g. "WarpStateStats": why warps stall), NCU_METRICS metrics (a,b,...).
LAUNCH_CASES=${LAUNCH_CASES:-d64-s4k-causal,d64-s4k-window1024,d64-s4k-random25,d128-s4k-causal,d128-s4k-window1024,d128-s4k-random25}
step launch-time "${LAUNCH_LIMIT:-300}" "$PY" -m bench.launch_time --cases "$LAUNCH_CASES"
step host-parts 60 "$PY" -m bench.launch_time --host-parts --cases "$LAUNCH_CASES"
# Inference: the launcher's host time per call, call minus CUDA-graph time, for the prefill
# table's rows and the decode rows (bench/launch_overhead.py; OVERHEAD_ROWS); then a Hugging Face
# model with Llama-3-8B's shape (HF_ARGS) and one with Mistral-7B's sliding window (HF_WINDOW_ARGS),
# prefill and generate with sdpa, parity_sdpa and parity_sparse, eager and compiled
# (bench/hf_generate.py, transformers from the host).
# shellcheck disable=SC2086
step launch-overhead "${OVERHEAD_LIMIT:-240}" "$PY" -m bench.launch_overhead --device cuda ${OVERHEAD_ROWS:+--rows "$OVERHEAD_ROWS"}
# Where a decode call's device time goes per merge setting: the split kernel and the merge
# under the profiler, each chunking and split count, beside SDPA (bench/probe_decode_merge.py).
# shellcheck disable=SC2086
step probe-merge "${PROBE_LIMIT:-200}" "$PY" -m bench.probe_decode_merge ${PROBE_ARGS:-}
# shellcheck disable=SC2086
step hf-host "${HF_HOST_LIMIT:-240}" "$PY" -m bench.hf_host --json "$R/hf-host.json" ${HF_HOST_ARGS:-}
# One attention layer's host time per implementation, the forward's first layer profiled apart
# (bench/hf_layer_host.py; HF_LAYER_ARGS).
# shellcheck disable=SC2086
step hf-layer-host "${HF_LAYER_LIMIT:-150}" "$PY" bench/hf_layer_host.py --device cuda --json "$R/hf-layer-host.json" \
    ${HF_LAYER_ARGS:-}
# shellcheck disable=SC2086
step hf-generate "${HF_LIMIT:-420}" "$PY" -m bench.hf_generate --model llama8b --json "$R/hf-llama8b.json" \
    --deadline-s $(( ${HF_LIMIT:-420} - 60 )) ${HF_ARGS:-}
# shellcheck disable=SC2086
step hf-compiled "${HF_COMPILED_LIMIT:-420}" "$PY" -m bench.hf_generate --model llama8b --json "$R/hf-llama8b-compiled.json" \
    --deadline-s $(( ${HF_COMPILED_LIMIT:-420} - 90 )) ${HF_COMPILED_ARGS:---cases 1x4096 --modes compiled}
# shellcheck disable=SC2086
step hf-window "${HF_WINDOW_LIMIT:-300}" "$PY" -m bench.hf_generate --model mistral7b --json "$R/hf-mistral7b.json" \
    --deadline-s $(( ${HF_WINDOW_LIMIT:-300} - 60 )) ${HF_WINDOW_ARGS:---cases 1x16384 --modes eager}
# The same Llama-3-8B shape's prefill (1 x 4096 tokens, no cache, bf16) timed by `parity bench`
# (bench/hf_subject.py) with sdpa, parity_sdpa and parity_sparse on one set of weights: each
# speedup over sdpa valid only where its logits hold parity with sdpa's; the attention blocks
# (model.layers.*.self_attn) timed apart. Few rounds: one forward is about 0.1-0.6 s. HF_BENCH_ARGS
# replaces the size, length and rounds, e.g. "--set size=mistral7b --set seq=16384 --reps 5".
# shellcheck disable=SC2086
step hf-bench "${HF_BENCH_LIMIT:-180}" "$PY" -m parity bench --subject bench.hf_subject:make_subject \
    --impls sdpa,parity_sdpa,parity_sparse --device cuda --json "$R/hf-bench.json" --html "$R/hf-bench.html" \
    ${HF_BENCH_ARGS:---set size=llama8b --set seq=4096 --set batch=1 --warmup 2 --reps 5 --module model.layers.*.self_attn}
# How far apart correct attention implementations put the same model's logits, each against an
# fp32 forward (bench/hf_logit_spread.py; HF_SPREAD_ARGS).
# shellcheck disable=SC2086
step hf-logit-spread "${HF_SPREAD_LIMIT:-180}" "$PY" -m bench.hf_logit_spread --json "$R/hf-logit-spread.json" \
    ${HF_SPREAD_ARGS:-}
# Capture and compare at scale (bench/capture_scale_gpu.py): Llama shapes of 1, 3, 8 and 10B
# parameters built in bf16 on the GPU, the per-module fp32 reference, compare with parity_sparse,
# against the targets of issue 47; one JSON per size under capture-scale/, rewritten after every
# row. CAPTURE_SCALE_ARGS e.g. "--seq 4096 --sizes 8b,10b" or "--weights reference".
# shellcheck disable=SC2086
step capture-scale "${CAPTURE_SCALE_LIMIT:-470}" "$PY" -m bench.capture_scale_gpu --out "$R/capture-scale" \
    --deadline-s $(( ${CAPTURE_SCALE_LIMIT:-470} - 20 )) ${CAPTURE_SCALE_ARGS:-}
NCU=${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)}
NCU_CASES=${NCU_CASES:-d64-s4k-causal,d64-s4k-random25,d128-s4k-causal,d128-s16k-causal}
NCU_MORE=()
for section in ${NCU_SECTIONS:-}; do NCU_MORE+=(--section "$section"); done
if [ -n "${NCU_METRICS:-}" ]; then NCU_MORE+=(--metrics "$NCU_METRICS"); fi
step ncu "${NCU_LIMIT:-150}" "${NCU:-ncu}" --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section ComputeWorkloadAnalysis "${NCU_MORE[@]}" --csv --page details \
    "$PY" -m bench.launch_time --ncu-target --cases "$NCU_CASES"
# The decode path against SDPA and FlexAttention (bench/BENCHMARK.md); DECODE_ARGS adds
# e.g. --sweep --threshold --variant KEY=VALUE,...
# shellcheck disable=SC2086  # word splitting of the argument string is intended
step decode "${DECODE_LIMIT:-480}" "$PY" -m bench.benchmark_decode --json "$R/decode.json" ${DECODE_ARGS:-}
# 300 s: the element-mask GPU tests (tests/test_kernels_masks.py) compile about 30 more kernel variants.
# The test modules that import a test-only dependency at the top (jsonschema, xmlschema,
# transformers: pyproject's test extra, which the host may lack) hold no GPU test; where the host
# lacks one, they are left out rather than failing collection (in the suite they error, never skip).
# Each package is probed on its own: one that is missing leaves out only the modules importing it.
# A test module that imports such a module (``from test_report_json_schemas import validate``) is
# left out with it.
IGNORE=()
for dep in jsonschema xmlschema transformers; do
    "$PY" -c "import $dep" 2>/dev/null && continue
    while read -r module; do
        IGNORE+=("--ignore=$module")
        while read -r importer; do
            IGNORE+=("--ignore=$importer")
        done < <(grep -lE "^(import|from) $(basename "$module" .py)\b" tests/*.py 2>/dev/null)
    done < <(grep -lE "^(import|from) $dep\b" tests/*.py tests/*/*.py 2>/dev/null)
done
# shellcheck disable=SC2086  # GPU_TESTS: test paths, split on spaces
step gpu-tests "${GPU_TESTS_LIMIT:-300}" "$PY" -m pytest -m gpu -q -p no:cacheprovider "${IGNORE[@]}" \
    --junitxml="$R/gpu-tests.xml" ${GPU_TESTS:-tests}
step compare-attention 45 "$PY" -m parity compare --golden golden/h200-attention --impl triton \
    --device cuda --budget --quiet --json "$R/compare-attention.json"
step compare-decoder 45 "$PY" -m parity compare --golden golden/h200-decoder --impl triton \
    --device cuda --budget --isolate --quiet --json "$R/compare-decoder.json"
step gpu-properties 150 env PARITY_HYPOTHESIS_PROFILE=gpu PARITY_HYPOTHESIS_MAX_EXAMPLES="${PROPERTY_EXAMPLES:-40}" \
    "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_testing_properties.py -k kernel_matches_reference
step inspect 90 "$PY" -m parity inspect --target sm_90 --dtype bf16 --dtype fp16 --dtype fp32 \
    --head-dim 64 --head-dim 128 --head-dim 256 --json "$R/inspect-sm90.json"
step inspect-decode 90 "$PY" -m parity inspect --kernel decode --target sm_90 --dtype bf16 --dtype fp16 --dtype fp32 \
    --head-dim 64 --head-dim 128 --head-dim 256 --json "$R/inspect-decode-sm90.json"
if [ -n "${HARNESS:-}" ]; then
    # shellcheck disable=SC2086  # word splitting of the argument string is intended
    step harness "${HARNESS_LIMIT:-480}" "$PY" bench/harness/harness_benchmark.py --device cuda --workdir /tmp/parity-bench \
        --json "$R/harness.json" $HARNESS
    if [ "${HARNESS_PROFILE:-1}" != 0 ]; then
        # shellcheck disable=SC2086
        step harness-profile 120 "$PY" bench/harness/harness_benchmark.py --device cuda --profile --workdir /tmp/parity-bench \
            --json "$R/harness-profile.json" $HARNESS
    fi
fi
tar czf "$OUT/results.tgz" -C "$(dirname "$R")" r
cat "$R/status.txt"
