#!/usr/bin/env bash
# The fused storing scan's GPU run (mamba3_mimo/ops/gluon_scan_outputs.py, docs/optimization.md section 51): its
# tests (the accuracy contract with the knob on, the call without it), then the sweep of ``scan_outputs`` on the
# official shapes it covers, with each kernel's time.
# usage: MAMBA3_COMMIT=<sha> [PARTS="tests sweep"] [CASES="..."] bash benchmarks/scan_outputs_gpu.sh
#        (results under $OUT, or ./gpu_out)
set -uo pipefail
source "$(dirname "$0")/gpu_preamble.sh"
PARTS="${PARTS:-tests sweep}"
CASES="${CASES:-N128_P64_R4_C16 N128_P32_R4_C16 N128_P64_R8_C8 N128_P64_R2_C32}"
want tests && { MAMBA3_MIMO_CHECK_PLAN=1 timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:warnings -rf \
  tests/test_gluon_scan_outputs.py 2>&1 | tee "$OUT/scan_outputs_tests_full.log" | tail -n 12 || status=1; }
# shellcheck disable=SC2086  # CASES is a list
want sweep && { MAMBA3_MIMO_CHECK_PLAN=0 timeout ${SWEEP_TIMEOUT:-240} python3 -m mamba3_mimo.bench --sweep \
  --knobs "${KNOBS:-scan_outputs=1+gluon_segments=0:2:4:8}" --impl production --breakdown --cases $CASES --json "$OUT/sweep_scan_outputs.json" 2>&1 \
  | tail -n 40 || status=1; }
exit $status
