"""Host cost of one bwd_fwd call on the GPU: where the microseconds go before the kernels run.

    python benchmarks/host_profile.py --case N128_P64_R1_C64 [--no-z] [--cprofile]

Prints, for one process:
- the host time per call (launches are asynchronous, so the time a call takes to return is its host
  work while the GPU keeps up; a production call after the first of its key is a replay of the recorded
  launches, ops/launch.py), and the time per call of back-to-back calls;
- the same host time with every launch through Triton's JIT (MAMBA3_MIMO_JIT_LAUNCH=1), without launch
  plans (no replay, every launch builds its full key), and with the validation cache cleared before each
  call, for comparison with ops/launch.py and api.validate's cache;
- the phases of a call, by wrapping the functions that api.bwd_fwd and production_bwd_fwd call (in check
  mode, so that the wrappers run);
- every Triton launch of one call replayed three ways: through the JIT (`kernel[grid](...)`), the JIT's
  argument binder alone, and the compiled kernel's launcher called directly (what ops/launch.py does);
- with --cprofile, a cProfile of the host work (top functions by own time).
"""

import argparse
import cProfile
import functools
import os
import pstats
import statistics
import time

import torch
import triton.runtime.jit as jit

import mamba3_mimo.api as api
import mamba3_mimo.ops.production as production
from mamba3_mimo.bench import parse_case
from mamba3_mimo.inputs import make_inputs


def host_samples(fn, calls):
    """Host seconds of each of ``calls`` calls of fn."""
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return samples


def median_us(fn, calls):
    return statistics.median(host_samples(fn, calls)) * 1e6


def with_jit_launches(fn):
    os.environ["MAMBA3_MIMO_JIT_LAUNCH"] = "1"
    try:
        return fn()
    finally:
        del os.environ["MAMBA3_MIMO_JIT_LAUNCH"]


def print_host_per_call(label, call, calls):
    host = sorted(host_samples(call, calls))
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - start) / calls

    def uncached():
        api._VALIDATED.clear()
        return call()
    jit_us = with_jit_launches(lambda: median_us(call, calls))
    plan_key = api.launch_plan_key
    api.launch_plan_key = lambda *args: None
    try:
        no_plan_us = median_us(call, calls)
    finally:
        api.launch_plan_key = plan_key
    p10, p90 = host[len(host) // 10] * 1e6, host[9 * len(host) // 10] * 1e6
    print(f"{label}: host per call median {statistics.median(host) * 1e6:.0f} us (p10 {p10:.0f}, p90 {p90:.0f}); "
          f"back-to-back {back_to_back * 1e6:.0f} us per call; "
          f"through the JIT {jit_us:.0f} us, without launch plans {no_plan_us:.0f} us, "
          f"without the validation cache {median_us(uncached, calls):.0f} us")


def print_phases(call, calls):
    """Host us per call of each function the two entry points call (module-level names, wrapped).

    In check mode (MAMBA3_MIMO_CHECK_PLAN=1), so that every call runs its wrappers instead of replaying the
    recorded call (ops/launch.py); the checks add a little to each phase."""
    spent = {}

    def timed(module, name):
        original = getattr(module, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent.setdefault(name, []).append(time.perf_counter() - start)
        setattr(module, name, wrapper)
        return original

    restore = []
    for module, names in ((api, ("_validate", "launch_plan_key", "production_bwd_fwd", "dot_operands", "_contiguous")),
                          (production, ("choose_config", "token_tables", "chunk_local_states", "segment_entry_states",
                                        "chunk_states", "segment_end_states", "chunk_scan", "gate_grads",
                                        "chunk_output", "sum_group_partials"))):
        for name in names:
            if hasattr(module, name):
                restore.append((module, name, timed(module, name)))
    os.environ["MAMBA3_MIMO_CHECK_PLAN"] = "1"
    try:
        host_samples(call, calls)
    finally:
        del os.environ["MAMBA3_MIMO_CHECK_PLAN"]
        for module, name, original in restore:
            setattr(module, name, original)
    for name, samples in spent.items():
        print(f"  {name:<22} {sum(samples) / calls * 1e6:7.1f} us per call ({len(samples) // calls} calls)")


def print_launch_costs(call, angles):
    """Every Triton launch of one call, replayed through the JIT, its binder alone, and directly."""
    launches = []
    original_run = jit.JITFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        launches.append((self, args, kwargs, grid, kernel))
        return kernel
    jit.JITFunction.run = recording_run
    try:
        with_jit_launches(call)  # cached launches skip JITFunction.run
    finally:
        jit.JITFunction.run = original_run
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream().cuda_stream
    for fn, args, kwargs, grid, kernel in launches:
        binder = fn.device_caches[device][4]
        bound = list(binder(*args, **kwargs)[0].values())
        grid_xyz = tuple(grid) + (1,) * (3 - len(grid))

        def direct():
            kernel.run(*grid_xyz, stream, kernel.function, kernel.packed_metadata, None, None, None, *bound)
        print(f"  launch {fn.__name__:<28} jit {median_us(lambda: fn[grid](*args, **kwargs), 100):6.1f} us, "
              f"binder {median_us(lambda: binder(*args, **kwargs), 100):6.1f} us, "
              f"direct {median_us(direct, 100):6.1f} us ({len(bound)} args)")
    print(f"  torch.cos {median_us(lambda: torch.cos(angles), 100):.1f} us, "
          f"torch.empty {median_us(lambda: torch.empty((4, 16, 2048, 64), device='cuda'), 100):.1f} us, "
          f"cuda.device context {median_us(functools.partial(enter_device, angles.device), 100):.1f} us")


def enter_device(device):
    with torch.cuda.device(device):
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="N128_P64_R1_C64")
    parser.add_argument("--no-z", action="store_true")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cprofile", action="store_true", help="also a cProfile of 50 calls")
    args = parser.parse_args()
    inputs = make_inputs(B=4, S=2048, H=16, G=1, **parse_case(args.case), dtype=torch.bfloat16, z=not args.no_z,
                         d=True, device=torch.device("cuda"), seed=0)

    def call():
        return api.bwd_fwd(**inputs, output_dtype=torch.bfloat16)

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    print_host_per_call(f"{args.case} Z {'off' if args.no_z else 'on'}", call, args.calls)
    print_phases(call, args.calls)
    print_launch_costs(call, inputs["angles"])
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(50):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
