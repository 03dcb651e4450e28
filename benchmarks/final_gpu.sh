#!/usr/bin/env bash
# The end-of-session GPU run: the GPU tests of the production path on the official grid, the
# split output stage and small configs of the fused one, the GPU pairwise / tail / rank grids (dtypes, Z, D,
# groups: every launch specialization the cached launcher keys on), the stage / launch / API / robustness tests, the
# sanitizer's split cases (memcheck), then the official benchmark with Z on (production and stage0) and Z off.
# usage: MAMBA3_COMMIT=<sha> [PARTS="tests grids unit sanitize bench noz"] [BENCH_IMPL=production,stage0] \
#        bash benchmarks/final_gpu.sh     (results under $OUT, or ./gpu_out)
# All parts take ~550-650 s, more than fits one device call with its start (at 729e88c: tests 190 s with the Z-off
# grid, grids 140, unit 75, sanitize 20, bench + noz 110; at 8ebfff3 tests 219 s and the grids over 150 s with a cold
# compile cache, 10 s warm): run them in two calls, PARTS="tests grids" then PARTS="unit sanitize bench noz";
# PARTS picks a subset (most important first), BENCH_IMPL=production skips stage0 in the Z-on benchmark.
# A fresh H100 compiles slower: at b1e0668 the tests part ran 102 of its ~116 tests in 300 s and unit 509 of ~564 in
# 150 s, and memcheck printed nothing in 90 s (2026-12-05_h100_tests_b1e0668.log); there, run three calls: "tests",
# "grids unit", "sanitize bench noz" (the timeouts below fit each in 600 s).
# Each test part keeps its whole output in $OUT/<part>_full.log: the tails cut the failures' tables.
set -uo pipefail
source "$(dirname "$0")/gpu_preamble.sh"
PARTS="${PARTS:-tests grids unit sanitize bench noz}"
# The tests run every call's wrappers and check its launches against its launch plan (ops/launch.py); the
# replay itself runs in tests/test_launch.py, the sanitizer's driver and the benchmark.
export MAMBA3_MIMO_CHECK_PLAN=1
want tests && { MAMBA3_MIMO_FULL_GRID=1 timeout ${TESTS_TIMEOUT:-560} python3 -m pytest -q -p no:warnings -rf \
  tests/test_kernels.py -k "(test_official_grid and not fused) or test_production_split_gate or \
  test_production_configs or test_production_local_states or half_rotation or miscompiled or two_pass_scan_segments or \
  pdl or fold_one_scan or scan_outputs_64 or scan_outputs_without_z or scan_outputs_gate or scan_outputs_n64 or scan_outputs_d_skip" \
  2>&1 \
  | tee "$OUT/tests_full.log" | tail -n 6 | tee "$OUT/tests.log" || status=1; }
want grids && { timeout ${GRIDS_TIMEOUT:-240} python3 -m pytest -q -p no:warnings -rf tests/test_kernels.py \
  -k "gpu_pairwise or gpu_tail or gpu_rank or gpu_inner" 2>&1 | tee "$OUT/grids_full.log" | tail -n 6 | tee -a "$OUT/tests.log" \
  || status=1; }
want unit && { timeout ${UNIT_TIMEOUT:-240} python3 -m pytest -q -p no:warnings -rf tests/test_launch.py \
  tests/test_stage_kernels.py tests/test_api_errors.py tests/test_robustness.py tests/test_triton_utils.py 2>&1 \
  | tee "$OUT/unit_full.log" | tail -n 8 | tee -a "$OUT/tests.log" || status=1; }
want sanitize && { MAMBA3_MIMO_CHECK_PLAN=0 SANITIZE_CASES=split OUT=/tmp/mamba3_sanitize timeout ${SANITIZE_TIMEOUT:-150} \
  bash benchmarks/sanitize.sh memcheck 2>&1 | tail -n 12 | tee "$OUT/sanitize.log" || status=1; }
want bench && { MAMBA3_MIMO_CHECK_PLAN=0 timeout ${BENCH_TIMEOUT:-250} python3 -m mamba3_mimo.bench --impl "${BENCH_IMPL:-production,stage0}" \
  --json "$OUT/bwd_fwd_h200.json" --png "$OUT/bwd_fwd_h200.png" 2>&1 | tail -n 17 || status=1; }
want noz && { MAMBA3_MIMO_CHECK_PLAN=0 timeout ${NOZ_TIMEOUT:-130} python3 -m mamba3_mimo.bench --no-z --impl production \
  --json "$OUT/bwd_fwd_h200_noz.json" --png "$OUT/bwd_fwd_h200_noz.png" 2>&1 | tail -n 15 || status=1; }
exit $status
