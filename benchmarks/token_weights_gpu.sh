#!/usr/bin/env bash
# The token weights on the GPU (docs/optimization.md sections 58-59): the fused pass's
# (`scan_outputs_token_weights`) and chunk_scan's (`out_token_weights`), and chunk_scan's scores weighed before its
# v / Psi loads (`out_early_mixing`).
# usage: MAMBA3_COMMIT=<sha> PART=sweep bash benchmarks/token_weights_gpu.sh          (~250 s on a fresh H100)
#        MAMBA3_COMMIT=<sha> PART="fused official mixing" SCAN_TW=auto bash benchmarks/token_weights_gpu.sh
# PART=sweep: the knobs' GPU contract tests, then each knob off -> on in one run (with Z and without) on the shapes
# that take its kernel.  fused / mixing: only the fused pass's sweep / early mixing over the chunk_scan shapes
# without Z (token weights as the dispatcher takes them).  official: the dispatcher flags set as SCAN_TW / OUT_TW say
# (in this copy of the tree only: commit the winner's flags; SCAN_TW=auto takes the fused pass's token weights when
# the fused sweep has them faster, geomean of graph times with Z and without, by 1% or more), the official-grid tests
# of the production path and the official benchmark (production, Z on and off) into $OUT.  Logs and sweeps are
# packed into $OUT/aux.tar (the device returns few files).
set -uo pipefail
source "$(dirname "$0")/gpu_preamble.sh"
verdict=""
FUSED="N128_P64_R4_C16 N64_P64_R4_C16 N128_P32_R4_C16 N64_P128_R4_C16 N128_P64_R8_C8 N128_P64_R2_C32"
CHUNK_SCAN="N16_P64_R4_C8 N32_P64_R4_C16 N256_P64_R4_C8 N128_P128_R4_C8"
fused_sweeps() {
  for z in "" "--no-z"; do
    suffix=${z:+_noz}
    timeout 110 python3 -m mamba3_mimo.bench $z --sweep --knobs scan_outputs_token_weights=0:1 --impl production \
      --breakdown --cases $FUSED --json "$OUT/sweep_fused$suffix.json" > "$OUT/sweep_fused$suffix.log" 2>&1 || status=1
  done
}
# SCAN_TW=auto: True where the fused sweeps (with Z and without) have the token weights 1% faster in geomean.
fused_verdict() {
  python3 - "$OUT"/sweep_fused.json "$OUT"/sweep_fused_noz.json <<'PY'
import json, math, sys
ratios = []
for path in sys.argv[1:]:
    times = {}
    for record in json.load(open(path))["records"]:
        times.setdefault(record["case"], {})[record["config"]["scan_outputs_token_weights"]] = record["graph_ms"]
    ratios += [pair[True] / pair[False] for pair in times.values() if len(pair) == 2]
geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else 1.0
print("True" if ratios and geomean < 0.99 else "False", f"# fused on/off geomean {geomean:.4f} over {len(ratios)}")
PY
}
# After each part, so that what a call killed at its time limit had finished still comes back.
pack() {
  local aux
  aux=$(cd "$OUT" && ls *.log *.txt sweep_*.json 2>/dev/null)
  [ -n "$aux" ] && (cd "$OUT" && tar -rf aux.tar $aux && rm -f $aux)
}
for part in ${PART:-sweep}; do
case "$part" in
fused)
  fused_sweeps; tail -n 3 "$OUT"/sweep_fused*.log
  verdict=$(fused_verdict); echo "$verdict" | tee "$OUT/verdict.txt" ;;
mixing)
  timeout 80 python3 -m mamba3_mimo.bench --no-z --sweep --knobs out_early_mixing=0:1 --impl production \
    --breakdown --cases $CHUNK_SCAN --json "$OUT/sweep_early_mixing_tw_noz.json" \
    > "$OUT/sweep_early_mixing_tw_noz.log" 2>&1 || status=1
  tail -n 3 "$OUT/sweep_early_mixing_tw_noz.log" ;;
sweep)
  MAMBA3_MIMO_CHECK_PLAN=1 timeout 150 python3 -m pytest -q -p no:warnings -rf tests/test_gluon_scan_outputs.py \
    -k "token and reference" 2>&1 | tail -n 6 | tee "$OUT/token_tests.log" || status=1
  MAMBA3_MIMO_CHECK_PLAN=1 timeout 60 python3 -m pytest -q -p no:warnings -rf tests/test_kernels.py \
    -k test_production_token_weights 2>&1 | tail -n 4 | tee -a "$OUT/token_tests.log" || status=1
  fused_sweeps
  for z in "" "--no-z"; do
    suffix=${z:+_noz}
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
  scan_tw=${SCAN_TW:-}
  # auto: the verdict of this call's fused part (its sweeps are packed by now).
  [ "$scan_tw" = auto ] && scan_tw=${verdict%% *}
  flags=mamba3_mimo/ops/production.py
  [ -n "$scan_tw" ] && sed -i "s/^SCAN_OUTPUTS_TOKEN_WEIGHTS = .*/SCAN_OUTPUTS_TOKEN_WEIGHTS = $scan_tw/" $flags
  [ -n "${OUT_TW:-}" ] && sed -i "s/^OUT_TOKEN_WEIGHTS = .*/OUT_TOKEN_WEIGHTS = $OUT_TW/" $flags
  grep -n "^SCAN_OUTPUTS_TOKEN_WEIGHTS\|^OUT_TOKEN_WEIGHTS" $flags | tee "$OUT/flags.txt"
  MAMBA3_MIMO_CHECK_PLAN=1 MAMBA3_MIMO_FULL_GRID=1 timeout 150 python3 -m pytest -q -p no:warnings -rf \
    tests/test_kernels.py -k "scan_outputs or (official_grid and production)" 2>&1 | tail -n 8 \
    | tee "$OUT/official_tests.log" || status=1
  PARTS="bench noz" BENCH_IMPL=production BENCH_TIMEOUT=200 NOZ_TIMEOUT=130 bash benchmarks/final_gpu.sh \
    > "$OUT/bench.log" 2>&1 || status=1
  tail -n 34 "$OUT/bench.log" ;;
*) echo "PART takes sweep, fused, mixing, official" >&2; exit 2 ;;
esac
pack
done
exit $status
