#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and initcheck over tiny calls of every bwd_fwd kernel
# (benchmarks/sanitize_driver.py: both impls, Z on/off, a tail, several P tiles and segments).
# Logs go to $OUT (or ./gpu_out/sanitize, git-ignored). Exit status 0 only if every tool reports no error.
# usage: bash benchmarks/sanitize.sh [tool ...]      (default: memcheck racecheck initcheck)
#        SANITIZE_CASES="split" bash benchmarks/sanitize.sh memcheck   (only the driver cases named so)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# One cudaMalloc per tensor: with PyTorch's caching allocator an out-of-bounds access that stays
# inside a cached block is invisible to memcheck, and initcheck would see stale block contents.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
OUT="${OUT:-$PWD/gpu_out/sanitize}"
mkdir -p "$OUT"
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck initcheck)

SANITIZER="$(command -v compute-sanitizer || true)"
[ -z "$SANITIZER" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && SANITIZER=/usr/local/cuda/bin/compute-sanitizer
if [ -z "$SANITIZER" ]; then
  echo "sanitize: compute-sanitizer not found on PATH or in /usr/local/cuda/bin" | tee "$OUT/sanitize_summary.txt"
  exit 2
fi

# Plain run first: compiles every kernel into Triton's cache and checks the driver itself.
echo "== driver without sanitizer"
python3 benchmarks/sanitize_driver.py ${SANITIZE_CASES:-} 2>&1 | tee "$OUT/sanitize_plain.log"
plain=${PIPESTATUS[0]}
if [ "$plain" -eq 2 ]; then
  echo "sanitize: no CUDA device, nothing to check" | tee "$OUT/sanitize_summary.txt"
  exit 2
fi

declare -A result
status=$plain
for tool in "${tools[@]}"; do
  log="$OUT/sanitize_$tool.log"
  extra=()
  [ "$tool" = racecheck ] && extra=(--racecheck-report all)
  echo "== compute-sanitizer --tool $tool (log: $log)"
  start=$SECONDS
  # API errors are left to the driver (a failed launch raises there); PyTorch's own benign
  # API return codes would otherwise count as sanitizer errors.
  "$SANITIZER" --tool "$tool" ${extra[@]+"${extra[@]}"} --report-api-errors no --error-exitcode 99 \
    --print-limit 100 --log-file "$log" \
    python3 benchmarks/sanitize_driver.py ${SANITIZE_CASES:-} > "$OUT/sanitize_${tool}_stdout.log" 2>&1
  rc=$?
  summary="$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 2 | sed 's/^=* *//' | tr '\n' ' ')"
  if [ $rc -eq 0 ]; then
    result[$tool]="clean    ${summary:-no summary line} ($((SECONDS - start)) s)"
  elif [ $rc -eq 99 ]; then
    result[$tool]="ERRORS   ${summary:-see log} ($((SECONDS - start)) s)"
    status=1
  else
    result[$tool]="FAILED   driver exit $rc, ${summary:-see $OUT/sanitize_${tool}_stdout.log} ($((SECONDS - start)) s)"
    status=1
  fi
  tail -n 3 "$OUT/sanitize_${tool}_stdout.log"
  if [ $rc -ne 0 ]; then  # which kernels, and the first report
    grep -oE '(in|kernel) _[A-Za-z0-9_]*kernel' "$log" | sort | uniq -c | head -n 5
    grep -m 1 -A 6 -E 'Error|Race|Hazard|hazard' "$log" | cut -c 1-200
  fi
done

{
  echo "sanitize summary ($("$SANITIZER" --version | grep -m1 -o 'Version [^ ]*' || echo 'unknown version'))"
  echo "  driver     $([ "$plain" -eq 0 ] && echo ok || echo "FAILED (exit $plain)")"
  for tool in "${tools[@]}"; do
    printf '  %-10s %s\n' "$tool" "${result[$tool]}"
  done
  echo "overall: $([ $status -eq 0 ] && echo CLEAN || echo 'NOT CLEAN')"
} | tee "$OUT/sanitize_summary.txt"
exit $status
