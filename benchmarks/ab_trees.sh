#!/usr/bin/env bash
# Device A/B of source trees in one call: the working tree ("new") against copies of the package in ab_<name>/
# (default: ab_base, the package at another commit), timed in alternation (A B A B) so drift between runs shows;
# per-run JSON under $OUT.
#   here:   rm -rf ab_base && mkdir ab_base && git archive <rev> mamba3_mimo | tar -x -C ab_base
#   device: (carry ab_base) CASES="..." [ROUNDS=2] [NOZ=1] [TREES="base new other"] bash benchmarks/ab_trees.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="$(realpath -m "${OUT:-$PWD/gpu_out}")"
mkdir -p "$OUT"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in ${TREES:-base new}; do
    root="$PWD"; [ "$tree" = new ] || root="$PWD/ab_$tree"
    # from inside the tree: python -m puts the working directory ahead of PYTHONPATH and the installed package
    (cd "$root" && PYTHONPATH="$root" timeout ${RUN_TIMEOUT:-300} python3 -m mamba3_mimo.bench --cases ${CASES} --impl production \
      ${NOZ:+--no-z} --input-sets 2 --breakdown --json "$OUT/ab_${tree}_${round}.json" >/dev/null 2>"$OUT/ab.err") \
      || { echo "failed: $tree round $round"; tail -3 "$OUT/ab.err"; }
  done
done
python3 - <<'PY'
import glob, json, os
out = os.environ.get("OUT", "gpu_out")
rows = {}
for f in sorted(glob.glob(out + "/ab_*_*.json")):
    tree, rnd = os.path.basename(f)[3:-5].split("_")
    for r in json.load(open(f))["records"]:
        rows.setdefault(r["case"], []).append((tree, rnd, round(r["graph_ms"] * 1e3, 1),
                                             {k[1:12]: round(v) for k, v in r["breakdown_us"].items() if v > 3}))
for case, runs in rows.items():
    for run in sorted(runs, key=lambda x: (x[1], x[0])):
        print(case, *run)
PY
