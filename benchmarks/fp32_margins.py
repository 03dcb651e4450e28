"""How close fp32 calls come to SPEC section 7's bounds, over many seeds: is a failing fp32 test a kernel fault or
one unlucky near-zero element?

For the configs of ``tests/test_kernels.py::HALF_ROTATION_CASES`` (rotation in fp32 for fp32 activations) and the
dispatcher's, on that test's shape (B = 1, S = 70, H = 2, N = 64, P = 48, C = 16), fp32 inputs and outputs, runs
``--seeds`` fresh inputs each and prints, per config and output, the worst and median ratio of MERE and MARE to
their bounds (1.0 = at the bound) and how many seeds pass 1.  For dmimo_o (dPhi, [H, R, P]: 192-288 values, whose
MERE a single element near zero can carry) it also prints, per config, the share of the worst seed's MERE that its
worst element makes.  The exp the kernels take is ``MAMBA3_MIMO_FP32_PRECISE_EXP`` (read at import): run twice to
compare.  On the CPU (TRITON_INTERPRET=1) ``--seeds 1`` is a smoke run.

With ``--recurrence`` the candidate is no kernel but the token recurrence of ``reference.py`` run in fp32 (R = 2 and
3): an exact fp32 implementation whose rounding is independent of the bench's, on the CPU, no Triton.  How often it
fails is the false-failure rate of one fp32 draw, the reason for ``accuracy.judge_with_redraws``.

    MAMBA3_MIMO_FP32_PRECISE_EXP=1 python benchmarks/fp32_margins.py --seeds 40 --json out.json
    python benchmarks/fp32_margins.py --recurrence --seeds 300
"""

import argparse
import json
import statistics

import torch

from mamba3_mimo import api
from mamba3_mimo.accuracy import check_outputs
from mamba3_mimo.inputs import make_inputs
from mamba3_mimo.ops import host_utils
from mamba3_mimo.reference import bwd_fwd_recurrent_reference, bwd_fwd_reference


def test_configs():
    """(name, R, G, config) of the half-rotation test's cases, and the dispatcher's (config None)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_kernels import HALF_ROTATION_CASES
    names = ["two-fused", "local-split", "scan-gate_in_scan", "out-fused-ranks"]
    cases = [(name, case["R"], case["G"], case["config"]) for name, case in zip(names, HALF_ROTATION_CASES)]
    return cases + [("dispatcher R2", 2, 1, None), ("dispatcher R3", 3, 1, None)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--recurrence", action="store_true", help="the fp32 token recurrence as the candidate")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.recurrence else "cpu"
    if args.recurrence:
        exp_label = "candidate: the token recurrence in fp32 (torch, CPU)"
        candidates = [("recurrence R2", 2, 1, None), ("recurrence R3", 3, 1, None)]
    else:
        exp_label = "libdevice exp" if host_utils.FP32_PRECISE_EXP else "tl.exp"
        candidates = test_configs()
    records = []
    for name, R, G, config in candidates:
        for seed in range(args.seeds):
            inputs = make_inputs(B=1, S=70, H=2, G=G, N=64, P=48, R=R, chunk_size=16, dtype=torch.float32,
                                 device=device, seed=5000 + seed)
            ref_inputs = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in inputs.items()}
            golden = bwd_fwd_reference(**ref_inputs, compute_dtype=torch.float64)
            bench = bwd_fwd_reference(**ref_inputs, compute_dtype=torch.float32)
            if args.recurrence:
                got = bwd_fwd_recurrent_reference(**ref_inputs, compute_dtype=torch.float32)
            else:
                got = api.bwd_fwd(**inputs, output_dtype=torch.float32, impl="production", config=config)
            got = tuple(x.cpu() if x is not None else None for x in got)
            checks = check_outputs(got, golden, bench, torch.float32, torch.float32)
            for c in checks:
                if c.mere is None:
                    continue
                record = dict(config=name, seed=seed, output=c.name, mere=c.mere / (2 * c.mere_bench + 1e-6),
                              mare=c.mare / (10 * c.mare_bench + 1e-5))
                if c.name == "dmimo_o":
                    x, g = got[2].double(), golden[2]
                    rel = ((x - g).abs() / (g.abs() + 1e-6)).flatten()
                    record["worst_share"] = (rel.max() / rel.sum()).item()
                    record["worst_golden_over_rms"] = (g.flatten()[rel.argmax()].abs() / g.pow(2).mean().sqrt()).item()
                records.append(record)
    print(f"exp: {exp_label}; {args.seeds} seeds; ratio to the bound (1.0 = at it): worst / median / seeds over 1")
    print(f"{'config':20s} {'output':8s} {'MERE':>26s} {'MARE':>26s}   dmimo_o: worst element's share of the "
          "worst seed's MERE, its |g| / rms(g)")
    keys = sorted({(r["config"], r["output"]) for r in records}, key=lambda k: (k[0], k[1]))
    for config, output in keys:
        rows = [r for r in records if r["config"] == config and r["output"] == output]
        cells = []
        for metric in ("mere", "mare"):
            values = [r[metric] for r in rows]
            cells.append(f"{max(values):8.3f} / {statistics.median(values):6.3f} / {sum(v > 1 for v in values):3d}")
        extra = ""
        if output == "dmimo_o":
            worst = max(rows, key=lambda r: r["mere"])
            extra = f"   {worst['worst_share']:.2f}, {worst['worst_golden_over_rms']:.1e} (seed {worst['seed']})"
        print(f"{config:20s} {output:8s} {cells[0]:>26s} {cells[1]:>26s}{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(exp=exp_label, seeds=args.seeds, records=records), f, indent=1)


if __name__ == "__main__":
    main()
