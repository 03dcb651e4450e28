"""Benchmark of bwd_fwd on the GPU: time, HBM floor, speedups, compiled resources.

    python -m mamba3_mimo.bench                     # official 11 cases, Z on, bf16, output bf16
    python -m mamba3_mimo.bench --no-z --output-dtype fp32 --impl production
    python -m mamba3_mimo.bench --cases N128_P64_R4_C16 --sweep   # time candidate production configs

Protocol (SPEC section 9): ``triton.testing.do_bench`` medians of warm calls (eager: the best of two
medians, as the TileLang anchor was measured; also the median of CUDA-graph replays),
cycling over several input sets so that the inputs come from HBM, not L2; the
floor is each required input read once and each output written once (segsum
excluded, it is derivable from da_cs) at the copy bandwidth measured in the
same run.
"""

import argparse
import datetime
import itertools
import json
import math
import os
import subprocess
import sys
import time

import torch

OFFICIAL_CASES = ("N16_P64_R4_C8", "N32_P64_R4_C16", "N64_P64_R4_C16", "N128_P64_R4_C16", "N256_P64_R4_C8",
                  "N64_P128_R4_C16", "N128_P32_R4_C16", "N128_P128_R4_C8", "N128_P64_R8_C8", "N128_P64_R2_C32",
                  "N128_P64_R1_C64")
