#!/usr/bin/env bash
# Regenerate the committed NVIDIA goldens. Run from the repository root on an NVIDIA GPU host
# with this package installed (pip install -e .); see golden/README.md for what each holds.
set -euo pipefail
PY=${PYTHON:-python3}
OUTDIR=${1:-golden}
# The original implementation on NVIDIA: PyTorch's CUDA kernels (the dense reference), with
# the inputs drawn on the CPU and stored. The attention cases carry an fp64 CPU reference of
# every output; the decoder an fp32 one computed on the GPU (keeps the bundle small).
"$PY" -m parity capture --subject attention --out "$OUTDIR/h200-attention" \
    --impl reference --device cuda --reference fp64 --force --quiet
"$PY" -m parity capture --subject decoder --out "$OUTDIR/h200-decoder" \
    --impl reference --device cuda --reference fp32 --record-inputs --force --quiet \
    --layers 'embed' 'layers.*.attn.core' 'layers.*.attn' 'layers.*.mlp' 'layers.?' 'norm' 'lm_head'
# The cross-host fuzz corpus (150 cases, every dtype and layout kind, odd lengths; < 20 MB).
"$PY" -m parity capture --subject attention --out "$OUTDIR/h200-fuzz" --fuzz 150 --fuzz-seed 2026 \
    --fuzz-bounds corpus --impl reference --device cuda --reference fp64 --force --quiet
