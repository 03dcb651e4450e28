"""Bytes each production kernel touches on an official shape, and the bandwidth that implies, without a GPU.

    python benchmarks/traffic_report.py                              # official grid, Z on, dispatcher configs
    python benchmarks/traffic_report.py --cases N128_P64_R4_C16 --config d_in_gate=1 --no-z
    python benchmarks/traffic_report.py --breakdown benchmarks/results/<sweep or breakdown>.json
    python benchmarks/traffic_report.py --cases N256_P64_R4_C8 --tensors     # and each kernel's tensors
    python benchmarks/traffic_report.py --ceiling 4.27,3,2                     # the speedup the bytes alone allow

The launches of one bf16 call are captured as ``aot_report.py`` captures them (uninitialized CPU tensors,
nothing runs), and each launch's tensor arguments are counted once each, deduplicated by view (the host
passes aliases for the inputs a specialization does not read).  chunk_scan / chunk_output with local states
read ``states`` and write back the chunks of every segment but the first: that rewrite is added.  This is a
model of the design's traffic, not a measurement: a tensor another kernel just wrote may still sit in the
50 MB L2, and a tensor a kernel reads in part counts whole.  With ``--breakdown`` (a JSON whose records hold
``breakdown_us`` per kernel, from ``python -m mamba3_mimo.bench --breakdown`` or ``sweep_cases.sh``) each
kernel's bytes are divided by its measured time, for the record of the dispatcher's config of each case.
"""

import argparse
import collections
import dataclasses
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import aot_report  # noqa: E402
from mamba3_mimo import api  # noqa: E402
from mamba3_mimo.bench import OFFICIAL_CASES, TILELANG_US, hbm_floor_bytes, parse_case  # noqa: E402
from mamba3_mimo.ops.production import choose_config  # noqa: E402

SHAPE = dict(B=4, S=2048, H=16, G=1)
COPY_TBS = 4.27  # the anchor file's copy bandwidth (read + write) on the H200


def launch_tensors(name, args, kwargs):
    """{argument name: bytes} of the distinct tensors one launch takes, plus the local-state rewrite of ``states``
    (as ``states_ptr (rewrite)``)."""
    named = dict(zip(aot_report.KERNELS[name].arg_names, args))
    seen, tensors = set(), {}
    for arg_name, arg in named.items():
        # By view, not storage: cos / sin (and gamma / trap_scale) share one allocation.
        if torch.is_tensor(arg) and (arg.data_ptr(), arg.numel(), arg.dtype) not in seen:
            seen.add((arg.data_ptr(), arg.numel(), arg.dtype))
            tensors[arg_name] = arg.numel() * arg.element_size()
    if kwargs.get("ADD_ENTRY"):  # the output stages with local states
        states, n_segments = named["states_ptr"], named["N_SEGMENTS"]
        tensors["states_ptr (rewrite)"] = states.numel() * states.element_size() * (n_segments - 1) // n_segments
    return tensors


def case_traffic(case, overrides, has_z):
    """{kernel name: bytes} summed over the launches of one call, {(kernel name, argument name): bytes} likewise,
    the HBM floor in bytes, and the config."""
    shape = parse_case(case)
    config = dataclasses.replace(choose_config(num_sms=132, has_z=has_z, B=SHAPE["B"], H=SHAPE["H"], S=SHAPE["S"],
                                               **shape), **overrides)
    inputs = aot_report.empty_inputs(dtype=torch.bfloat16, z=has_z, **SHAPE, **shape)
    launches = aot_report.capture_launches(
        lambda: api.bwd_fwd(**inputs, output_dtype=torch.bfloat16, impl="production", config=config))
    per_kernel, per_tensor = collections.Counter(), collections.Counter()
    for name, args, kwargs in launches:
        for arg_name, nbytes in launch_tensors(name, args, kwargs).items():
            per_kernel[name] += nbytes
            per_tensor[name, arg_name] += nbytes
    return per_kernel, per_tensor, hbm_floor_bytes(inputs, has_z, torch.bfloat16), config


def same_config(recorded, config):
    """Whether a record's config dict is ``config``; fields added since the record was written must hold their
    defaults."""
    return all(recorded.get(field.name, field.default) == getattr(config, field.name)
               for field in dataclasses.fields(config))


def json_records(data):
    """The records of a bench / sweep JSON, or of a merged one whose ``groups`` map names to record lists."""
    if "records" in data:
        return data["records"]
    return [record for records in data["groups"].values() for record in records]


