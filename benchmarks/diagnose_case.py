"""One small GPU case against the float64 reference, for fault hunting under compute-sanitizer.

    python benchmarks/diagnose_case.py --impl stage0 --warps 8
The default shape is smoke case 7 (N128_P32_R4_C16 at B=1, S=256, H=2), where stage0 faulted.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mamba3_mimo.accuracy import check_outputs, format_checks  # noqa: E402
from mamba3_mimo.api import bwd_fwd  # noqa: E402
from mamba3_mimo.inputs import make_inputs  # noqa: E402
from mamba3_mimo.ops import stage0  # noqa: E402
from mamba3_mimo.reference import bwd_fwd_reference  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--impl", default="stage0")
parser.add_argument("--warps", type=int, default=8, help="stage0 serial-scan warps")
parser.add_argument("--shape", default="1,256,2,128,32,4,16", help="B,S,H,N,P,R,C")
parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
args = parser.parse_args()
stage0.SERIAL_SCAN_WARPS = args.warps
B, S, H, N, P, R, C = (int(x) for x in args.shape.split(","))
dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
inputs = make_inputs(B=B, S=S, H=H, G=1, N=N, P=P, R=R, chunk_size=C, dtype=dtype, z=True, d=True,
                     device="cuda", seed=7)
golden = bwd_fwd_reference(**inputs, compute_dtype=torch.float64)
bench = bwd_fwd_reference(**inputs, compute_dtype=dtype)
out = bwd_fwd(**inputs, output_dtype=dtype, impl=args.impl)
torch.cuda.synchronize()
checks = check_outputs(out, golden, bench, dtype, dtype)
ok = all(c.passed for c in checks)
print(format_checks(checks))
print(f"{args.impl} warps={args.warps} shape={args.shape} {args.dtype}: {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
