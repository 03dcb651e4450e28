#!/usr/bin/env bash
# One-off device sweep of the split output stage, a case per process (a faulting candidate poisons its
# CUDA context, so it may cost only its own case); per-case JSON under $OUT, a one-line summary per config.
# usage: MAMBA3_COMMIT=<sha> CASES="..." KNOBS="..." [NOZ=1] bash benchmarks/sweep_cases.sh   (NOZ=1: without Z)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
for c in ${CASES}; do
  timeout ${CASE_TIMEOUT:-100} python3 -m mamba3_mimo.bench --cases $c --impl production --sweep --knobs ${KNOBS} \
    ${NOZ:+--no-z} --input-sets 2 --breakdown --json "$OUT/sw_$c.json" 2>&1 | grep -E "FAILED|error|Error" | cut -c 1-400 | head -3
done
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ.get("OUT", "gpu_out") + "/sw_*.json")):
    for r in json.load(open(f))["records"]:
        c = r["config"]
        # a kernel launched more than once a call (the two-pass scans): each launch's us in call order
        launches = {}
        for name, us in r.get("launches_us") or ():
            launches.setdefault(name[1:12], []).append(str(round(us)))
        stage = ("scan-gate" if c.get("gate_in_scan") else "split") if c["split_gate"] else "fused"
        print(r["case"], stage, "local" if c["local_states"] else "two",
              c["out_num_warps"], c["out_block_p"], c["out_max_registers"], c.get("gate_tokens"), "dg" if c.get("d_in_gate") else "-",
              c.get("gate_tile_elements"), c.get("gate_num_warps"), f"n{c['block_half']}x{c['n_segments']}",
              "skip" if c.get("scan_skip_unrotated") else "-", "flat" if c.get("flat_tables") else "-",
              "pdl" if c.get("pdl") else "-", "fold1" if c.get("fold_one_scan") else "-",
              "+".join(k for k in ("scan_half_rotation", "out_half_rotation", "out_q_cast_early", "out_y_state_early",
                                   "scan_prefetch") if c.get(k)) or "-",
              round(r["graph_ms"] * 1e3),
              {k[1:12]: round(v) for k, v in r["breakdown_us"].items() if v > 3},
              {name: "+".join(times) for name, times in launches.items() if len(times) > 1} or "")
PY