# The Gluon kernels do the Triton ones' work on the GPU; the capture (no GPU) records the Triton launches.
GLUON_STANDS_FOR = {"gluon_scan": "state_scan", "gluon_gate_grads": "gate_grads"}


def measured_times(path, case, config):
    """breakdown_us of the record of ``case`` run with ``config`` in a bench / sweep JSON (None if absent), keyed by
    the captured kernels' names."""
    for record in json_records(json.load(open(path))):
        if record.get("case") == case and record.get("breakdown_us") and same_config(record.get("config", {}), config):
            times = {}
            for name, us in record["breakdown_us"].items():
                name = name.strip("_").removesuffix("_kernel")
                times[GLUON_STANDS_FOR.get(name, name)] = us
            return times
    return None


def print_ceiling(cases, overrides, has_z, rates):
    """Per case and geometric mean: TileLang's time over the time the design's bytes (and the floor's) take at each
    rate in TB/s.  A bound from bytes alone: latency, instructions and launches only lower it."""
    column = 1 if not has_z else 0
    header = "  ".join(f"{'@' + format(rate, 'g') + ' TB/s':>11}" for rate in rates)
    print(f"{'case':<17} {'TileLang us':>11} {'design MB':>9} {'floor MB':>8}  {header}  (x TileLang; floor)")
    logs = collections.defaultdict(float)
    for case in cases:
        per_kernel, _, floor, _ = case_traffic(case, overrides, has_z)
        design = sum(per_kernel.values())
        tilelang = TILELANG_US[case][column]
        cells = []
        for rate in rates:
            design_x, floor_x = tilelang / (design / rate / 1e6), tilelang / (floor / rate / 1e6)
            logs[rate] += math.log(design_x) / len(cases)
            logs["floor", rate] += math.log(floor_x) / len(cases)
            cells.append(f"{design_x:>5.2f}; {floor_x:>4.1f}")
        print(f"{case:<17} {tilelang:>11} {design / 1e6:>9.0f} {floor / 1e6:>8.0f}  " + "  ".join(cells))
    geomeans = "  ".join(f"{math.exp(logs[rate]):>5.2f}; {math.exp(logs['floor', rate]):>4.1f}" for rate in rates)
    print(f"{'geometric mean':<48}  {geomeans}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(OFFICIAL_CASES))
    parser.add_argument("--config", default="", help="ScanConfig fields key=value,... replacing the dispatcher's")
    parser.add_argument("--no-z", action="store_true")
    parser.add_argument("--breakdown", help="a JSON with breakdown_us records (bench --breakdown, sweep_cases.sh)")
    parser.add_argument("--tensors", action="store_true", help="also each kernel's tensors of 1 MB or more")
    parser.add_argument("--ceiling", help="TB/s,...: instead of the table, the speedup over the anchor's TileLang "
                        "times if every kernel moved the design's bytes at each rate and did nothing else")
    args = parser.parse_args(argv)
    overrides = aot_report.parse_config(args.config) if args.config else {}
    aot_report.compile_as_cuda()
    if args.ceiling:
        return print_ceiling(args.cases, overrides, not args.no_z, [float(x) for x in args.ceiling.split(",")])
    print(f"{'case':<17} {'kernel':<16} {'MB':>7} {'us':>7} {'TB/s':>6}")
    for case in args.cases:
        per_kernel, per_tensor, floor, config = case_traffic(case, overrides, not args.no_z)
        times = measured_times(args.breakdown, case, config) if args.breakdown else None
        for name, nbytes in per_kernel.most_common():
            us = times.get(name) if times else None
            rate = f"{nbytes / (us * 1e-6) / 1e12:>6.2f}" if us else f"{'':>6}"
            print(f"{case:<17} {name:<16} {nbytes / 1e6:>7.1f} {us or 0:>7.0f} {rate}")
            listed = [f"{arg_name.removesuffix('_ptr')} {tensor_bytes / 1e6:.1f}"
                      for (kernel, arg_name), tensor_bytes in per_tensor.most_common()
                      if kernel == name and tensor_bytes >= 1e6]
            if args.tensors and listed:
                print("    " + "  ".join(listed))
        total = sum(per_kernel.values())
        print(f"{case:<17} {'all kernels':<16} {total / 1e6:>7.1f}   = {total / floor:.2f}x the floor's "
              f"{floor / 1e6:.0f} MB; at {COPY_TBS} TB/s {total / COPY_TBS / 1e6:.0f} us against the floor's "
              f"{floor / COPY_TBS / 1e6:.0f}")


if __name__ == "__main__":
    main()
