#!/usr/bin/env bash
# Time the knobs prepared without a device (docs/optimization.md sections 27-29) in six device calls, one group of
# cases and knobs per sweep_cases.sh run (its per-case JSON and summary under $OUT/<group>).  Part 1 holds the
# candidate with the largest predicted effect; run the parts in order.  Parts 3-6 were parts 1-4 in sections 27-28.
# Part 1 and part 2's first two groups (as d_in_gate + both + the order at 128 registers) ran at 01845e8 (section 30).
# Parts 10-11 (section 33) check and time the warp-specialized Gluon scan; they go first among the untimed parts.
# Part 12 (section 34) checks and times the Gluon chunk_scan probe; part 13 tests the prepared fp32 exp (both ran at
# b1e0668, section 35); part 14 tests fp32 after the precise sigmoid, with and without that exp (ran at 55078f1,
# section 36); part 15 times the probe with split loads; part 16 (section 37) the split stage without Z at N16 / N32;
# part 17 (section 38) the gate in chunk_scan and a 96-register chunk_scan at N <= 64 with Z; part 18 the Gluon
# gate_grads at P = 128 on the H200 (run it on an H200 only; ran at 6c2c07a, section 39); part 19 the two-pass
# shapes' Gluon scan in one segment; part 20 an Nsight Compute profile of chunk_scan; part 21 (section 40)
# programmatic dependent launch; part 22 the segment fold as one scan (both timed on an H100, section 40); part 24
# (section 42) the N16 / N32 state scan over a 64-wide P tile with twice the segments; part 25 (section 43) chunk_scan in
# more, smaller programs; part 26 (section 44) an L2 blocking probe; part 27
# part 19's last two sweeps; part 28 chunk_scan's deferred stores; part 31 (section 46) chunk_scan's bf16 rotation on the
# two-pass shapes and N64_P128; part 32 N256's chunk_scan over single chunks, gate_grads' tokens at P = 128;
# part 33 the gated chunk_scan's register cap; part 34 (section 47) the Gluon scan at N = 64 under lower caps; part 35
# the Gluon scan's bf16 rotation.
# usage: MAMBA3_COMMIT=<sha> OUT=... PART=1|...|22|24-35 bash benchmarks/sweep_prepared.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"

sweep() {  # sweep <group> VAR=value... (CASES, KNOBS, NOZ); the per-case JSON merged into $OUT/<group>.json
  local group=$1
  shift
  mkdir -p "$OUT/$group"
  echo "== $group $*"
  env OUT="$OUT/$group" "$@" bash benchmarks/sweep_cases.sh
  # A device call brings back at most 8 files: one a group.
  python3 - "$OUT/$group" <<'PY'
import glob, json, os, sys
files = sorted(glob.glob(os.path.join(sys.argv[1], "sw_*.json")))
if files:
    merged = [json.load(open(f)) for f in files]
    json.dump(dict(meta=merged[0]["meta"], records=[r for m in merged for r in m["records"]]),
              open(sys.argv[1] + ".json", "w"), indent=1)
    for f in files:
        os.remove(f)
PY
}