QUICK_CASES = ("N16_P64_R4_C8", "N256_P64_R4_C8", "N64_P128_R4_C16", "N128_P64_R2_C32", "N128_P64_R1_C64")
# Upstream TileLang bwd_fwd on one H200 (microseconds), from shared/anchor/tilelang_bwd_fwd_h200.md:
# B=4, S=2048, H=16, G=1, bf16, D on; (Z on, Z off).
TILELANG_US = {
    "N16_P64_R4_C8": (1061, 530), "N32_P64_R4_C16": (1058, 611), "N64_P64_R4_C16": (1220, 695),
    "N128_P64_R4_C16": (1459, 979), "N256_P64_R4_C8": (2377, 1955), "N64_P128_R4_C16": (1373, 996),
    "N128_P32_R4_C16": (1146, 736), "N128_P128_R4_C8": (2340, 1891), "N128_P64_R8_C8": (2775, 1812),
    "N128_P64_R2_C32": (771, 516), "N128_P64_R1_C64": (495, 340),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_case(name):
    """'N128_P64_R4_C16' -> dict(N=128, P=64, R=4, chunk_size=16)."""
    fields = dict((part[0], int(part[1:])) for part in name.split("_"))
    return dict(N=fields["N"], P=fields["P"], R=fields["R"], chunk_size=fields["C"])


def hbm_floor_bytes(inputs, has_z, output_dtype):
    """Bytes of every required input read once and every output written once."""
    names = ["dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "angles", "da_cs", "da_cs_rev", "dt",
             "trap", "d"] + (["z", "mimo_z"] if has_z else [])
    read = sum(inputs[n].numel() * inputs[n].element_size() for n in names if inputs[n] is not None)
    q, v = inputs["q"], inputs["v"]
    B, S, R, _, N = q.shape
    H, P = v.shape[2], v.shape[3]
    nch = math.ceil(S / inputs["chunk_size"])
    out_elems = B * H * nch * N * P + B * H * S * R * R + B * H * R * P
    if has_z:
        out_elems += B * H * R * P + B * S * H * P
    return read + out_elems * torch.empty((), dtype=output_dtype).element_size()


def flop_count(B, S, H, N, P, R, chunk_size):
    """Matrix-product FLOPs: scores, intra-chunk output, q~ . state, state update, per chunk."""
    rows = chunk_size * R
    nch = math.ceil(S / chunk_size)
    per_chunk = 2 * rows * rows * N + 2 * rows * rows * P + 2 * rows * N * P + 2 * rows * N * P
    return B * H * nch * per_chunk


def copy_bandwidth(device, nbytes=2 << 30):
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import triton.testing

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def jit_kernels():
    """Every Triton kernel of both implementations by short name (the bench and benchmarks/aot_report.py)."""
    from .ops import (chunk_output, chunk_scan, chunk_state, gate_grads, gluon_gate_grads, gluon_state_scan,
                      group_sum, stage0, state_passing, token_tables)

    return {"state_scan": chunk_state._state_scan_kernel, "gluon_scan": gluon_state_scan._gluon_scan_kernel,
            "chunk_output": chunk_output._chunk_output_kernel,
            "chunk_scan": chunk_scan._chunk_scan_kernel, "chunk_scan_gate": chunk_scan._chunk_scan_gate_kernel,
            "gate_grads": gate_grads._gate_grads_kernel, "gluon_gate": gluon_gate_grads._gluon_gate_grads_kernel,
            "token_tables": token_tables._token_tables_kernel,
            "flat_token_tables": token_tables._flat_token_tables_kernel,
            "segment_entry": state_passing._segment_entry_kernel,
            "segment_entry_scan": state_passing._segment_entry_scan_kernel, "group_sum": group_sum._group_sum_kernel,
            "rotary": stage0._rotary_kernel, "qk_dot": stage0._qk_dot_kernel,
            "serial_scan": stage0._serial_scan_kernel}


def _compiled_variants(jit_fn):
    """All compiled kernels of a JITFunction, across devices (triton 3.x cache layout)."""
    found = []
    for device_cache in getattr(jit_fn, "device_caches", {}).values():
        cache = device_cache[0] if isinstance(device_cache, tuple) else device_cache
        found.extend(cache.values())
    return found


def kernel_resources(before):
    """Shared memory, registers and spills of the kernels compiled since ``before`` (a snapshot)."""
    report = {}
    for name, fn in jit_kernels().items():
        new = [k for k in _compiled_variants(fn) if id(k) not in before]
        for kernel in new:
            shared = int(getattr(kernel.metadata, "shared", 0))
            entry = report.setdefault(name, dict(shared_bytes=0, regs=0, spills=0))
            entry["shared_bytes"] = max(entry["shared_bytes"], shared)
            entry["regs"] = max(entry["regs"], int(getattr(kernel, "n_regs", 0) or 0))
            entry["spills"] = max(entry["spills"], int(getattr(kernel, "n_spills", 0) or 0))
    return report


def _snapshot():
    return {id(k) for fn in jit_kernels().values() for k in _compiled_variants(fn)}


def graph_time(input_sets, impl, output_dtype, config=None, warmup=25, rep=200):
    """Median ms of one call replayed from a CUDA graph (one graph per input set, cycled).

    The eager time of ``time_impl`` includes the host work of a call (validation, allocation,
    Triton's launcher); when that exceeds the device time, the eager median measures the host.
    A graph replay has almost no host cost, so this is the device time of the call.
    """
    import triton.testing

    from .api import bwd_fwd

    def call(inputs):
        return bwd_fwd(**inputs, output_dtype=output_dtype, impl=impl, config=config)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for inputs in input_sets:
            call(inputs)
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for inputs in input_sets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(inputs)
        graphs.append(graph)
    cycle = itertools.cycle(graphs)
    ms = triton.testing.do_bench(lambda: next(cycle).replay(), warmup=warmup, rep=rep, return_mode="median")
    del graphs
    return ms


# Seconds of back-to-back calls before the eager timing, and the eager medians taken (the best is kept).
SETTLE_S = 0.3
EAGER_RUNS = 2


def time_impl(input_sets, impl, output_dtype, config=None, warmup=25, rep=200):
    """(first-call ms, eager median ms, graph-replay median ms, kernel resources) of one implementation."""
    import triton.testing

    from .api import bwd_fwd

    before = _snapshot()
    torch.cuda.synchronize()
    start = time.perf_counter()
    bwd_fwd(**input_sets[0], output_dtype=output_dtype, impl=impl, config=config)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    resources = kernel_resources(before)
    cycle = itertools.cycle(input_sets)

    def call():
        return bwd_fwd(**next(cycle), output_dtype=output_dtype, impl=impl, config=config)

    # After a compile (seconds with the GPU idle) do_bench's 25 ms warm-up is too short: an eager median
    # taken right after one came out 1.4x the same case's in a warm process (N128_P64_R4_C16 592 vs 413 us).
    settle_until = time.perf_counter() + SETTLE_S
    while time.perf_counter() < settle_until:
        call()
    torch.cuda.synchronize()
    # Best of two medians, as the TileLang anchor was taken: single eager medians of a small shape came out
    # 1.5-1.8x its graph time at random, once a run (docs/optimization.md section 17).
    ms = min(triton.testing.do_bench(call, warmup=warmup, rep=rep, return_mode="median") for _ in range(EAGER_RUNS))
    graph_ms = graph_time(input_sets, impl, output_dtype, config=config, warmup=warmup, rep=rep)
    return first_ms, ms, graph_ms, resources


def sweep_configs(B, S, H, N, P, R, chunk_size, num_sms, knob_names=None, has_z=True, half_tables=True):
    """Candidate production configs: the dispatcher's choice and one knob moved at a time.

    ``knob_names``: the ScanConfig fields to move (default: every knob below); a name of the form
    ``a+b`` moves a and b together (every pair of their values), and ``a=1:3`` gives a's values in that
    group (in place of its list below).  Moving ``split_gate`` starts from the
    dispatcher's config for that output stage (its warps, register cap and state schedule).
    """
    import dataclasses
    import itertools

    from .ops.production import ScanConfig, choose_config, gate_tokens_per_program

    nch = math.ceil(S / chunk_size)
    chosen = choose_config(B=B, H=H, S=S, N=N, P=P, R=R, chunk_size=chunk_size, num_sms=num_sms, has_z=has_z,
                           half_tables=half_tables)
    p_pow = max(16, 1 << (P - 1).bit_length())
    half_pow = max(16, 1 << (N // 2 - 1).bit_length())
    knobs = dict(
        n_segments=[n for n in (chosen.n_segments // 2, chosen.n_segments * 2, chosen.n_segments * 4)
                    if 1 <= n <= nch],
        block_p=[p for p in (16, 32, 64) if p <= p_pow],
        block_half=[n for n in (16, 32, 64) if n <= half_pow],
        num_warps=[2, 4, 8],
        out_block_p=[p for p in (32, 64, 128) if p <= p_pow],
        chunks_per_program=[1, 2, 4, 8],
        out_num_warps=[4, 8],
        ranks_per_step=[f for f in (2, 4) if f <= R and chunk_size * f <= 64],
        out_span_chunks=[m for m in (1, 2, 4) if chunk_size * m * R <= 128 and m <= nch],
        end_span_chunks=[m for m in (1, 2, 4) if chunk_size * m * R <= 128 and m <= nch],
        local_states=[False, True],
        split_gate=[False, True],
        out_max_registers=[0, 168],
        scan_max_registers=[0, 168, 128],
        gate_tokens=[32, 64, 128, 256, 512],
        state_span_chunks=[m for m in (1, 2, 4) if chunk_size * m * R <= 128 and m <= nch],
        gate_in_scan=[False, True],
        scan_prefetch=[False, True],
        end_scan_prefetch=[False, True],
        half_raw_y=[False, True],
        d_in_gate=[False, True],
        gate_tile_elements=[1024, 2048, 4096],
        gate_num_warps=[4, 8],
        scan_skip_unrotated=[False, True],
        flat_tables=[False, True],
        out_q_cast_early=[False, True],
        out_y_state_early=[False, True],
        out_defer_state_store=[False, True],
        out_defer_qk_dot=[False, True],
        out_token_weights=[False, True],
        out_early_mixing=[False, True],
        scan_half_rotation=[False, True],
        out_half_rotation=[False, True],
        gluon_scan=[False, True],
        gluon_gate=[False, True],
        gluon_segments=[0, 1, 2],
        pdl=[False, True],
        fold_one_scan=[False, True],
        angles_in_kernels=[False, True],
        scan_outputs=[False, True],
        scan_outputs_block_p=[0, 32, 64, 128],
        scan_outputs_ring_weights=[False, True],
        scan_outputs_weights_ahead=[False, True],
        scan_outputs_token_weights=[False, True],
        scan_outputs_gate=[False, True],
        scan_outputs_d_skip=[False, True],
    )
    groups = [{name: values} for name, values in knobs.items()]
    if knob_names is not None:
        groups = [dict(_knob_group(joined, knobs)) for joined in knob_names]
    candidates = {chosen}
    for group in groups:
        for values in itertools.product(*group.values()):
            overrides = dict(zip(group, values))
            base = chosen
            if "split_gate" in overrides:
                base = choose_config(B=B, H=H, S=S, N=N, P=P, R=R, chunk_size=chunk_size, num_sms=num_sms,
                                     split_gate=overrides.pop("split_gate"), has_z=has_z, half_tables=half_tables)
            try:
                candidate = dataclasses.replace(base, **overrides)
            except ValueError:
                continue
            # The one-pass schedule has no end-state scan: its span and loads are moot (the fused storing scan runs
            # one whatever local_states says).
            if candidate.local_states and not candidate.scan_outputs:
                candidate = dataclasses.replace(candidate, end_span_chunks=1, end_scan_prefetch=False)
            if not candidate.split_gate:  # the fused output stage has no gate_grads pass
                candidate = dataclasses.replace(candidate, gate_tokens=ScanConfig.gate_tokens, gate_in_scan=False)
            elif candidate.gate_in_scan:  # nor has chunk_scan applying the gate
                candidate = dataclasses.replace(candidate, gate_tokens=ScanConfig.gate_tokens)
            elif base.gate_in_scan:  # gate_grads back: the dispatcher's token range for it
                candidate = dataclasses.replace(candidate, gate_tokens=gate_tokens_per_program(
                    B=B, H=H, S=S, R=R, P=P, num_sms=num_sms))
            candidates.add(candidate)
    order = [f.name for f in dataclasses.fields(ScanConfig)]
    return chosen, sorted(candidates, key=lambda c: tuple(getattr(c, f) for f in order))


def _knob_group(joined, knobs):
    """(name, values) of each knob of ``a+b=v1:v2``: the values given (integers; 0 / 1 for the switches),
    else the knob's own list."""
    for item in joined.split("+"):
        name, _, given = item.partition("=")
        if name not in knobs:
            raise ValueError(f"unknown sweep knobs {[name]}; known: {sorted(knobs)}")
        if not given:
            yield name, knobs[name]
            continue
        try:
            values = [int(v) for v in given.split(":")]
        except ValueError:
            raise ValueError(f"sweep knob {name}: expected integer values separated by ':', got {given!r}") from None
        yield name, [bool(v) for v in values] if all(isinstance(v, bool) for v in knobs[name]) else values


def kernel_breakdown(inputs, impl, output_dtype, config=None, calls=5):
    """Device time of a call's kernels over ``calls`` calls, from the torch profiler.

    Returns (mean us per kernel name, mean us per launch in call order as [name, us] pairs or None): the
    second tells apart the launches of one kernel in a call (the two state-scan passes of the two-pass
    schedule), which the first sums.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from .api import bwd_fwd

    bwd_fwd(**inputs, output_dtype=output_dtype, impl=impl, config=config)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            bwd_fwd(**inputs, output_dtype=output_dtype, impl=impl, config=config)
        torch.cuda.synchronize()
    totals = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us:
            totals[event.key[:48]] = device_us / calls
    kernels = [(event.name[:48], event.time_range.start, event.time_range.elapsed_us())
               for event in prof.events() if event.device_type == DeviceType.CUDA]
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])), launch_sequence(kernels, calls)


def launch_sequence(kernels, calls):
    """One call's launches in order as [name, mean us] pairs, from ``calls`` alike calls' kernels.

    ``kernels``: (name, start us, duration us) of every kernel the calls ran, in any order.  None where the
    calls did not launch the same kernels in the same order (then a position means nothing).
    """
    ordered = sorted(kernels, key=lambda kernel: kernel[1])
    if not ordered or len(ordered) % calls:
        return None
    per_call = len(ordered) // calls
    names = [name for name, _, _ in ordered[:per_call]]
    sums = [0.0] * per_call
    for index, (name, _, us) in enumerate(ordered):
        if name != names[index % per_call]:
            return None
        sums[index % per_call] += us
    return [[name, total / calls] for name, total in zip(names, sums)]


def _git_commit():
    # The device machine gets a copy of the working tree whose .git may lag; the caller says.
    if os.environ.get("MAMBA3_COMMIT"):
        return os.environ["MAMBA3_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args):
    from .inputs import make_inputs
    from .ops.production import choose_config, rotation_table_dtype

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    output_dtype = DTYPES[args.output_dtype]
    has_z = not args.no_z
    # The dispatcher's choice depends on the rotation tables' dtype (bf16 activations: fp16 tables).
    half_tables = rotation_table_dtype(DTYPES[args.dtype]) == torch.float16
    impls = args.impl.split(",")
    bandwidth = copy_bandwidth(device)
    print(f"# {props.name}, {props.multi_processor_count} SMs, copy bandwidth {bandwidth / 1e12:.2f} TB/s",
          file=sys.stderr)
    records = []
    for index, name in enumerate(args.cases):
        shape = parse_case(name)
        sizes = dict(B=args.B, S=args.S, H=args.H, G=args.G, **shape)
        input_sets = [make_inputs(**sizes, dtype=DTYPES[args.dtype], z=has_z, d=True, device=device, seed=seed)
                      for seed in range(args.input_sets)]
        floor_ms = hbm_floor_bytes(input_sets[0], has_z, output_dtype) / bandwidth * 1e3
        flops = flop_count(args.B, args.S, args.H, shape["N"], shape["P"], shape["R"], shape["chunk_size"])
        runs = [(impl, None) for impl in impls]
        if args.sweep:
            _, configs = sweep_configs(args.B, args.S, args.H, shape["N"], shape["P"], shape["R"],
                                       shape["chunk_size"], props.multi_processor_count,
                                       knob_names=args.knobs.split(",") if args.knobs else None, has_z=has_z,
                                       half_tables=half_tables)
            runs = [("production", config) for config in configs] + [(i, None) for i in impls if i != "production"]
        case_records = []
        for impl, config in runs:
            if args.sweep:  # a candidate that faults leaves the context unusable: say which one it was
                print(f"[{index + 1}/{len(args.cases)}] {name} {impl} {config}: starting", file=sys.stderr, flush=True)
            try:
                first_ms, ms, graph_ms, resources = time_impl(input_sets, impl, output_dtype, config=config)
            except Exception as exc:  # a candidate that does not compile or launch is reported, not fatal
                if not args.sweep:
                    raise
                print(f"[{index + 1}/{len(args.cases)}] {name} {impl} {config}: FAILED {exc!r:.300}", file=sys.stderr)
                continue
            if impl == "production" and config is None:
                config = choose_config(B=args.B, H=args.H, S=args.S, num_sms=props.multi_processor_count,
                                       has_z=has_z, half_tables=half_tables, hopper=props.major == 9, **shape)
            record = dict(case=name, impl=impl, z=has_z, output_dtype=args.output_dtype, dtype=args.dtype,
                          B=args.B, S=args.S, H=args.H, G=args.G, ms=ms, graph_ms=graph_ms, floor_ms=floor_ms,
                          floor_ratio=ms / floor_ms, tflops=flops / (ms * 1e-3) / 1e12, first_call_ms=first_ms,
                          kernels=resources, config=None if config is None else vars(config))
            anchor = TILELANG_US.get(name)
            if anchor and (args.B, args.S, args.H, args.G, args.dtype) == (4, 2048, 16, 1, "bf16"):
                record["tilelang_ms"] = anchor[0 if has_z else 1] / 1e3
                record["speedup_vs_tilelang"] = record["tilelang_ms"] / ms
                record["graph_speedup_vs_tilelang"] = record["tilelang_ms"] / graph_ms
            if args.breakdown:
                record["breakdown_us"], record["launches_us"] = kernel_breakdown(input_sets[0], impl, output_dtype,
                                                                                 config=config)
                print("    " + ", ".join(f"{k}: {v:.1f}" for k, v in record["breakdown_us"].items()),
                      file=sys.stderr)
            case_records.append(record)
            print(f"[{index + 1}/{len(args.cases)}] {name} {impl} {record['config'] or ''}: {ms * 1e3:.1f} us "
                  f"eager, {graph_ms * 1e3:.1f} us graph ({record['floor_ratio']:.2f}x floor)", file=sys.stderr,
                  flush=True)
        baseline = [r["ms"] for r in case_records if r["impl"] == "stage0"]
        for record in case_records:
            if baseline:
                record["speedup_vs_stage0"] = baseline[0] / record["ms"]
        records.extend(case_records)
        del input_sets
        torch.cuda.empty_cache()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=_git_commit(), gpu=props.name, sms=props.multi_processor_count,
                copy_bandwidth_tbs=bandwidth / 1e12, torch=torch.__version__,
                triton=__import__("triton").__version__, args=vars(args))
    return meta, records


def geomean(values):
    return math.exp(sum(math.log(x) for x in values) / len(values))


def format_table(records):
    head = (f"{'case':<17} {'impl':<10} {'us':>8} {'graph us':>8} {'floor us':>8} {'x floor':>7} {'vs stage0':>9} "
            f"{'vs TileLang':>11} {'TFLOP/s':>7} {'first ms':>8} {'smem KB':>7} {'regs':>4} {'spill':>5}")
    lines = [head, "-" * len(head)]
    for r in records:
        kernels = r["kernels"].values()
        smem = max((k["shared_bytes"] for k in kernels), default=0) / 1024
        regs = max((k["regs"] for k in kernels), default=0)
        spills = max((k["spills"] for k in kernels), default=0)
        graph_us = r.get("graph_ms", float("nan")) * 1e3
        lines.append(f"{r['case']:<17} {r['impl']:<10} {r['ms'] * 1e3:>8.1f} {graph_us:>8.1f} "
                     f"{r['floor_ms'] * 1e3:>8.1f} "
                     f"{r['floor_ratio']:>7.2f} {r.get('speedup_vs_stage0', float('nan')):>9.2f} "
                     f"{r.get('speedup_vs_tilelang', float('nan')):>11.2f} {r['tflops']:>7.1f} "
                     f"{r['first_call_ms']:>8.0f} {smem:>7.1f} {regs:>4} {spills:>5}")
    prod = [r for r in records if r["impl"] == "production" and "speedup_vs_tilelang" in r]
    if prod:
        geo = geomean([r["speedup_vs_tilelang"] for r in prod])
        worst = min(r["speedup_vs_tilelang"] for r in prod)
        floor_geo = geomean([r["floor_ratio"] for r in prod])
        lines.append(f"production vs TileLang: geomean {geo:.2f}x, worst case {worst:.2f}x; "
                     f"time/floor geomean {floor_geo:.2f}x, worst {max(r['floor_ratio'] for r in prod):.2f}x")
        graph = [r["graph_speedup_vs_tilelang"] for r in prod if "graph_speedup_vs_tilelang" in r]
        if graph:
            lines.append(f"production (graph replay) vs TileLang: geomean {geomean(graph):.2f}x, "
                         f"worst case {min(graph):.2f}x")
    return "\n".join(lines)


def draw_chart(records, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prod = [r for r in records if r["impl"] == "production"]
    names = [r["case"] for r in prod]
    fig, (ax_speed, ax_floor) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    xs = range(len(prod))
    width = 0.4
    ax_speed.bar([x - width / 2 for x in xs], [r.get("speedup_vs_stage0", 0) for r in prod], width,
                 label="vs stage0")
    ax_speed.bar([x + width / 2 for x in xs], [r.get("speedup_vs_tilelang", 0) for r in prod], width,
                 label="vs TileLang (anchor)")
    ax_speed.set_ylabel("speedup (x)")
    ax_speed.legend()
    ax_speed.set_title(title)
    ax_floor.bar(list(xs), [r["floor_ratio"] for r in prod], 0.6, color="tab:green")
    ax_floor.axhline(3.0, color="red", linestyle="--", label="3x floor target")
    ax_floor.set_ylabel("time / HBM floor")
    ax_floor.legend()
    ax_floor.set_xticks(list(xs))
    ax_floor.set_xticklabels(names, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(OFFICIAL_CASES),
                        help="N_P_R_C names, or 'quick' for the 5 quick cases")
    parser.add_argument("--impl", default="production,stage0", help="comma-separated: production,stage0")
    parser.add_argument("--no-z", action="store_true", help="without the SiLU gate")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--output-dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--B", type=int, default=4)
    parser.add_argument("--S", type=int, default=2048)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--G", type=int, default=1)
    parser.add_argument("--input-sets", type=int, default=3, help="input sets cycled through (L2 defeat)")
    parser.add_argument("--sweep", action="store_true", help="time candidate production configs")
    parser.add_argument("--knobs", help="with --sweep: comma-separated ScanConfig fields to move (default: all); "
                        "a+b moves two together, a=1:3 gives a's values")
    parser.add_argument("--breakdown", action="store_true", help="also report device time per kernel")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--png", help="draw the chart here")
    args = parser.parse_args(argv)
    if args.cases == ["quick"]:
        args.cases = list(QUICK_CASES)
    if not torch.cuda.is_available():
        parser.error("the benchmark needs a CUDA GPU")
    meta, records = run(args)
    print(format_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)
    if args.png:
        draw_chart(records, args.png, f"bwd_fwd on {meta['gpu']} ({args.dtype}, Z {'off' if args.no_z else 'on'}, "
                                      f"output {args.output_dtype})")


if __name__ == "__main__":
    main()
