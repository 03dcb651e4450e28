"""The Gluon gate_grads (mamba3_mimo/ops/gluon_gate_grads.py) against the Triton one: compiled, compared, timed.

    python benchmarks/gluon_gate_grads_check.py --compile-only    # no GPU: sm_90 resources on the official shapes
    python benchmarks/gluon_gate_grads_check.py --json F          # GPU: values against gate_grads, then us and TB/s

On the GPU each official shape whose dispatcher config runs gate_grads gets the tensors its call hands gate_grads
(raw_y as fp16 with row scales, bf16 dout / z / v, D on), both kernels run on them, and their dz / dPhi / dZeta
partials are compared (relative to each output's largest element; the two differ only in fp32 summation order).
Then both are timed (``triton.testing.do_bench`` medians over input sets that together exceed L2) and their bytes
(raw_y and its scales, dout, z, v read once, dz written once) over the time give TB/s.  ``--variants`` adds ring
depths and tokens a thread.
"""

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mamba3_mimo.cases import OFFICIAL_FIXED, OFFICIAL_SHAPES  # noqa: E402
from mamba3_mimo.ops import gluon_gate_grads  # noqa: E402
from mamba3_mimo.ops.gate_grads import gate_grads, gate_grads_meta  # noqa: E402
from mamba3_mimo.ops.host_utils import cdiv  # noqa: E402
from mamba3_mimo.ops.production import choose_config  # noqa: E402

B, S, H = OFFICIAL_FIXED["B"], OFFICIAL_FIXED["S"], OFFICIAL_FIXED["H"]


def parse(case):
    n, p, r, c = (int(part[1:]) for part in case.split("_"))
    return dict(N=n, P=p, R=r, chunk_size=c)


def gate_cases():
    """(case, config) of the official shapes whose dispatcher config runs gate_grads (Z on, 132 SMs)."""
    found = []
    for case in OFFICIAL_SHAPES:
        config = choose_config(B=B, H=H, S=S, **parse(case), num_sms=132)
        if config.split_gate and not config.gate_in_scan:
            found.append((case, config))
    return found


def make_tensors(case, config, device, seed):
    shape = parse(case)
    R, P = shape["R"], shape["P"]
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*size, dtype=torch.float32):
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    scale_tiles = cdiv(P, config.out_block_p)
    return dict(raw_y=rand(B, H, S, R, P, dtype=torch.float16),
                raw_y_scale=torch.rand(B, H, S, R, scale_tiles, generator=gen).to(device) + 0.5,
                scale_block_p=config.out_block_p, dout=rand(B, S, H, P, dtype=torch.bfloat16),
                z=rand(B, S, H, P, dtype=torch.bfloat16), v=rand(B, S, H, P, dtype=torch.bfloat16),
                mimo_o=rand(H, R, P), mimo_z=rand(H, R, P), mimo_v=rand(H, R, P), d=rand(H),
                dz=torch.empty(B, S, H, P, device=device, dtype=torch.bfloat16),
                tokens_per_program=config.gate_tokens)


def moved_bytes(t):
    return sum(t[name].numel() * t[name].element_size() for name in ("raw_y", "raw_y_scale", "dout", "z", "v", "dz"))


def run_triton(t, config):
    return gate_grads(**{k: v for k, v in t.items() if k != "scale_block_p"}, scale_block_p=t["scale_block_p"],
                      tile_elements=config.gate_tile_elements, num_warps=config.gate_num_warps)


def run_gluon(t, **variant):
    return gluon_gate_grads.gluon_gate_grads(**t, **variant)


def compare(t, config, variant):
    dphi_ref, dzeta_ref = run_triton(t, config)
    dz_ref = t["dz"].float().clone()
    t["dz"].fill_(float("nan"))
    dphi, dzeta = run_gluon(t, **variant)
    torch.cuda.synchronize()
    errors = {}
    for name, got, want in (("dz", t["dz"].float(), dz_ref), ("dphi", dphi.sum(2), dphi_ref.sum(2)),
                            ("dzeta", dzeta.sum(2), dzeta_ref.sum(2))):
        errors[name] = float(((got - want).abs().max() / want.abs().max()).item())
    return errors


