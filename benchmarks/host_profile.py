"""Host cost of one bwd_fwd call on the GPU: where the microseconds go before the kernels run.

    python benchmarks/host_profile.py --case N128_P64_R1_C64 [--no-z]

Prints the host time per call (launches are asynchronous, so the time a call takes to return is its
host work while the GPU keeps up), the device time per call from back-to-back calls, and a cProfile
of the host work (top functions by own time).
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from mamba3_mimo.api import bwd_fwd
from mamba3_mimo.bench import parse_case
from mamba3_mimo.inputs import make_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="N128_P64_R1_C64")
    parser.add_argument("--no-z", action="store_true")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    inputs = make_inputs(B=4, S=2048, H=16, G=1, **parse_case(args.case), dtype=torch.bfloat16, z=not args.no_z,
                         d=True, device=torch.device("cuda"), seed=0)

    def call():
        return bwd_fwd(**inputs, output_dtype=torch.bfloat16)

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    host = []
    for _ in range(args.calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        host.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - start) / args.calls
    print(f"{args.case} Z {'off' if args.no_z else 'on'}: host per call median {statistics.median(host) * 1e6:.0f} us "
          f"(p10 {sorted(host)[len(host) // 10] * 1e6:.0f}, p90 {sorted(host)[9 * len(host) // 10] * 1e6:.0f}); "
          f"back-to-back {back_to_back * 1e6:.0f} us per call")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(50):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
