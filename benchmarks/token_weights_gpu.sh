#!/usr/bin/env bash
# The token weights on the GPU (docs/optimization.md sections 58-59): the fused pass's
# (`scan_outputs_token_weights`) and chunk_scan's (`out_token_weights`), both off in the dispatcher until timed; and
# chunk_scan's scores weighed before its v / Psi loads (`out_early_mixing`, a ScanConfig knob only).
# usage: MAMBA3_COMMIT=<sha> PART=sweep bash benchmarks/token_weights_gpu.sh          (~300-400 s on a fresh GPU)
#        MAMBA3_COMMIT=<sha> PART=official SCAN_TW=True OUT_TW=True bash benchmarks/token_weights_gpu.sh
# PART=sweep: the knobs' GPU contract tests, then each knob off -> on in one run (with Z and without) on the shapes
# that take its kernel.  PART=official: the dispatcher flags set as SCAN_TW / OUT_TW say (in this copy of the tree
# only: commit the winner's flags), the official-grid tests of the production path and the official benchmark
# (production, Z on and off) into $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
status=0
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
  echo "commit ${MAMBA3_COMMIT:-unknown} $(date -u +%FT%TZ)"; } | tee "$OUT/gpu.txt"
FUSED="N128_P64_R4_C16 N64_P64_R4_C16 N128_P32_R4_C16 N64_P128_R4_C16 N128_P64_R8_C8 N128_P64_R2_C32"
CHUNK_SCAN="N16_P64_R4_C8 N32_P64_R4_C16 N256_P64_R4_C8 N128_P128_R4_C8"
case "${PART:-sweep}" in
sweep)
  MAMBA3_MIMO_CHECK_PLAN=1 timeout 150 python3 -m pytest -q -p no:warnings -rf tests/test_gluon_scan_outputs.py \
    -k "token and reference" 2>&1 | tail -n 6 | tee "$OUT/token_tests.log" || status=1
  MAMBA3_MIMO_CHECK_PLAN=1 timeout 60 python3 -m pytest -q -p no:warnings -rf tests/test_kernels.py \
    -k test_production_token_weights 2>&1 | tail -n 4 | tee -a "$OUT/token_tests.log" || status=1
  for z in "" "--no-z"; do
    suffix=${z:+_noz}
    timeout 110 python3 -m mamba3_mimo.bench $z --sweep --knobs scan_outputs_token_weights=0:1 --impl production \
      --breakdown --cases $FUSED --json "$OUT/sweep_fused$suffix.json" > "$OUT/sweep_fused$suffix.log" 2>&1 || status=1
    timeout 80 python3 -m mamba3_mimo.bench $z --sweep --knobs out_token_weights=0:1 --impl production \
      --breakdown --cases $CHUNK_SCAN --json "$OUT/sweep_chunk_scan$suffix.json" > "$OUT/sweep_chunk_scan$suffix.log" \
      2>&1 || status=1
    # The scores weighed before the v / Psi loads (out_early_mixing): less spill at R1_C64 and N16 without Z.
    timeout 60 python3 -m mamba3_mimo.bench $z --sweep --knobs out_early_mixing=0:1 --impl production \
      --breakdown --cases N128_P64_R1_C64 N16_P64_R4_C8 --json "$OUT/sweep_early_mixing$suffix.json" \
      > "$OUT/sweep_early_mixing$suffix.log" 2>&1 || status=1
  done
  tail -n 5 "$OUT"/sweep_*.log ;;
official)
  sed -i "s/^SCAN_OUTPUTS_TOKEN_WEIGHTS = False/SCAN_OUTPUTS_TOKEN_WEIGHTS = ${SCAN_TW:-False}/;
          s/^OUT_TOKEN_WEIGHTS = False/OUT_TOKEN_WEIGHTS = ${OUT_TW:-False}/" mamba3_mimo/ops/production.py
  grep -n "^SCAN_OUTPUTS_TOKEN_WEIGHTS\|^OUT_TOKEN_WEIGHTS" mamba3_mimo/ops/production.py | tee "$OUT/flags.txt"
  MAMBA3_MIMO_CHECK_PLAN=1 MAMBA3_MIMO_FULL_GRID=1 timeout 150 python3 -m pytest -q -p no:warnings -rf \
    tests/test_kernels.py -k "scan_outputs or (official_grid and production)" 2>&1 | tail -n 8 | tee "$OUT/official_tests.log" || status=1
  PARTS="bench noz" BENCH_IMPL=production BENCH_TIMEOUT=200 NOZ_TIMEOUT=130 bash benchmarks/final_gpu.sh \
    > "$OUT/bench.log" 2>&1 || status=1
  tail -n 34 "$OUT/bench.log" ;;
*) echo "PART must be sweep or official" >&2; exit 2 ;;
esac
exit $status
