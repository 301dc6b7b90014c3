#!/usr/bin/env bash
# The port's whole story on one GPU host, with the built-in decoder at a realistic size
# (d_model 2048, 8 layers, 4096 tokens, block-sparse attention layers), written under
# $OUT/story.tgz (the device tool brings back few files: one archive, rewritten after every step):
#   1. install this checkout (no dependencies: the host's torch and Triton are the ones measured);
#   2. profile-reference: `parity profile --impl reference` (the PyTorch reference stands in for
#      the hand-written CUDA kernel): the attention's share of GPU time, the hot module, Amdahl;
#   3. profile-triton: the same with the Triton kernel, side by side with step 2 (--against), and
#      its Chrome trace (how each kernel's launch was recorded);
#   4. capture: a golden of the decoder on this GPU (root output only, fp32 reference);
#   5. bench: `parity bench --impls reference,triton --bundle` that golden: the speedup, valid
#      because parity holds (exit 0);
#   6. capture-wrong + bench-wrong: the same decoder with a third, deliberately wrong impl
#      (tests/speed_subjects.py: attention skipped, the values passed through), its own golden,
#      and the bench that refuses its speedup (exit 1 expected).
# Each step has a time limit and its own log; a failing step does not stop the later ones; each
# step's exit status goes to status.txt. Environment: PYTHON (default python3), DEVICE (cuda),
# SIZE (subject arguments), PROFILE_ARGS, BENCH_ARGS, SKIP_INSTALL=1 (use the environment as is),
# WHEELS (a folder of wheels, as in bench/h200_run.sh, for blake3 on a host without network).
# The CPU analogue at a tiny size runs in tests/test_bench_story.py.
set -u
OUT=${OUT:-out}
R=$(mktemp -d)/story
mkdir -p "$R" "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
HERE=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$HERE/tests${PYTHONPATH:+:$PYTHONPATH}"  # speed_subjects (the wrong impl)
# shellcheck disable=SC2206  # word splitting of the argument strings is intended
SIZE=(${SIZE:---set d_model=2048 --set layers=8 --set heads=16 --set kv_heads=4 --set head_dim=128 \
    --set ffn_dim=5632 --set seq_len=4096 --set batch=1 --set vocab=32000 --set window=1024 --set block=64})
# shellcheck disable=SC2206
PROFILE_ARGS=(${PROFILE_ARGS:---skip 1 --warmup 2 --active 5})
# shellcheck disable=SC2206
BENCH_ARGS=(${BENCH_ARGS:---warmup 3 --reps 20})

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$R/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc ${SECONDS}s-total $((SECONDS - start))s" | tee -a "$R/status.txt"
    tar czf "$OUT/story.tgz" -C "$(dirname "$R")" story
}

cd "$HERE" || exit 2
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    "$PY" -c 'import blake3' 2>/dev/null || "$PY" -m pip install -q --no-index --find-links "${WHEELS:-.device-wheels}" \
        blake3 >"$R/wheels.log" 2>&1
    step install 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv 2>&1 \
    || echo "no nvidia-smi"; "$PY" -c 'import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)'; } \
    >"$R/versions.txt" 2>&1

step profile-reference 150 "$PY" -m parity profile --subject decoder "${SIZE[@]}" --impl reference --device "$DEVICE" \
    "${PROFILE_ARGS[@]}" --quiet --json "$R/profile-reference.json" --html "$R/profile-reference.html"
step profile-triton 150 "$PY" -m parity profile --subject decoder "${SIZE[@]}" --impl triton --device "$DEVICE" \
    "${PROFILE_ARGS[@]}" --quiet --against "$R/profile-reference.json" --json "$R/profile-triton.json" \
    --html "$R/profile-triton.html" --trace "$R/trace-triton.json"
BUNDLES=$(mktemp -d)
step capture 150 "$PY" -m parity capture --subject decoder "${SIZE[@]}" --impl reference --device "$DEVICE" \
    --layers '<root>' --reference fp32 --no-fsync --quiet --bundle "$BUNDLES/decoder"
step bench 150 "$PY" -m parity bench --bundle "$BUNDLES/decoder" --impls reference,triton --device "$DEVICE" \
    --module 'layers.*.attn.core' "${BENCH_ARGS[@]}" --quiet --json "$R/bench.json" --html "$R/bench.html"
step capture-wrong 150 "$PY" -m parity capture --subject speed_subjects:make_decoder "${SIZE[@]}" --impl reference \
    --device "$DEVICE" --layers '<root>' --reference fp32 --no-fsync --quiet --bundle "$BUNDLES/decoder-wrong"
step bench-wrong 150 "$PY" -m parity bench --bundle "$BUNDLES/decoder-wrong" --subject speed_subjects:make_decoder \
    --impls reference,triton,skip_attention --device "$DEVICE" --module 'layers.*.attn.core' "${BENCH_ARGS[@]}" \
    --quiet --json "$R/bench-wrong.json" --html "$R/bench-wrong.html"
rm -rf "$BUNDLES"
tar czf "$OUT/story.tgz" -C "$(dirname "$R")" story
cat "$R/status.txt"
