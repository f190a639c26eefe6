#!/bin/sh
# Rebuilds src/gpufleet/perf/data/measured/h100-sxm-forward.json from the raw JSON-lines of the
# 2026-11-22 H100 session. r1-* were the first full call; its 70B-8L and 7B decode/prefill rows
# used reduced grids and are kept as repeats (r2-* re-measured those models on the full grids).
# r4-8b-mixed (a later call the same day) holds the mixed prefill + decode steps and the decode
# batches with unequal contexts (document lists "mixed" and "decode_nonuniform").
cd "$(dirname "$0")/../.." || exit 1
R=results/2026-11-22-h100
python3 calibrate.py --assemble \
  $R/r1-llama3.1-8b.jsonl \
  $R/r2-8b-repeat.jsonl \
  "$R/r1-llama3.1-70b-8L.jsonl@repeat:decode+prefill" \
  "$R/r1-llama2-7b.jsonl@repeat:decode+prefill" \
  $R/r2-70b-8L.jsonl $R/r2-7b.jsonl $R/r2-70b-4L.jsonl $R/r2-8b-16L.jsonl \
  $R/r3-attn-llama3.1-8b.jsonl $R/r3-attn-llama3.1-70b-8L.jsonl $R/r3-attn-llama2-7b.jsonl \
  $R/r3-8b-midB.jsonl \
  $R/r4-8b-mixed.jsonl \
  --out ../../src/gpufleet/perf/data/measured/h100-sxm-forward.json
