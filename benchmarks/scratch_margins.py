"""How close the split output stage's outputs come to SPEC section 7's bounds, per raw_y scratch dtype.

For the bf16 rows of the GPU pairwise grid (N = P = 64, R = 4, C = 16, Z on) and several seeds, runs the
production path with the split output stage and its raw_y scratch in fp32 (``half_raw_y=False``) or fp16 with
row scales (``half_raw_y=True``; only bf16 activations get it, ``production.raw_y_scratch_dtype``), and prints,
per output, the worst ratio of each metric to its bound (1.0 = at the bound): normwise / tolerance,
MERE / (2 MERE(bench) + 1e-6), MARE / (10 MARE(bench) + 1e-5).

With ``--d-in-gate`` the D skip is added by gate_grads (``ScanConfig.d_in_gate``) instead of chunk_scan.  With
``--knob NAME`` another ScanConfig switch takes the scratch's place: off against on, the scratch as the dispatcher
sets it (``--knob scan_half_rotation+out_half_rotation``: both together).

    python benchmarks/scratch_margins.py [--seeds 4] [--json out.json] [--d-in-gate] [--knob half_raw_y]
"""

import argparse
import dataclasses
import itertools
import json

import torch

from mamba3_mimo import api
from mamba3_mimo.accuracy import check_outputs
from mamba3_mimo.inputs import make_inputs
from mamba3_mimo.ops.production import choose_config
from mamba3_mimo.reference import bwd_fwd_reference

ROWS = [dict(B=B, S=S, H=H, G=G) for B, S, H, G in itertools.product((1, 2), (32, 64), (2, 4), ("1", "H"))]


def margins(checks, output_dtype, tol_normwise):
    out = {}
    for c in checks:
        if c.mere is None:
            continue
        out[c.name] = (c.normwise / tol_normwise, c.mere / (2 * c.mere_bench + 1e-6),
                       c.mare / (10 * c.mare_bench + 1e-5))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--d-in-gate", action="store_true", help="ScanConfig.d_in_gate: the D skip in gate_grads")
    parser.add_argument("--rows", type=int, default=len(ROWS), help="the first ROWS rows only (a CPU smoke run)")
    parser.add_argument("--knob", default="half_raw_y", help="ScanConfig bools compared off / on, joined by +")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU needs TRITON_INTERPRET=1
    samples = {}
    for dtype, row, seed in itertools.product((torch.bfloat16,), ROWS[:args.rows],
                                                range(args.seeds)):
        G = 1 if row["G"] == "1" else row["H"]
        shape = dict(B=row["B"], S=row["S"], H=row["H"], G=G, N=64, P=64, R=4, chunk_size=16)
        inputs = make_inputs(**shape, dtype=dtype, device=device, seed=1000 + seed)
        ref_inputs = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in inputs.items()}
        golden = bwd_fwd_reference(**ref_inputs, compute_dtype=torch.float64)
        bench = bwd_fwd_reference(**ref_inputs, compute_dtype=dtype)
        base = choose_config(B=shape["B"], H=shape["H"], S=shape["S"], N=64, P=64, R=4, chunk_size=16,
                             num_sms=torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda"
                             else 4, has_z=True)
        for on in (False, True):
            config = dataclasses.replace(base, split_gate=True, gate_in_scan=False, d_in_gate=args.d_in_gate,
                                         **{name: on for name in args.knob.split("+")})
            candidate = api.bwd_fwd(**inputs, output_dtype=dtype, impl="production", config=config)
            checks = check_outputs(tuple(x.cpu() if x is not None else None for x in candidate), golden, bench,
                                   dtype, dtype)
            for name, ratios in margins(checks, dtype, 1e-2).items():
                if args.knob == "half_raw_y":
                    scratch = "fp16 scratch" if on else "fp32 scratch"
                else:
                    scratch = f"{args.knob}={int(on)}"
                scratch += " D in gate" if args.d_in_gate else ""
                key = (str(dtype).split(".")[1], scratch, name)
                samples.setdefault(key, []).append(dict(row=row, seed=seed, ratios=ratios))
    metrics = ("normwise", "MERE", "MARE")
    print(f"{'activations':12s} {'compared':40s} {'output':8s} " + "  ".join(
        f"{m + ' worst / >0.9 / >1':>22s}" for m in metrics) + "   (ratio to the bound over rows and seeds)")
    for key in sorted(samples):
        cells = []
        for i in range(3):
            values = [x["ratios"][i] for x in samples[key]]
            cells.append(f"{max(values):10.3f} / {sum(v > 0.9 for v in values):3d} / {sum(v > 1 for v in values):3d}")
        print(f"{key[0]:12s} {key[1]:40s} {key[2]:8s} " + "  ".join(f"{c:>22s}" for c in cells) +
              f"   of {len(samples[key])}")
    if args.json:
        with open(args.json, "w") as f:
            records = [dict(activations=k[0], scratch=k[1], output=k[2], samples=v) for k, v in sorted(samples.items())]
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
