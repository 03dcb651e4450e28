"""Where a bwd_fwd call's host time goes, phase by phase, and what each Triton launch costs.

    python benchmarks/host_phases.py --case N128_P64_R1_C64 [--no-z]

Times (host us, median of --calls) the phases of one call by wrapping the functions that api.bwd_fwd and
production_bwd_fwd call, then replays every Triton launch of one call three ways: through the JIT
(`kernel[grid](...)`), the JIT's argument binder alone, and the compiled kernel's launcher called directly
(what ops/launch.py does once a specialization is known).  Also times whole calls through the JIT
(MAMBA3_MIMO_JIT_LAUNCH=1) and without the validation cache, for comparison in one process.
"""

import argparse
import functools
import os
import statistics
import time

import torch
import triton.runtime.jit as jit

import mamba3_mimo.api as api
import mamba3_mimo.ops.production as production
from mamba3_mimo.bench import parse_case
from mamba3_mimo.inputs import make_inputs


def median_us(fn, calls):
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="N128_P64_R1_C64")
    parser.add_argument("--no-z", action="store_true")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    inputs = make_inputs(B=4, S=2048, H=16, G=1, **parse_case(args.case), dtype=torch.bfloat16, z=not args.no_z,
                         d=True, device=torch.device("cuda"), seed=0)

    def call():
        return api.bwd_fwd(**inputs, output_dtype=torch.bfloat16)

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    total = median_us(call, args.calls)

    # The same calls with the JIT's launch path and without the validation cache, in this process.
    def call_uncached():
        api._VALIDATED.clear()
        return call()
    os.environ["MAMBA3_MIMO_JIT_LAUNCH"] = "1"
    jit_total = median_us(call, args.calls)
    uncached_total = median_us(call_uncached, args.calls)
    del os.environ["MAMBA3_MIMO_JIT_LAUNCH"]

    # Phases: wrap the module-level names the two entry functions call.
    spent = {}

    def timed(module, name):
        original = getattr(module, name)

        @functools.wraps(original)
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                spent.setdefault(name, []).append(time.perf_counter() - start)
        setattr(module, name, wrapper)
        return original

    restore = []
    for module, names in ((api, ("validate", "production_bwd_fwd", "dot_operands", "_contiguous")),
                          (production, ("choose_config", "token_tables", "chunk_local_states", "segment_entry_states",
                                        "chunk_states", "segment_end_states", "chunk_scan", "gate_grads",
                                        "chunk_output", "sum_group_partials"))):
        for name in names:
            if hasattr(module, name):
                restore.append((module, name, timed(module, name)))
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    for module, name, original in restore:
        setattr(module, name, original)
    print(f"{args.case} Z {'off' if args.no_z else 'on'}: host per call median {total:.0f} us; through the JIT "
          f"{jit_total:.0f} us, and without the validation cache {uncached_total:.0f} us")
    calls = args.calls
    for name, samples in spent.items():
        per_call = sum(samples) / calls * 1e6
        print(f"  {name:<22} {per_call:7.1f} us per call ({len(samples) // calls} calls)")

    # Every Triton launch of one call, replayed three ways.
    launches = []
    original_run = jit.JITFunction.run

    def recording_run(self, *a, grid, warmup, **kw):
        kernel = original_run(self, *a, grid=grid, warmup=warmup, **kw)
        launches.append((self, a, kw, grid, kernel))
        return kernel
    jit.JITFunction.run = recording_run
    os.environ["MAMBA3_MIMO_JIT_LAUNCH"] = "1"  # cached launches skip JITFunction.run
    call()
    del os.environ["MAMBA3_MIMO_JIT_LAUNCH"]
    jit.JITFunction.run = original_run
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream().cuda_stream
    for fn, a, kw, grid, kernel in launches:
        binder = fn.device_caches[device][4]
        bound = list(binder(*a, **kw)[0].values())
        via_jit = median_us(lambda: fn[grid](*a, **kw), 100)
        binder_only = median_us(lambda: binder(*a, **kw), 100)
        g = tuple(grid) + (1,) * (3 - len(grid))

        def direct():
            kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *bound)
        direct_us = median_us(direct, 100)
        print(f"  launch {fn.__name__:<28} jit {via_jit:6.1f} us, binder {binder_only:6.1f} us, "
              f"direct {direct_us:6.1f} us ({len(bound)} args)")
    angles = inputs["angles"]
    print(f"  torch.cos {median_us(lambda: torch.cos(angles), 100):.1f} us, "
          f"torch.empty {median_us(lambda: torch.empty((4, 16, 2048, 64), device='cuda'), 100):.1f} us, "
          f"cuda.device context {median_us(functools.partial(enter_device, angles.device), 100):.1f} us")


def enter_device(device):
    with torch.cuda.device(device):
        pass


if __name__ == "__main__":
    main()
