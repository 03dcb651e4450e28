#!/usr/bin/env bash
# Device A/B of the Gluon scan's buffer caps (section 48): the GPU tests of the Gluon scan with two operand sets and
# two state-store buffers, then the package at a base commit (ab_base) against the working tree at
# MAX_OPERAND_BUFFERS = 2 (ab_ops) and at both caps 2 (the working tree, "new"), timed in alternation.
#   here:   rm -rf ab_base && mkdir ab_base && git archive <rev> mamba3_mimo | tar -x -C ab_base
#   device: (carry ab_base) [CASES="..."] bash benchmarks/buffers_ab.sh     (results under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "${OUT:-$PWD/gpu_out}")"
mkdir -p "$OUT"
scan=mamba3_mimo/ops/gluon_state_scan.py
rm -rf ab_ops && mkdir ab_ops && cp -r mamba3_mimo ab_ops/
sed -i 's/^MAX_OPERAND_BUFFERS = 1$/MAX_OPERAND_BUFFERS = 2/' ab_ops/$scan $scan
sed -i 's/^MAX_STATE_STORE_BUFFERS = 1$/MAX_STATE_STORE_BUFFERS = 2/' $scan
grep -H "^MAX_.*_BUFFERS" ab_ops/$scan $scan
MAMBA3_MIMO_CHECK_PLAN=1 PYTHONPATH=$PWD timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:warnings -rf tests/test_gluon_state_scan.py 2>&1 \
  | tee "$OUT/gluon_tests_full.log" | tail -n 8
OUT="$OUT" TREES="base ops new" CASES="${CASES:-N64_P64_R4_C16 N64_P128_R4_C16 N256_P64_R4_C8 N128_P128_R4_C8}" \
  RUN_TIMEOUT=${RUN_TIMEOUT:-100} timeout ${AB_TIMEOUT:-340} bash benchmarks/ab_trees.sh