export CASE_TIMEOUT="${CASE_TIMEOUT:-180}"  # a case compiles each candidate's kernels before timing them
ALL_CASES="N16_P64_R4_C8 N32_P64_R4_C16 N64_P64_R4_C16 N128_P64_R4_C16 N256_P64_R4_C8 N64_P128_R4_C16 N128_P32_R4_C16 \
N128_P128_R4_C8 N128_P64_R8_C8 N128_P64_R2_C32 N128_P64_R1_C64"
# Every candidate carries d_in_gate, which the GPU runs of sections 26-27 timed and which the next validation makes the
# default, so that one final_gpu.sh run can follow with all the winners set.
HALF_ROTATION="d_in_gate=1,d_in_gate=1+scan_half_rotation=1,d_in_gate=1+out_half_rotation=1,\
d_in_gate=1+scan_half_rotation=1+out_half_rotation=1"
# q and k rotated in bf16 in both stages (section 29), and that with the rest of the swept rule of section 30 (the D skip
# in the gate, chunk_scan's low-register order); a group adds chunk_scan's register cap.
BF16_ROTATION="scan_half_rotation=1+out_half_rotation=1"
SWEPT_RULE="$BF16_ROTATION+d_in_gate=1+out_q_cast_early=1+out_y_state_early=1"
case "${PART:-1}" in
  1)
    # q's and k's bias add and rotation in bf16, two elements a register (section 29): the state scan's step -16% /
    # -25% of its SASS (tables converted / in bf16), chunk_scan -16% and 38 fewer registers at N = 128.  First how
    # close the outputs come to the accuracy contract's bounds with it (the bf16 pairwise rows, 2 seeds), then the
    # shapes where the scans are longest, then N = 128 at chunk_scan's 128-register cap in section 28's order (0-16 B
    # of spill: four programs an SM) against the same order at 168.
    mkdir -p "$OUT/half_rotation_margins"
    timeout 150 python3 benchmarks/scratch_margins.py --seeds 2 --d-in-gate --knob scan_half_rotation+out_half_rotation \
      --json "$OUT/half_rotation_margins/margins.json" 2>&1 | tail -n 12
    sweep half_rotation CASES="N128_P64_R4_C16 N256_P64_R4_C8 N128_P128_R4_C8 N64_P128_R4_C16" KNOBS="$HALF_ROTATION"
    sweep half_rotation_cap CASES="N128_P64_R4_C16 N128_P64_R8_C8" \
      KNOBS="$SWEPT_RULE+out_max_registers=128:168"
    ;;
  2)
    sweep half_rotation_rest CASES="N16_P64_R4_C8 N32_P64_R4_C16 N64_P64_R4_C16 N128_P32_R4_C16 N128_P64_R8_C8 \
      N128_P64_R2_C32 N128_P64_R1_C64" KNOBS="d_in_gate=1,d_in_gate=1+scan_half_rotation=1+out_half_rotation=1"
    sweep half_rotation_noz NOZ=1 CASES="N16_P64_R4_C8 N128_P64_R4_C16 N256_P64_R4_C8" \
      KNOBS="scan_half_rotation=1,out_half_rotation=1,scan_half_rotation=1+out_half_rotation=1"
    # Fewer scan registers in half (N128_P32 208 -> 168: three programs an SM; N128_P128's two-pass scans 166 -> 128:
    # four, so its 512 programs fit one wave): more segments may pay there.
    sweep half_rotation_segments CASES="N128_P32_R4_C16 N128_P128_R4_C8" \
      KNOBS="d_in_gate=1+scan_half_rotation=1+out_half_rotation=1+n_segments=2:4:6:8"
    # The local-state scans at 8 warps in half: 168 registers uncapped, 128 with 0-16 B of spill, two 8-warp programs an
    # SM (16 warps, twice today's); section 22 found 8 warps a tie at best in fp32.
    sweep half_rotation_8_warps CASES="N128_P64_R4_C16 N128_P64_R8_C8 N64_P128_R4_C16" \
      KNOBS="d_in_gate=1+scan_half_rotation=1+out_half_rotation=1+num_warps=8+scan_max_registers=0:128"
    ;;
  3)
    # chunk_scan at N = 128 with its products reordered for registers: at a 128-register cap four programs share
    # an SM instead of three (statically 0-32 B of spill with Z, 8-48 B without; section 28).  The 168 cap
    # alongside (the same occupancy as today: the reorder alone).  N64_P64 (capped at 128 already): both orders
    # drop its 16 B of spill.  N256's uncapped chunk_scan loses its 112-128 B of spill, N128_P128's (168, shared-memory
    # bound at 3 programs an SM) drops 80-88 -> 40.
    sweep out_reorder CASES="N128_P64_R4_C16 N128_P32_R4_C16 N128_P64_R8_C8 N128_P64_R2_C32 N64_P64_R4_C16" \
      KNOBS="out_q_cast_early=1+out_max_registers=128:168,out_q_cast_early=1+out_y_state_early=1+out_max_registers=128"
    sweep out_reorder_noz NOZ=1 CASES="N128_P64_R4_C16 N128_P32_R4_C16 N128_P64_R8_C8 N128_P64_R2_C32" \
      KNOBS="out_q_cast_early=1+out_max_registers=128:168,out_q_cast_early=1+out_y_state_early=1+out_max_registers=128"
    sweep out_reorder_wide CASES="N256_P64_R4_C8 N128_P128_R4_C8" KNOBS="out_q_cast_early=1"
    # With Z, the gate in chunk_scan (no raw_y scratch, no gate_grads pass) in the same order: 24-32 B of spill at
    # 128 registers (136-144 B in today's order).
    sweep out_reorder_gate_z CASES="N128_P64_R4_C16 N128_P64_R2_C32" \
      KNOBS="gate_in_scan=1+d_in_gate=1+out_q_cast_early=1+out_y_state_early=1+out_max_registers=128"
    ;;
  4)
    # The state scans: the rotation skipped by the tiles past the rotary dims, and the narrower N/2 tiles it
    # makes worth timing at N = 128 (two tiles, half the segments: one wave); the flat token tables alongside.
    sweep scan_skip CASES="N256_P64_R4_C8 N128_P128_R4_C8 N128_P64_R4_C16" \
      KNOBS="scan_skip_unrotated=1,block_half=32+n_segments=2,block_half=32+n_segments=2+scan_skip_unrotated=1,flat_tables=1"
    ;;
  5)
    sweep scan_skip_r8 CASES="N128_P64_R8_C8" \
      KNOBS="scan_skip_unrotated=1,block_half=32+n_segments=2,block_half=32+n_segments=2+scan_skip_unrotated=1,flat_tables=1,gate_tokens=256"
    sweep n64_tiles CASES="N64_P64_R4_C16" KNOBS="block_half=16+n_segments=2:4+scan_skip_unrotated=0:1,flat_tables=1"
    sweep flat CASES="N16_P64_R4_C8 N32_P64_R4_C16 N64_P128_R4_C16 N128_P32_R4_C16 N128_P64_R1_C64" KNOBS="flat_tables=1"
    ;;
  6)
    # The D skip in chunk_scan's gate epilogue (without Z; with Z, the gate in chunk_scan against gate_grads).
    sweep noz_d_in_gate NOZ=1 CASES="N64_P64_R4_C16 N128_P64_R4_C16 N64_P128_R4_C16 N256_P64_R4_C8 N128_P64_R1_C64" \
      KNOBS="d_in_gate=0:1"
    sweep gate_in_scan_z CASES="N128_P64_R2_C32 N128_P64_R4_C16" KNOBS="d_in_gate=0:1,gate_in_scan=1+d_in_gate=0:1"
    # N16 / N32 without Z keep the fused output stage (243 against 251 us for the gate in chunk_scan at 8ebfff3);
    # the epilogue D skip may turn that round.
    sweep noz_small_split NOZ=1 CASES="N16_P64_R4_C8 N32_P64_R4_C16" KNOBS="split_gate=1+d_in_gate=0:1"
    ;;
  7)
    # The two-pass scans (N256, N128_P128: ~400 us of scans a call, 31-35% of their issue rate; section 31).  The
    # end-state pass loading a step ahead (its 128 / 256 programs leave the registers free; in both passes it cost
    # N256 829 -> 979 in section 22), with the fp32 and the bf16 rotation; then N128_P128's scan over [2 x 32, 128]
    # tiles at 8 warps: k~ rotated once for all of P, two programs an SM, one wave (statically -17 / -24% of the
    # instructions a step).
    sweep two_pass_prefetch CASES="N256_P64_R4_C8 N128_P128_R4_C8" \
      KNOBS="end_scan_prefetch=1,end_scan_prefetch=1+$BF16_ROTATION"
    sweep two_pass_wide_p CASES="N128_P128_R4_C8" \
      KNOBS="block_p=128+num_warps=8+n_segments=2:4,block_p=128+num_warps=8+end_scan_prefetch=0:1+$BF16_ROTATION"
    # N64_P128's local-state scan the same way: [2 x 32, 128] tiles at 8 warps, one program an SM (8 warps, as today's
    # two 4-warp programs loading ahead), the same steps at 2 segments, 30-34% fewer instructions a (b, h) and step.
    sweep local_wide_p CASES="N64_P128_R4_C16" \
      KNOBS="block_p=128+num_warps=8+scan_prefetch=0:1,block_p=128+num_warps=8+scan_prefetch=1+$BF16_ROTATION"
    # The local-state scans of N = 128 at 8 warps loading a step ahead (184 registers in fp32, 211 in bf16: one program
    # an SM, the same 8 warps an SM as today's two 4-warp programs) over 2 segments (one wave of 128 programs): a
    # shorter step, twice the steps, and chunk_scan's entry fix-up on half the chunks instead of three quarters (-1/3
    # of its 28 / 89 us at R4_C16 / R8_C8, section 24).
    sweep local_8_warps_prefetch CASES="N128_P64_R4_C16 N128_P64_R8_C8" \
      KNOBS="num_warps=8+scan_prefetch=1+n_segments=2:4,num_warps=8+scan_prefetch=1+n_segments=2+$SWEPT_RULE+out_max_registers=128"
    ;;
  8)
    # Why the two-pass scans lose in bf16 (section 30: N256's state scans 383 -> 476 us, N128_P128's 411 -> 433,
    # though their loops shrink 17-26% with the same loads, shared-memory operations and barriers; section 31):
    # Nsight Compute on both passes of the second call, the rotation in fp32 and in bf16 (stall reasons, issue slots,
    # L1 / L2 / DRAM throughput a pass).
    for half in 0 1; do
      CASES="N256_P64_R4_C8 N128_P128_R4_C8" KERNELS=_state_scan_kernel LAUNCH_SKIP=2 LAUNCH_COUNT=2 \
        CONFIG="scan_half_rotation=$half,out_half_rotation=$half" TAG="half$half" OUT="$OUT/two_pass_ncu" \
        CASE_TIMEOUT=150 bash benchmarks/ncu_profile.sh
    done
    ;;
  9)
    # Optional, last: the state scan with its loads as TMA boxes through a shared-memory ring (benchmarks/tma_scan_probe.py,
    # section 32): chunk_local_states against the probe at 1-3 stages (Triton's warp specialization compiles to nothing
    # or fails for this loop), values checked, on N256's two-pass tiles and two local-state shapes.  Statically it
    # should lose (1.2-2.5x the loop's instructions, more registers); this confirms it in one to two minutes.
    mkdir -p "$OUT/tma_scan_probe"
    timeout 400 python3 benchmarks/tma_scan_probe.py --json "$OUT/tma_scan_probe/probe.json" 2>&1 | tail -n 12
    ;;
  10)
    # The state scan as a warp-specialized Gluon kernel (benchmarks/gluon_scan_probe.py, section 33): a TMA producer
    # warp and a wgmma consumer warpgroup, 0.6-0.9x the production scan's chunk-loop instructions with no global load
    # in the consumer's loop, in the scan's three roles (local states; end states; stored states with the fold).  Its
    # values first (against the production scans and the float64 reference, never run before), then every role
    # against the production scans on the seven N = 128 / 256 shapes.  Predicted: 0.4-0.65x their time.
    mkdir -p "$OUT/gluon_scan_probe"
    # The timings only if the values pass (a failed or hung kernel would spend the call).
    if timeout 150 python3 -m pytest -q -p no:warnings -rf tests/test_gluon_state_scan.py \
        > "$OUT/gluon_scan_probe/tests.log" 2>&1; then
      tail -n 3 "$OUT/gluon_scan_probe/tests.log"
      timeout 400 python3 benchmarks/gluon_scan_probe.py --cases N128_P64_R4_C16 N256_P64_R4_C8 N128_P128_R4_C8 \
        --json "$OUT/gluon_scan_probe/probe.json" 2>&1 | tail -n 8
    else
      tail -n 12 "$OUT/gluon_scan_probe/tests.log"
    fi
    ;;
  11)
    # After part 10 passes: the other four shapes the Gluon scan covers, then whole calls with ScanConfig.gluon_scan
    # (graph us, the dispatcher's config otherwise) on the shapes of the largest predicted gains.
    mkdir -p "$OUT/gluon_scan_probe"
    timeout 300 python3 benchmarks/gluon_scan_probe.py --cases N128_P32_R4_C16 N128_P64_R8_C8 N128_P64_R2_C32 \
      N128_P64_R1_C64 --json "$OUT/gluon_scan_probe/probe_rest.json" 2>&1 | tail -n 4
    sweep gluon_scan CASES="N256_P64_R4_C8 N128_P128_R4_C8 N128_P64_R4_C16 N128_P64_R8_C8" KNOBS="gluon_scan"
    ;;
  12)
    # chunk_scan as a Gluon kernel (benchmarks/gluon_chunk_scan_probe.py, section 34; never run before): its values
    # against the production chunk_scan on a small two-pass problem, then whole calls (graph us, per-kernel us) with
    # the dispatcher's config, with two passes and the Gluon scan, and with the probe as chunk_scan in those, and the
    # last one's accuracy contract on a smaller problem.  The timings only if the values pass.
    mkdir -p "$OUT/gluon_chunk_scan_probe"
    if timeout 120 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import gluon_chunk_scan_probe as p; \
        e = p.check_gpu(); print(e); sys.exit(max(e.values()) > 1e-2)" 2>&1 | tail -n 4; then
      timeout 460 python3 benchmarks/gluon_chunk_scan_probe.py --gpu --cases N64_P128_R4_C16 N128_P64_R4_C16 \
        N128_P128_R4_C8 --json "$OUT/gluon_chunk_scan_probe/probe.json" 2>&1 | tail -n 6
    fi
    ;;
  13)
    # libdevice's exp for fp32 products (host_utils.FP32_PRECISE_EXP, section 34), on for this process only: the
    # premise (tl.exp's error grows with |x|, libdevice's does not), the fp32 case that failed on the GPU, and every
    # fp32 test of the official / config / half-rotation and pairwise / tail / rank grids.  If all pass, flip the
    # default and run final_gpu.sh.
    mkdir -p "$OUT/fp32_precise_exp"
    MAMBA3_MIMO_FP32_PRECISE_EXP=1 MAMBA3_MIMO_CHECK_PLAN=1 timeout 400 python3 -m pytest -q -p no:warnings -rf \
      tests/test_triton_utils.py tests/test_kernels.py -k "exp_fp32 or (half_rotation and dtype2) or \
      ((gpu_pairwise or gpu_tail or gpu_rank or production_configs) and (fp32 or F32 or float32))" 2>&1 \
      | tail -n 8 | tee "$OUT/fp32_precise_exp/tests.log"
    ;;
  14)
    # fp32 after the precise sigmoid (section 35): the half-rotation and fp32 pairwise / tail / rank tests and the
    # sigmoid / exp unit tests, with the default exp, then with libdevice's exp; whole logs (the failures' tables).
    # At a3cc5db dmimo_o passed and states' MARE failed by 1.5% (approx exp); with the exp knob the reason was cut.
    mkdir -p "$OUT/fp32"
    for precise_exp in 0 1; do
      MAMBA3_MIMO_FP32_PRECISE_EXP=$precise_exp MAMBA3_MIMO_CHECK_PLAN=1 timeout 250 python3 -m pytest -q \
        -p no:warnings -rf tests/test_triton_utils.py tests/test_kernels.py -k "sigmoid or exp_fp32 or \
        (half_rotation and dtype2) or ((gpu_pairwise or gpu_tail or gpu_rank) and (fp32 or F32 or float32))" \
        > "$OUT/fp32/precise_exp_$precise_exp.log" 2>&1
      echo "== MAMBA3_MIMO_FP32_PRECISE_EXP=$precise_exp"
      grep -E "FAIL|passed|failed" "$OUT/fp32/precise_exp_$precise_exp.log" | tail -n 12
    done
    ;;
  15)
    # The Gluon chunk_scan probe with the state and v boxes on a second barrier (section 36): its values against the
    # production chunk_scan, then whole two-pass calls with the Triton chunk_scan, the one-barrier probe and the split
    # one (graph us, per-kernel us).  Predicted: the probe's chunk_scan 183 -> ~150-160 us at N128_P64_R4_C16 on the
    # H100 (Triton 163), the state boxes' DRAM time hidden behind the rotation and the scores.
    mkdir -p "$OUT/gluon_chunk_scan_split"
    timeout 400 python3 benchmarks/gluon_chunk_scan_probe.py --gpu --split-loads --cases ${CASES:-N128_P64_R4_C16} \
      --json "$OUT/gluon_chunk_scan_split/split.json" 2>&1 | tail -n 8
    ;;
  16)
    # Without Z, N16 (the worst Z-off case, 2.15x) and N32 run the fused output stage; the split one with the gate in
    # chunk_scan (gate_in_scan: no raw_y scratch, no gate_grads pass), local states, the bf16 rotation and its
    # 128-register cap (section 37's notes) was last timed at N16 before those (8ebfff3: 251 against 243 us graph,
    # chunk_scan then 168 registers).  Statically at 128: 40 B of spill at N16, 16 B at N32.  Predicted N16 243 ->
    # ~205-215 us (chunk_scan as with Z, ~112-126 us, the scan 60-65); N32 a tie (219 = 219 at f51bf7f).
    sweep noz_small_split NOZ=1 CASES="N16_P64_R4_C8 N32_P64_R4_C16" KNOBS="split_gate=0:1"
    ;;
  17)
    # The N <= 64 shapes with Z (section 38): the gate in chunk_scan again (at 176994b it lost, N16 320 -> 347 us:
    # chunk_scan 163 -> 240 against gate_grads' 64; since then chunk_scan took the bf16 rotation and its low-register
    # order, and without Z the same stage won N16 244 -> 225), predicted a loss of 0-10%; and chunk_scan at a
    # 96-register cap (five programs an SM instead of four; statically 144 B of spill at N16 / N32, 104 at N64),
    # predicted a tie or a loss (the 128 cap at N = 128 lost with 136-248 B of spill).
    sweep small_z_stage CASES="N16_P64_R4_C8 N32_P64_R4_C16 N64_P64_R4_C16" KNOBS="gate_in_scan=0:1,out_max_registers=96"
    ;;
  18)
    # The Gluon gate_grads at P = 128 on the H200 (section 38): in the official files N64_P128 went 424 -> 431 us graph
    # and N128_P128 683 -> 693 when it came on, where an H100 had them at -0.9% / -2.7% and every P <= 64 shape moved
    # -0.4 to -3.7% on the H200.  Drift between sessions is of that size: both in one run, on the H200 only.
    sweep gluon_gate_p128 CASES="N64_P128_R4_C16 N128_P128_R4_C8" KNOBS="gluon_gate=0:1"
    ;;
  19)
    # The two-pass shapes' Gluon scan in one segment (section 39): the end-state pass (96 us, 128 programs: half the
    # SMs) goes, and 128 storing programs walk all 256 chunks.  The storing pass moved with the memory (H100 251 us,
    # H200 189: 537 MB of states at 2.8 TB/s) and the end pass did not (95 on both), so one program an SM should
    # store at about the end pass's step rate: predicted scan 285 -> ~190-200 us on the H200.  A 32-wide P tile
    # gives two programs an SM again (k's rotation done twice).
    # The dispatcher's two segments against gluon_segments = 1, and that with a 32-wide P tile.  First the GPU tests of
    # the one-segment path (the Gluon two-pass test, the official two-pass shapes at 1 / 2 segments and P tile 32).
    timeout 170 python3 -m pytest -q -p no:warnings -rf tests/test_gluon_state_scan.py tests/test_kernels.py \
      -k "two_pass_scan_segments or gluon_two_pass_scan_in_one_segment or test_production_with_gluon_scan" 2>&1 | tail -n 6
    sweep two_pass_segments CASES="N256_P64_R4_C8 N128_P128_R4_C8" KNOBS="gluon_segments=1,gluon_segments=1+block_p=32"
    sweep two_pass_segments_noz NOZ=1 CASES="N256_P64_R4_C8 N128_P128_R4_C8" KNOBS="gluon_segments=1"
    # The local-state N = 128 shapes in two passes with the Gluon scan in one segment: no fix-up in chunk_scan, no
    # segment_entry (-30 to -40 us at N128_P64_R4_C16, section 24), but 64 or 128 scan programs (P tiles of 64 / 32)
    # walking all 128 chunks against 256 walking 32 (predicted: a tie or a loss at a 64 tile, unknown at 32).
    sweep local_to_two_pass CASES="N128_P64_R4_C16 N128_P64_R8_C8 N128_P64_R2_C32" \
      KNOBS="local_states=0+gluon_segments=1+block_p=32:64"
    # The flat token tables (section 27), never timed: predicted token_tables 14 -> ~10 us at N = 128, 7 -> ~4 at N16.
    sweep flat_tables CASES="N16_P64_R4_C8 N128_P64_R4_C16 N256_P64_R4_C8 N128_P64_R1_C64" KNOBS="flat_tables=0:1"
    ;;
  20)
    # Where today's chunk_scan waits (section 39: 32-46% of its issue ceiling, not moved by bandwidth): Nsight Compute
    # at N16 and N128_P128, the warp stall reasons and the per-SASS source counters (~2 minutes a kernel).
    CASES="N16_P64_R4_C8 N128_P128_R4_C8" KERNELS="_chunk_scan_kernel" OUT="$OUT/ncu" bash benchmarks/ncu_profile.sh
    ;;
  21)
    # Programmatic dependent launch (section 40): each kernel's programs are scheduled while the previous kernel's last
    # ones finish and wait before reading its output.  Predicted -3 to -6 us a call (graph), the launch gap and the
    # programs' start at each of five kernel boundaries: -1 to -2% at N <= 64, under 1% at N256 / N128_P128.  Its GPU
    # tests (and the one-scan fold's) are in final_gpu.sh's tests and unit parts, which run first; here pdl=0:1 on
    # every official shape with Z and on three without.
    sweep pdl CASES="$ALL_CASES" KNOBS="pdl=0:1"
    sweep pdl_noz NOZ=1 CASES="N16_P64_R4_C8 N128_P64_R4_C16 N256_P64_R4_C8" KNOBS="pdl=0:1"
    ;;
  22)
    # The segment fold as one scan (section 40): predicted segment_entry 5-10 -> ~3 us on the local-state shapes, and
    # then more segments no longer cost a serial step each (the fold took 4 / 15-20 / 36-50 us at 2 / 4 / 8 segments
    # at N = 64, 33 / 87 us at R1_C64 without Z).  Its GPU test is in final_gpu.sh's tests part.
    sweep fold_one_scan CASES="N16_P64_R4_C8 N64_P64_R4_C16 N128_P64_R4_C16 N128_P64_R8_C8 N128_P64_R1_C64" \
      KNOBS="fold_one_scan=0:1,fold_one_scan=1+pdl=1"
    sweep fold_segments CASES="N64_P64_R4_C16 N64_P128_R4_C16 N128_P64_R4_C16 N128_P64_R1_C64" \
      KNOBS="fold_one_scan=1+n_segments=8:16"
    ;;
  24)
    # The small-N local-state scan over all of P = 64 (section 42): half the programs a segment, so one wave holds
    # twice the segments at half the steps.  Predicted scan 62 -> 35-45 us, -6 to -11% of N16 / N32 (with and
    # without Z); measured at a45a4ab (H200): -7 to -8%, scan 61 -> 43 / 60 -> 40 us.  Its GPU accuracy test
    # (test_official_wide_narrow_scan, in final_gpu.sh's tests part) decides production.WIDE_NARROW_SCAN.
    # (Part 23, section 40's software-pipelined loops, was removed with them.)
    sweep small_scan_tile CASES="N16_P64_R4_C8 N32_P64_R4_C16" KNOBS="block_p=64+n_segments=8:10+scan_max_registers=96:128"
    sweep small_scan_tile_noz NOZ=1 CASES="N16_P64_R4_C8 N32_P64_R4_C16" \
      KNOBS="block_p=64+n_segments=8:10+scan_max_registers=96:128"
    ;;
  25)
    # chunk_scan in more, smaller programs (section 43, measured at a364ee9 / c4cc822 on an H100): N16 one chunk a
    # program at 1 / 2 / 4 warps and caps 64-168, the gate in it with Z; the 64-row shapes in smaller programs (a
    # 32-wide P tile, 2 warps) lose.  With the dispatcher's rule on, N16's baseline is the rule itself.
    sweep small_programs CASES="N16_P64_R4_C8" KNOBS="out_span_chunks=2+out_num_warps=4+out_max_registers=128+gate_in_scan=0+gluon_gate=1,\
out_span_chunks=1+out_max_registers=64:96,out_span_chunks=1+out_num_warps=2+out_max_registers=96:128+gate_in_scan=0:1+gluon_gate=1"
    sweep small_programs_noz NOZ=1 CASES="N16_P64_R4_C8" KNOBS="out_span_chunks=2+out_num_warps=4+out_max_registers=128,\
out_span_chunks=1+out_num_warps=2:4+out_max_registers=64:96"
    sweep small_programs_64_rows CASES="N32_P64_R4_C16 N64_P64_R4_C16" \
      KNOBS="out_block_p=32+out_max_registers=64:96,out_num_warps=2+out_max_registers=128:232"
    ;;
  26)
    # L2 blocking probe (section 44): the same shapes at B = 1 (and H = 4 where one batch element's states
    # pass 50 MB) against B = 4, each call on fresh inputs (4x the input sets at B = 1).  If 4 (16) calls of
    # the small problem take much less than one of the large, running the pipeline on batch (head) slices,
    # so that each kernel reads what the one before wrote from L2, is worth building.
    for B in 4 1; do
      sets=$(( B == 4 ? 2 : 8 ))
      python3 -m mamba3_mimo.bench --impl production --B $B --input-sets $sets --breakdown \
        --cases N16_P64_R4_C8 N64_P64_R4_C16 N128_P64_R4_C16 N128_P64_R8_C8 --json "$OUT/l2_probe_B$B.json" \
        2>&1 | grep -v "^WARNING" | tail -n 14
    done
    python3 -m mamba3_mimo.bench --impl production --B 1 --H 4 --input-sets 16 --breakdown \
      --cases N128_P64_R4_C16 N256_P64_R4_C8 N128_P128_R4_C8 --json "$OUT/l2_probe_B1_H4.json" 2>&1 \
      | grep -v "^WARNING" | tail -n 10
    ;;
  27)
    # Part 19's two sweeps that never ran (section 44): the local-state N = 128 shapes in two passes with the Gluon
    # scan in one segment, and the flat token tables; first the launch-plan test that the single-chunk rule broke.
    timeout 120 python3 -m pytest -q -p no:warnings -rf tests/test_launch.py -k launch_plan_replays 2>&1 | tail -n 3
    sweep local_to_two_pass CASES="N128_P64_R4_C16 N128_P64_R8_C8 N128_P64_R2_C32" \
      KNOBS="local_states=0+gluon_segments=1+block_p=32:64"
    sweep flat_tables CASES="N16_P64_R4_C8 N128_P64_R4_C16 N256_P64_R4_C8 N128_P64_R1_C64" KNOBS="flat_tables=0:1"
    ;;
  28)
    # chunk_scan's loads moved ahead of what held them (section 44): the fixed-up state stored after q~ @ state (q's
    # loads one memory round trip earlier at N <= 64 with P tiles of 64; it spills at N = 128 and at P tiles of 128),
    # qk_dot stored after the products (the weights' and v's loads no longer wait for the scores; spill 88 -> 32 B at
    # N128_P128).  Predicted chunk_scan -3 to -8% for the first, -1 to -3% for the second.  First the GPU accuracy
    # tests (the three test_production_configs configs, the two half-rotation cases).  At fbb95b4 this part also timed
    # k's loads before q's rotation (out_k_loads_early: ties and losses, and an illegal address in its GPU test with
    # qk_dot deferred; removed, section 45).
    timeout 200 python3 -m pytest -q -p no:warnings -rf tests/test_kernels.py \
      -k "(test_production_configs and (defer or dqk)) or (half_rotation and (defer or dqk))" 2>&1 | tail -n 3
    sweep defer_stores CASES="N16_P64_R4_C8 N32_P64_R4_C16 N64_P64_R4_C16" \
      KNOBS="out_defer_state_store=0:1,out_defer_state_store+out_defer_qk_dot"
    sweep defer_stores_noz NOZ=1 CASES="N16_P64_R4_C8 N32_P64_R4_C16 N64_P64_R4_C16" KNOBS="out_defer_state_store=0:1"
    sweep defer_qk_dot CASES="N128_P128_R4_C8 N256_P64_R4_C8" KNOBS="out_defer_qk_dot=0:1"
    ;;
  29)
    # qk_dot stored after the products at N128_P128 without Z (with Z it won, 686 -> 664 us; section 45), and the two
    # deferred stores against the dispatcher's choice with them (the swept knobs switched off one at a time).
    sweep defer_qk_dot_noz NOZ=1 CASES="N128_P128_R4_C8" KNOBS="out_defer_qk_dot=0:1"
    sweep defer_rules CASES="N64_P64_R4_C16 N128_P128_R4_C8" KNOBS="out_defer_state_store=0,out_defer_qk_dot=0"
    ;;
  30)
    # Section 45's checks left for lack of device time: the gated chunk_scan with qk_dot deferred (then the Z-off rule
    # at N128_P128: 579 -> 562 us in part 29), the refusal of the 16-wide tile, and the narrow-tile probe's dispatcher
    # configs at P = 16 (it was cut at N = 64).
    timeout 200 python3 -m pytest -q -p no:warnings -rf tests/test_kernels.py \
      -k "(test_production_configs and dqk) or miscompiled or (half_rotation and (defer or dqk))" 2>&1 | tail -n 3
    timeout 300 python3 benchmarks/probe_narrow_p_tile.py map 2>&1 | grep dispatch
    ;;
  31)
    # Section 46: chunk_scan's bf16 rotation in the low-register order where the rule leaves it off (the two-pass
    # shapes and N64_P128, whose scans are Gluon's now; section 30 timed it against the Triton scans), alone and on
    # 64-wide P tiles (statically: N256 255 registers / 128 B spill -> 154 / 0; N64_P128 and N128_P128 on 64-wide
    # tiles 0 B).
    bundle="out_half_rotation=1+out_q_cast_early=1+out_y_state_early=1"
    sweep out_half_rotation CASES="N256_P64_R4_C8 N64_P128_R4_C16 N128_P128_R4_C8" \
      KNOBS="$bundle,out_block_p=64,out_block_p=64+$bundle"
    sweep out_half_rotation_noz NOZ=1 CASES="N256_P64_R4_C8" KNOBS="$bundle"
    ;;
  32)
    # Section 46, after part 31's rule: N256's chunk_scan over single chunks (with the bf16 rotation 128 registers, no
    # spill, 64 KB of shared memory: three programs an SM against two), and gate_grads' token range at P = 128.
    sweep n256_span CASES="N256_P64_R4_C8" KNOBS="out_span_chunks=1"
    sweep n256_span_noz NOZ=1 CASES="N256_P64_R4_C8" KNOBS="out_span_chunks=1"
    sweep p128_gate_tokens CASES="N64_P128_R4_C16 N128_P128_R4_C8" KNOBS="gate_tokens=256"
    ;;
  33)
    # Section 46: the gated chunk_scan (no Z; R1_C64 with Z) uncapped or at 168 registers, three programs an SM with
    # no spill, against the 128 cap's four with 40-128 B of spill (aot_report.py: 143-147 registers uncapped at N = 64
    # and 128, R1_C64 176).
    sweep gated_cap_noz NOZ=1 CASES="N64_P64_R4_C16 N128_P64_R4_C16 N128_P32_R4_C16 N128_P64_R8_C8 N128_P64_R2_C32 \
N128_P64_R1_C64" KNOBS="out_max_registers=0:168"
    sweep gated_cap_r1 CASES="N128_P64_R1_C64" KNOBS="out_max_registers=168"
    ;;
  34)
    # Section 47: the Gluon scan at N = 64 holds two programs an SM (128 registers a thread over 8 hardware warps) and
    # its time does not move with the segment count (N64_P64 2 / 4 / 8 segments 79 / 81 / 83 us, section 34): a fixed
    # issue rate of two programs an SM.  A lower cap (scan_max_registers, which the Gluon scan now honours below 128)
    # fits three (80) or four (64: 52 KB of shared memory a program at 32-wide P tiles) with no spill (static), and a
    # 64-wide P tile rotates k once for all 64 columns instead of once a 32-wide tile.
    export CASE_TIMEOUT=400
    sweep n64_gluon_cap CASES="N64_P64_R4_C16" \
      KNOBS="block_p=32+n_segments=2:4:6:8+scan_max_registers=64:80:128,block_p=64+n_segments=2:3:4:6+scan_max_registers=80:128"
    sweep n64_gluon_cap_noz NOZ=1 CASES="N64_P64_R4_C16" \
      KNOBS="block_p=32+n_segments=4:6:8+scan_max_registers=64,block_p=64+n_segments=2:3:4+scan_max_registers=80:128"
    sweep n64p128_gluon_cap CASES="N64_P128_R4_C16" KNOBS="n_segments=2:3:4+scan_max_registers=80:128"
    ;;
  35)
    # Section 47: the Gluon scan's k rotation in bf16 where the rule rotates in bf16 (scan_half_rotation: the
    # local-state shapes with bf16 products).  The Gluon kernel had rotated in fp32 whatever the knob said; in bf16
    # its chunk loop is 20-32% shorter in SASS (N128_P64_R4_C16 716 -> 505, R8_C8 701 -> 478, N64_P64 447 -> 357) and
    # R1_C64's 144 B of spill goes.  Predicted: the scan -15 to -25% where it is held by its issue rate (N = 64, the
    # N = 128 local-state shapes), 2-5% of a call.  Here the knob off (fp32, as before) against on (the rule).
    local="N64_P64_R4_C16 N128_P64_R4_C16 N128_P32_R4_C16 N128_P64_R8_C8 N128_P64_R2_C32 N128_P64_R1_C64"
    sweep gluon_half_rotation CASES="$local" KNOBS="scan_half_rotation=0"
    sweep gluon_half_rotation_noz NOZ=1 CASES="$local" KNOBS="scan_half_rotation=0"
    ;;
  *)
    echo "PART must be 1 to 22 or 24 to 35" >&2
    exit 2
    ;;
esac
