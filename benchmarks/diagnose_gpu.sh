#!/usr/bin/env bash
# Device diagnosis in one call: where stage0 faults (warps, memcheck), which kernel racecheck
# flags, and a sweep of production configs on two official cases.  Results in $OUT/diag.log and
# $OUT/sweep.{log,json}.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
{
  for spec in "stage0 8 1,256,2,128,32,4,16 bf16" "stage0 4 1,256,2,128,32,4,16 bf16" \
              "stage0 8 1,512,4,128,64,1,64 fp32" "stage0 4 1,512,4,128,64,1,64 fp32"; do
    set -- $spec
    echo "== $spec"
    timeout 60 python3 benchmarks/diagnose_case.py --impl "$1" --warps "$2" --shape "$3" --dtype "$4" 2>&1 | tail -2
  done
  echo "== memcheck stage0 8 warps N128_P32"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 90 "$SAN" --tool memcheck --print-limit 2 \
    python3 benchmarks/diagnose_case.py --impl stage0 --warps 8 2>&1 | grep -v "Host Frame" | head -30
  echo "== racecheck production"
  timeout 60 "$SAN" --tool racecheck --print-limit 4 \
    python3 benchmarks/diagnose_case.py --impl production --shape 1,40,2,32,32,2,16 --dtype fp32 2>&1 \
    | grep -v "Host Frame" | head -40
} > "$OUT/diag.log" 2>&1
timeout 200 python3 -m mamba3_mimo.bench --cases N128_P64_R4_C16 N16_P64_R4_C8 --impl production --sweep \
  --input-sets 2 --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
tail -n 45 "$OUT/sweep.log"
