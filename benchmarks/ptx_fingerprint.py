"""Fingerprints of the PTX of every production launch on the official grid, compiled for sm_90 without a GPU.

    python benchmarks/ptx_fingerprint.py --out after.json
    git stash; python benchmarks/ptx_fingerprint.py --out before.json; git stash pop
    python benchmarks/ptx_fingerprint.py --compare before.json after.json

A refactor whose launches all keep their fingerprints compiles to the same PTX, so to the same SASS: the
GPU runs of the commit it started from still hold for it.  Debug sections, line records and debug-scope
labels are dropped first, so moved lines and helpers inlined in a new place do not count; a change of
any instruction does.  Covers the dispatcher's configs, Z on and off, bf16 (as benchmarks/aot_report.py).
"""

import argparse
import hashlib
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import aot_report  # noqa: E402
from mamba3_mimo import api  # noqa: E402
from mamba3_mimo.bench import OFFICIAL_CASES, parse_case  # noqa: E402
from mamba3_mimo.ops.production import choose_config  # noqa: E402

DEBUG_LINE = re.compile(r"\s*(\.loc|\.file|\$L__tmp\d+:)")


def fingerprint(ptx):
    code = ptx.split(".section\t.debug")[0]
    kept = "\n".join(line for line in code.splitlines() if not DEBUG_LINE.match(line))
    return hashlib.sha1(kept.encode()).hexdigest()


def fingerprints():
    aot_report.compile_as_cuda()
    found = {}
    for case in OFFICIAL_CASES:
        for z in (True, False):
            shape = parse_case(case)
            inputs = aot_report.empty_inputs(B=4, S=2048, H=16, G=1, dtype=torch.bfloat16, z=z, **shape)
            config = choose_config(B=4, H=16, S=2048, num_sms=132, has_z=z, **shape)
            launches = aot_report.capture_launches(
                lambda: api.bwd_fwd(**inputs, output_dtype=torch.bfloat16, config=config))
            for index, (name, args, kwargs) in enumerate(launches):
                kernel = aot_report.compile_launch(name, args, kwargs)
                found[f"{case} z={int(z)} #{index} {name}"] = fingerprint(kernel.asm["ptx"])[:16]
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the fingerprints here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two fingerprint files")
    args = parser.parse_args()
    if args.compare:
        before, after = (json.load(open(path)) for path in args.compare)
        changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
        print(f"{len(before)} / {len(after)} launches; {len(changed)} differ")
        for key in changed:
            print(f"  {key}: {before.get(key)} -> {after.get(key)}")
        sys.exit(1 if changed else 0)
    found = fingerprints()
    with open(args.out, "w") as f:
        json.dump(found, f, indent=1)
    print(f"{len(found)} launches fingerprinted -> {args.out}")


if __name__ == "__main__":
    main()
