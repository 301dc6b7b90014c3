#!/usr/bin/env bash
# One device call for the cross-host verdict checks of issue 10 (run on the H200 through the
# workplace's device tool, from the repository root; everything lands under $OUT):
#   1. install this checkout (no dependencies: the host's torch and Triton are the ones used);
#   2. capture the H200 fuzz corpus that is committed as golden/h200-fuzz (reference impl on
#      CUDA, fp64 CPU reference, 150 cases of the `corpus` bounds, seed 2026);
#   3. compare a CPU-captured corpus (drawn with another seed, carried in .devrun/cpu-fuzz) with
#      the compiled Triton kernel under the default rule: it must hold;
#   4. the same host: the H200 corpus compared with the compiled kernel (a sanity check), and the
#      committed goldens under the default rule.
# Each step has a time limit; the output of all of them goes to $OUT/run.log (the device tool
# brings back at most 8 files) and status.txt has every step's exit code.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name" >>"$OUT/run.log"
    timeout "$limit" "$@" >>"$OUT/run.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/status.txt"
}

step install 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
"$PY" -c 'import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)' >>"$OUT/status.txt" 2>&1
step capture-h200-fuzz 240 "$PY" -m parity capture --subject attention --fuzz 150 --fuzz-seed 2026 \
    --fuzz-bounds corpus --impl reference --device cuda --reference fp64 --out "$OUT/h200-fuzz" --quiet
step compare-cpu-fuzz 240 "$PY" -m parity compare --golden .devrun/cpu-fuzz --impl triton --device cuda \
    --quiet --json "$OUT/compare-cpu-fuzz.json"
step compare-h200-fuzz 240 "$PY" -m parity compare --golden "$OUT/h200-fuzz" --impl triton --device cuda \
    --quiet --json "$OUT/compare-h200-fuzz.json"
step compare-goldens 120 sh -c "'$PY' -m parity compare --golden golden/h200-attention --impl triton --device cuda --quiet \
    && '$PY' -m parity compare --golden golden/h200-decoder --impl triton --device cuda --isolate --quiet"
cat "$OUT/status.txt"
