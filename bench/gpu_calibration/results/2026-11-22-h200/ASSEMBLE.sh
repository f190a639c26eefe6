#!/bin/sh
# Rebuilds src/gpufleet/perf/data/measured/h200-forward.json from the raw JSON-lines of the
# 2026-11-22 H200 call (CUDA-graph decode and prefill only: --no-eager).
cd "$(dirname "$0")/../.." || exit 1
R=results/2026-11-22-h200
python3 calibrate.py --assemble $R/h200-8b.jsonl $R/h200-70b-8L.jsonl \
  --out ../../src/gpufleet/perf/data/measured/h200-forward.json
