"""Time ``_group_sum_kernel``'s tile shapes on the partial tensors of the official shapes (device only).

    python benchmarks/group_sum_tune.py --json out.json

``sum_group_partials`` reduces the output stage's [B, H, groups, R, P] fp32 partials over the groups.  With
chunk_scan applying the gate over single chunks (N16, section 43) the partials are 256 groups deep and the
reduction took 22 us of a 208 us call (H100) for 34 MB: 1.5 TB/s.  This times every (groups a step, columns a
program, warps, stages) of the grid below on each partial shape, checks each variant's sums against torch's, and
prints the best and the module's current choice.

Replayed alone, the partials stay in L2 (34 MB of 50), which the call does not give them: Nsight Compute put
group_sum's L2 hit rate at 3% in the N16 call (section 44).  ``--in-call CASE`` times whole calls instead (CUDA graph,
two input sets, the official B / S / H), with ``production.sum_group_partials`` bound to each tile of ``IN_CALL``,
through the JIT launcher (the call replay would keep the first tile), and checks dmimo_o / dmimo_z against the
current tile's.
"""

import argparse
import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mamba3_mimo.ops import group_sum  # noqa: E402

# (label, [B, H, groups, R, P], with Z): the partials of the dispatcher's gate-in-scan and gate_grads shapes.
SHAPES = [
    ("N16 gate in scan, Z", (4, 16, 256, 4, 64), True),
    ("N16 gate in scan, no Z", (4, 16, 256, 4, 64), False),
    ("R8_C8 no Z", (4, 16, 256, 8, 64), False),
    ("N128_P64_R4_C16 no Z", (4, 16, 128, 4, 64), False),
    ("R1_C64 Z", (4, 16, 32, 1, 64), True),
]
GRID = dict(block_g=(64, 128, 256), block_cols=(16, 32, 64), num_warps=(4, 8), num_stages=(1, 3))


def run_variant(dphi, dzeta, out_o, out_z, block_g, block_cols, num_warps, num_stages):
    group_sum.sum_group_partials(dphi_partial=dphi, dzeta_partial=dzeta, dmimo_o=out_o, dmimo_z=out_z,
                                 block_groups=block_g, block_cols=block_cols, num_warps=num_warps,
                                 num_stages=num_stages)


# (groups a step, columns a program, warps) timed in whole calls; the first is the module's current tile.
IN_CALL = [(group_sum.BLOCK_GROUPS, group_sum.BLOCK_COLS, 4), (128, 32, 4), (128, 16, 4), (256, 32, 8), (256, 16, 8),
           (256, 64, 8)]


def in_call(case, has_z):
    """Whole-call graph us of ``case`` with each ``IN_CALL`` tile of sum_group_partials."""
    import functools

    os.environ["MAMBA3_MIMO_JIT_LAUNCH"] = "1"
    from mamba3_mimo.api import bwd_fwd
    from mamba3_mimo.bench import graph_time, parse_case
    from mamba3_mimo.inputs import make_inputs
    from mamba3_mimo.ops import production

    input_sets = [make_inputs(B=4, S=2048, H=16, G=1, **parse_case(case), dtype=torch.bfloat16, z=has_z, d=True,
                              device="cuda", seed=seed) for seed in range(2)]
    plain = production.sum_group_partials
    rows, want = [], None
    for block_g, block_cols, num_warps in IN_CALL:
        production.sum_group_partials = functools.partial(plain, block_groups=block_g, block_cols=block_cols,
                                                          num_warps=num_warps)
        outputs = bwd_fwd(**input_sets[0], output_dtype=torch.bfloat16)
        grads = [x.float() for x in outputs[2:4] if x is not None]  # dmimo_o, dmimo_z
        if want is None:
            want = grads
        for got, ref in zip(grads, want):
            torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-3)  # another summation order, bf16 outputs
        us = 1e3 * graph_time(input_sets, "production", torch.bfloat16)
        rows.append(dict(block_g=block_g, block_cols=block_cols, num_warps=num_warps, us=us))
        print(f"{case} Z {'on' if has_z else 'off'} group_sum {block_g} x {block_cols}, {num_warps} warps: {us:.1f} us",
              flush=True)
    production.sum_group_partials = plain
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--in-call", nargs="+", metavar="CASE", help="time whole calls of these cases instead")
    parser.add_argument("--no-z", action="store_true", help="with --in-call: without the gate")
    args = parser.parse_args()
    if args.in_call:
        results = {case: in_call(case, not args.no_z) for case in args.in_call}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), z=not args.no_z, results=results), f, indent=1)
        return
    results = []
    for label, shape, has_z in SHAPES:
        dphi = torch.randn(shape, device="cuda")
        dzeta = torch.randn(shape, device="cuda") if has_z else None
        want_o = dphi.sum(2)
        want_z = dzeta.sum(2) if has_z else None
        rows = []
        for block_g, block_cols, num_warps, num_stages in itertools.product(*GRID.values()):
            out_o = torch.full_like(want_o, float("nan"))
            out_z = torch.full_like(want_o, float("nan")) if has_z else None
            run_variant(dphi, dzeta, out_o, out_z, block_g, block_cols, num_warps, num_stages)
            torch.testing.assert_close(out_o, want_o, rtol=1e-5, atol=1e-4)
            if has_z:
                torch.testing.assert_close(out_z, want_z, rtol=1e-5, atol=1e-4)
            us = 1e3 * triton.testing.do_bench_cudagraph(
                lambda: run_variant(dphi, dzeta, out_o, out_z, block_g, block_cols, num_warps, num_stages))
            rows.append(dict(block_g=block_g, block_cols=block_cols, num_warps=num_warps, num_stages=num_stages,
                             us=us))
        # sum_group_partials' defaults (num_stages None: Triton's default, 3 on Hopper).
        current = next(r for r in rows if r["block_g"] == group_sum.BLOCK_GROUPS and
                       r["block_cols"] == group_sum.BLOCK_COLS and r["num_warps"] == 4 and r["num_stages"] == 3)
        rows.sort(key=lambda r: r["us"])
        mbytes = dphi.numel() * 4 * (2 if has_z else 1) / 1e6
        print(f"{label} {list(shape)}: {mbytes:.1f} MB; current {current['us']:.1f} us; best:")
        for r in rows[:5]:
            print(f"    {r}")
        results.append(dict(label=label, shape=list(shape), has_z=has_z, mbytes=mbytes, current=current, rows=rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), results=results), f, indent=1)


if __name__ == "__main__":
    main()