def graph_us(fn, sets):
    """Device us of one call: a CUDA graph of one call on each input set, replayed (no host work in the timing; the
    sets together exceed L2), the median of ``do_bench`` over replays divided by the sets."""
    for t in sets:
        fn(t)  # compiled and warm before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for t in sets:
            fn(t)
    return triton.testing.do_bench(graph.replay, warmup=10, rep=200, return_mode="median") * 1e3 / len(sets)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--cases", nargs="*")
    parser.add_argument("--variants", action="store_true", help="also other ring depths and tokens a thread")
    parser.add_argument("--json")
    args = parser.parse_args()
    cases = [(c, cfg) for c, cfg in gate_cases() if not args.cases or c in args.cases]
    variants = [dict()]
    if args.variants:
        variants += [dict(num_buffers=n, tokens_per_thread=k) for n, k in ((4, 2), (3, 4), (8, 1))]
        variants += [dict(ranks_per_thread=r, num_buffers=n, tokens_per_thread=k) for r, n, k in ((4, 4, 1), (2, 6, 2))]
    if args.compile_only:
        for case, config in cases:
            for v in variants:
                found = compile_for_sm90(case, config, **v)
                found.pop("kernel")
                print(json.dumps(dict(case=case, variant=v, **found)))
        return
    records = []
    for case, config in cases:
        sets = [make_tensors(case, config, "cuda", seed) for seed in range(3)]
        for variant in variants:
            errors = compare(sets[0], config, variant)
            record = dict(case=case, variant=variant, errors=errors)
            for name, fn in (("triton", lambda t: run_triton(t, config)), ("gluon", lambda t: run_gluon(t, **variant))):
                us = graph_us(fn, sets)
                record[name + "_us"] = us
                record[name + "_tbs"] = moved_bytes(sets[0]) / us / 1e6
            records.append(record)
            print(json.dumps(record), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), records=records), f, indent=1)


def compile_for_sm90(case, config, num_buffers=None, tokens_per_thread=None, ranks_per_thread=None, gdc=False):
    """The kernel compiled for sm_90 on an official shape (Z and D on), no GPU needed, specialized as Triton's
    launcher would the real call (integer divisibility, pointer alignment): registers, spill, shared; and the
    compiled kernel under ``"kernel"``.  ``gdc``: as launched under ``launch.dependent_launches``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    import aot_report
    from gluon_scan_probe import _Shaped

    shape = parse(case)
    R, P = shape["R"], shape["P"]
    block_p = gate_grads_meta(R=R, P=P, max_block_p=config.out_block_p)["BLOCK_P"]
    chosen = gluon_gate_grads.tile_variant(R)
    num_buffers = num_buffers or chosen["num_buffers"]
    tokens_per_thread = tokens_per_thread or chosen["tokens_per_thread"]
    ranks_per_thread = min(R, ranks_per_thread or chosen["ranks_per_thread"])
    block_t = gluon_gate_grads.block_tokens(R=R, block_p=block_p, tokens_per_thread=tokens_per_thread,
                                            ranks_per_thread=ranks_per_thread)
    base = {dtype: torch.empty(16, dtype=dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)}
    activations = [B, S, H * P], [S * H * P, H * P, 1], [1, block_t, block_p]
    y_desc = gluon_gate_grads._box(_Shaped(base[torch.float16], (B, H, S, R, P)), [B * H, S, R, P],
                                   [S * R * P, R * P, P, 1], [1, block_t, R, block_p])
    act_desc = gluon_gate_grads._box(_Shaped(base[torch.bfloat16], (B, S, H, P)), *activations)
    tokens = cdiv(config.gate_tokens, block_t) * block_t
    f32 = base[torch.float32]
    args = [y_desc, act_desc, act_desc, act_desc, f32, f32, f32, f32, f32, base[torch.bfloat16], f32, f32,
            S, H, cdiv(S, tokens), P // block_p, tokens, cdiv(P, config.out_block_p), config.out_block_p]
    kwargs = dict(R=R, P=P, BLOCK_T=block_t, BLOCK_P=block_p, NUM_BUFFERS=num_buffers,
                  RANKS_PER_THREAD=ranks_per_thread, HAS_Z=True, HAS_D=True, num_warps=gluon_gate_grads.NUM_WARPS,
                  **(dict(GDC=True, launch_pdl=True) if gdc else {}))
    kernel = gluon_gate_grads._gluon_gate_grads_kernel
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    return dict(block_t=block_t, block_p=block_p, num_buffers=num_buffers, **aot_report.resources(compiled),
                kernel=compiled)


if __name__ == "__main__":
    main()
