#!/usr/bin/env bash
# GPU tests, the accuracy suite and the benchmark on the device, results under $OUT (or ./gpu_out).
# usage: bash benchmarks/run_gpu.sh [smoke|sweep|tests|bench|full]
#   tests: sanitizer, robustness / custom-op / helper tests, the GPU accuracy grids, the case suite
#   bench: a config sweep on two cases, the official-grid benchmark with Z on and off (JSON + PNG)
#   full:  tests then bench (more than one 10-minute device call: run tests and bench separately)
# Each step has its own time limit so that one slow step cannot eat the device budget, and logs go to
# stdout where they can: at most 8 files come back from a device call.  MAMBA3_COMMIT names the commit
# measured (the device's copy of the tree may carry a stale .git).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
mode="${1:-full}"
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
echo "commit ${MAMBA3_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} $(date -u +%FT%TZ)" | tee -a "$OUT/gpu.txt"
case "$mode" in
  smoke)
    python3 benchmarks/smoke_gpu.py 2>&1 | tee "$OUT/smoke.log" || status=1
    ;;
  sweep)
    python3 -m mamba3_mimo.bench --cases ${CASES:-quick} --impl production --sweep ${KNOBS:+--knobs $KNOBS} \
      --input-sets 2 --json "$OUT/sweep.json" 2>&1 | grep -v '^    ' || status=1
    ;;
  tests|full)
    # Most important first.  (pytest -k applies to every file given, so the kernel grids get their own run.)
    OUT="$(mktemp -d)" timeout 150 bash benchmarks/sanitize.sh 2>&1 | tail -n 40 | tee "$OUT/sanitize.log" || status=1
    timeout 160 python3 -m pytest -q -p no:warnings -rs tests/test_robustness.py tests/test_custom_op.py \
      tests/test_triton_utils.py 2>&1 | tail -n 30 | tee "$OUT/tests_robustness.log" || status=1
    timeout 240 python3 -m pytest -q -p no:warnings tests/test_kernels.py -k "gpu or official or local_states" 2>&1 \
      | tail -n 20 | tee "$OUT/tests_kernels.log" || status=1
    timeout 180 python3 -m mamba3_mimo.cases --device cuda --impl all --size all --json "$OUT/cases.json" 2>&1 \
      | tail -n 5 | tee "$OUT/cases.log" || status=1
    ;;&
  bench|full)
    timeout 120 python3 -m mamba3_mimo.bench --cases N128_P64_R4_C16 N16_P64_R4_C8 --impl production --sweep \
      --input-sets 2 --json "$OUT/sweep.json" 2>&1 | tail -n 45 || status=1
    timeout 230 python3 -m mamba3_mimo.bench --breakdown --json "$OUT/bwd_fwd_h200.json" --png "$OUT/bwd_fwd_h200.png" \
      2>&1 || status=1
    timeout 200 python3 -m mamba3_mimo.bench --no-z --json "$OUT/bwd_fwd_h200_noz.json" \
      --png "$OUT/bwd_fwd_h200_noz.png" 2>&1 || status=1
    ;;
esac
exit $status
