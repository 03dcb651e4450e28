#!/usr/bin/env bash
# One device call for the Gluon scan at N = 64 (twenty-fifth session): its own GPU tests, the official N = 64 shapes
# and the fp32 cases the token-table change touches, a sweep of the segment count with and without the Gluon scan on
# the two N = 64 shapes, then the official benchmark (Z on, production).  ~300-450 s.
# usage: MAMBA3_COMMIT=<sha> bash benchmarks/gpu_check_n64.sh   (results under $OUT, or ./gpu_out)
set -uo pipefail
source "$(dirname "$0")/gpu_preamble.sh"
MAMBA3_MIMO_CHECK_PLAN=1 timeout 150 python3 -m pytest -q -p no:warnings -rf tests/test_gluon_state_scan.py 2>&1 \
  | tail -n 8 | tee "$OUT/tests.log"
MAMBA3_MIMO_CHECK_PLAN=1 MAMBA3_MIMO_FULL_GRID=1 timeout 100 python3 -m pytest -q -p no:warnings -rf tests/test_kernels.py \
  tests/test_stage_kernels.py -k "(test_official_grid and not fused and N64) or (half_rotation and dtype2) or \
  token_tables" 2>&1 | tail -n 8 | tee -a "$OUT/tests.log"
CASES="N64_P128_R4_C16 N64_P64_R4_C16" KNOBS="gluon_scan,n_segments" CASE_TIMEOUT=55 OUT="$OUT/sweep" \
  bash benchmarks/sweep_cases.sh 2>&1 | tee "$OUT/sweep.log"
timeout ${BENCH_TIMEOUT:-90} python3 -m mamba3_mimo.bench --impl production --json "$OUT/bwd_fwd_h200.json" \
  --png "$OUT/bwd_fwd_h200.png" 2>&1 | tail -n 16
