#!/usr/bin/env bash
# One device call: GPU tests, the accuracy suite and the benchmark, results under $OUT (or ./gpu_out).
# usage: bash benchmarks/run_gpu.sh [smoke|sweep|full]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
mode="${1:-full}"
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) $(date -u +%FT%TZ)" | tee -a "$OUT/gpu.txt"
case "$mode" in
  smoke)
    python3 benchmarks/smoke_gpu.py 2>&1 | tee "$OUT/smoke.log" || status=1
    ;;
  sweep)
    python3 benchmarks/smoke_gpu.py 2>&1 | tee "$OUT/smoke.log" || status=1
    python3 -m mamba3_mimo.bench --cases ${CASES:-quick} --impl stage0 --sweep \
      --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log" || status=1
    ;;
  full)
    python3 -m pytest -q -x tests 2>&1 | tee "$OUT/tests.log" || status=1
    python3 -m mamba3_mimo.cases --device cuda --impl all --size all --json "$OUT/cases.json" 2>&1 \
      | tail -n 40 | tee "$OUT/cases.log" || status=1
    python3 -m mamba3_mimo.bench --json "$OUT/bwd_fwd_h200.json" --png "$OUT/bwd_fwd_h200.png" 2>&1 \
      | tee "$OUT/bench.log" || status=1
    python3 -m mamba3_mimo.bench --no-z --impl production,stage0 --json "$OUT/bwd_fwd_h200_noz.json" \
      --png "$OUT/bwd_fwd_h200_noz.png" 2>&1 | tee "$OUT/bench_noz.log" || status=1
    ;;
esac
exit $status
