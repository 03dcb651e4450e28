"""Run one official case a few times so that Nsight Compute can profile its kernels.

    ncu --clock-control none --kernel-name regex:_kernel --launch-skip 4 --launch-count 4 \
        python3 benchmarks/profile_gpu.py --case N128_P64_R4_C16 --impl production --calls 3
"""
import argparse
import dataclasses
import os
import sys

import torch

from mamba3_mimo.api import bwd_fwd
from mamba3_mimo.bench import parse_case
from mamba3_mimo.inputs import make_inputs
from mamba3_mimo.ops.production import choose_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from aot_report import parse_config  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--case", default="N128_P64_R4_C16")
parser.add_argument("--impl", default="production")
parser.add_argument("--calls", type=int, default=3)
parser.add_argument("--config", help="ScanConfig fields key=value,... that replace the dispatcher's (production)")
args = parser.parse_args()
shape = parse_case(args.case)
inputs = make_inputs(B=4, S=2048, H=16, G=1, **shape, dtype=torch.bfloat16, z=True, d=True, device="cuda", seed=0)
config = None
if args.config:
    config = dataclasses.replace(
        choose_config(B=4, H=16, S=2048, num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                      has_z=True, **shape),
        **parse_config(args.config))
for _ in range(args.calls):
    bwd_fwd(**inputs, output_dtype=torch.bfloat16, impl=args.impl, **({"config": config} if config else {}))
torch.cuda.synchronize()
print("done", args.case, args.impl)
