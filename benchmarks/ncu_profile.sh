#!/usr/bin/env bash
# Nsight Compute profile of production kernels on official cases (device only): for each case and kernel,
# the full section set as text and the source counters per SASS instruction as gzipped CSV under $OUT
# (the CUDA view of a Triton kernel comes back without metrics: map the SASS rows to lines with ncu_lines.py).
# usage: CASES="N128_P64_R4_C16 ..." KERNELS="_chunk_scan_kernel ..." [CONFIG=k=v,...] [TAG=name] bash benchmarks/ncu_profile.sh
# LAUNCH_SKIP / LAUNCH_COUNT (default 1 / 1) pick the launches of a kernel: a kernel launched twice a call (the
# two-pass state scans) wants LAUNCH_SKIP=2 LAUNCH_COUNT=2, both passes of the second call.  TAG names the reports
# of a CONFIG apart from the dispatcher's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
for c in ${CASES:-N128_P64_R4_C16}; do
  for k in ${KERNELS:-_chunk_scan_kernel}; do
    rep="$OUT/ncu_${c}_${k#_}${TAG:+_$TAG}"
    # the second call's launch: the first one compiles and warms the caches
    timeout ${CASE_TIMEOUT:-240} ncu --clock-control none --set full --import-source yes --kernel-name "$k" \
      --launch-skip ${LAUNCH_SKIP:-1} --launch-count ${LAUNCH_COUNT:-1} -f -o "$rep" \
      python3 benchmarks/profile_gpu.py --case "$c" --calls 2 ${CONFIG:+--config "$CONFIG"} >/dev/null 2>"$rep.err" \
      || { echo "ncu failed: $c $k"; tail -5 "$rep.err"; continue; }
    ncu -i "$rep.ncu-rep" --page details > "$rep.txt"
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass 2>/dev/null | gzip > "${rep}_sass.csv.gz"
    rm -f "$rep.ncu-rep" "$rep.err"
    grep -E "Duration|Registers Per|Achieved Occupancy|Issued Ipc|No Eligible|Warp Cycles Per Issued|DRAM Throughput" "$rep.txt"
  done
done
