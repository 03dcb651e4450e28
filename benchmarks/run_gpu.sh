#!/usr/bin/env bash
# One device call: GPU tests, the accuracy suite and the benchmark, results under $OUT (or ./gpu_out).
# At most 8 files come back from a device call, so logs go to stdout where they can.
# usage: bash benchmarks/run_gpu.sh [triage|probe|smoke|sweep|tests|bench|full|final]
# (tests and bench each fit one 10-minute device call; full is both)
# Every step has its own time limit so that one slow step cannot eat the device budget.
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
  triage)
    # Helpers alone first (a compiler fault shows here), then composed kernels, then the sanitizer.
    timeout 150 python3 -m pytest -q -p no:warnings tests/test_triton_utils.py 2>&1 | tee "$OUT/helpers.log" || status=1
    timeout 150 python3 benchmarks/smoke_gpu.py 2>&1 | tee "$OUT/smoke.log" || status=1
    timeout 200 python3 -m mamba3_mimo.cases --device cuda --impl all --size gpu --json "$OUT/cases.json" 2>&1 \
      | tail -n 30 | tee "$OUT/cases.log" || status=1
    OUT="$(mktemp -d)" timeout 120 bash benchmarks/sanitize.sh 2>&1 | tail -n 40 | tee "$OUT/sanitize.log" || status=1
    ;;
  probe)
    # New kernels first: accuracy smoke, the official grid with a per-kernel breakdown, the sanitizer.
    timeout 150 python3 benchmarks/smoke_gpu.py 2>&1 | tee "$OUT/smoke.log" || status=1
    timeout 240 python3 -m mamba3_mimo.bench --breakdown --json "$OUT/probe.json" 2>&1 | tee "$OUT/probe.log" || status=1
    OUT="$(mktemp -d)" timeout 150 bash benchmarks/sanitize.sh 2>&1 | tail -n 40 | tee "$OUT/sanitize.log" || status=1
    ;;
  smoke)
    python3 benchmarks/smoke_gpu.py 2>&1 | tee "$OUT/smoke.log" || status=1
    ;;
  sweep)
    python3 benchmarks/smoke_gpu.py 2>&1 | tee "$OUT/smoke.log" || status=1
    python3 -m mamba3_mimo.bench --cases ${CASES:-quick} --impl production --sweep \
      --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log" || status=1
    ;;
  final)
    # The evidence in one call, most important first: sanitizer, robustness / custom-op tests,
    # the GPU accuracy grids, the case suite.  (pytest -k applies to every file given, so the
    # kernel grids get their own run.)
    OUT="$(mktemp -d)" timeout 80 bash benchmarks/sanitize.sh 2>&1 | tail -n 40 | tee "$OUT/sanitize.log" || status=1
    timeout 160 python3 -m pytest -q -p no:warnings -rs tests/test_robustness.py tests/test_custom_op.py \
      tests/test_triton_utils.py 2>&1 | tail -n 30 | tee "$OUT/tests_robustness.log" || status=1
    timeout 130 python3 -m pytest -q -p no:warnings tests/test_kernels.py -k "gpu or official" 2>&1 \
      | tail -n 20 | tee "$OUT/tests_kernels.log" || status=1
    timeout 90 python3 -m mamba3_mimo.cases --device cuda --impl all --size all --json "$OUT/cases.json" 2>&1 \
      | tail -n 5 | tee "$OUT/cases.log" || status=1
    ;;
  tests|full)
    # The GPU-only tests (the CPU-sized ones run in CI); the case suite through its CLI; the sanitizer.
    timeout 160 python3 -m pytest -q -p no:warnings tests/test_kernels.py -k "gpu or official" 2>&1 \
      | tail -n 20 | tee "$OUT/tests.log" || status=1
    timeout 160 python3 -m pytest -q -p no:warnings -rs tests/test_robustness.py tests/test_custom_op.py \
      tests/test_triton_utils.py 2>&1 | tail -n 30 | tee -a "$OUT/tests.log" || status=1
    timeout 130 python3 -m mamba3_mimo.cases --device cuda --impl all --size all --json "$OUT/cases.json" 2>&1 \
      | tail -n 40 | tee "$OUT/cases.log" || status=1
    OUT="$(mktemp -d)" timeout 100 bash benchmarks/sanitize.sh 2>&1 | tail -n 40 | tee "$OUT/sanitize.log" || status=1
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
