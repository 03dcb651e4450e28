"""Compile the bwd_fwd kernels for sm_90 on a machine without a GPU and report their resources.

    python benchmarks/aot_report.py                       # official grid, production + stage0
    python benchmarks/aot_report.py --cases N128_P64_R4_C16 --config local_states=1,out_num_warps=4
    python benchmarks/aot_report.py --arch 89 --dtype fp32       # an L40S / RTX 4090 (99 KB a block)

Each launch the host wrappers would make is captured (uninitialized CPU
tensors, nothing runs), specialized the way Triton's launcher would, compiled
for an H100/H200 target (``--arch``: another compute capability), and its cubin read with the cuobjdump that ships in
Triton's wheel: registers, stack (spilled bytes per thread), shared memory.
This costs no device time; spills and shared memory over 99 KB show here first.
"""

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mamba3_mimo import api  # noqa: E402
from mamba3_mimo.bench import OFFICIAL_CASES, jit_kernels, parse_case  # noqa: E402
from mamba3_mimo.ops import host_utils  # noqa: E402
from mamba3_mimo.ops.gluon_state_scan import SMEM_LIMIT  # noqa: E402
from mamba3_mimo.ops.production import choose_config, rotation_table_dtype  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
KERNELS = jit_kernels()


def capture_launches(run_impl):
    """Run ``run_impl`` with every kernel launch replaced by a recorder; return [(name, args, kwargs)]."""
    launches = []
    saved = {}
    for name, fn in KERNELS.items():
        saved[name] = fn.run

        def record(*args, grid, warmup, _name=name, **kwargs):
            launches.append((_name, args, kwargs))

        fn.run = record
    try:
        run_impl()
    finally:
        for name, fn in KERNELS.items():
            fn.run = saved[name]
    return launches


def compile_launch(name, args, kwargs):
    """Specialize and compile one captured launch for sm_90 (as JITFunction.run would)."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = KERNELS[name]
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=TARGET, options=options.__dict__)


def compile_as_cuda():
    """Let CPU tensors through the API and compile them as CUDA ones would (bf16 products, bf16 outputs).

    CPU tensors pass validation only in interpreter mode; nothing is launched by the callers here.
    """
    api.interpreter_enabled = lambda: True
    host_utils.compiled_for_gpu = lambda tensor: True
    host_utils._capability_major = lambda device_index: TARGET.arch // 10  # what ``dependent_launch_supported`` asks
    cuda = torch.device("cuda")
    dot_operands, kernel_output_dtype = api.dot_operands, api.kernel_output_dtype
    api.dot_operands = lambda dtypes, device: dot_operands(dtypes, cuda)
    api.kernel_output_dtype = lambda dtype, device: kernel_output_dtype(dtype, cuda)


def parse_config(text):
    """ScanConfig overrides from ``key=value,...`` (integer fields; 0 / 1 for the flags)."""
    return {key: int(value) for key, value in (kv.split("=") for kv in text.split(",") if kv)}


def nvidia_tool(name):
    """Path of a CUDA binary tool shipped in Triton's wheel (cuobjdump, nvdisasm, ptxas)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def official_launches(case, config_text="", z=True):
    """(name, args, kwargs) of every launch of one bf16 production call on an official shape (B=4, S=2048,
    H=16, G=1), configured as the dispatcher would on an H200 with the ``key=value,...`` overrides."""
    shape = parse_case(case)
    config = dataclasses.replace(choose_config(B=4, H=16, S=2048, num_sms=132, has_z=z, **shape),
                                 **parse_config(config_text or ""))
    inputs = empty_inputs(B=4, S=2048, H=16, G=1, dtype=torch.bfloat16, z=z, **shape)
    return capture_launches(
        lambda: api.bwd_fwd(**inputs, output_dtype=torch.bfloat16, impl="production", config=config))


def resources(kernel):
    cuobjdump = nvidia_tool("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return dict(regs=int(found.get("REG", 0)), stack=int(found.get("STACK", 0)), shared=kernel.metadata.shared)


def empty_inputs(B, S, H, G, N, P, R, chunk_size, dtype, z=True, d=True):
    """Uninitialized CPU inputs of the right shapes and dtypes (pages are never touched)."""
    meta = dict(device="cpu")
    nch = triton.cdiv(S, chunk_size)
    act = dict(dtype=dtype, **meta)
    f32 = dict(dtype=torch.float32, **meta)
    return dict(
        dout=torch.empty(B, S, H, P, **act), q=torch.empty(B, S, R, G, N, **act),
        k=torch.empty(B, S, R, G, N, **act), v=torch.empty(B, S, H, P, **act),
        q_bias=torch.empty(H, R, N, **f32), k_bias=torch.empty(H, R, N, **f32),
        mimo_v=torch.empty(H, R, P, **f32), mimo_o=torch.empty(H, R, P, **f32),
        angles=torch.empty(B, S, H, N // 4, **f32), da_cs=torch.empty(B, H, S, **f32),
        da_cs_rev=torch.empty(B, H, S, **f32), dt=torch.empty(B, H, S, **f32), trap=torch.empty(B, H, S, **act),
        segsum=torch.empty(B, H, nch, chunk_size, chunk_size, **f32),
        mimo_z=torch.empty(H, R, P, **f32) if z else None, d=torch.empty(H, **f32) if d else None,
        z=torch.empty(B, S, H, P, **act) if z else None, chunk_size=chunk_size)


def report_case(case, impls, overrides, B, S, H, G, dtype, z):
    shape = parse_case(case)
    inputs = empty_inputs(B=B, S=S, H=H, G=G, dtype=dtype, z=z, **shape)
    # The dispatcher's choice for an H200 (not for the CPU this runs on), with the --config fields changed.
    half_tables = rotation_table_dtype(dtype) == torch.float16
    config = dataclasses.replace(choose_config(B=B, H=H, S=S, num_sms=132, has_z=z, half_tables=half_tables, **shape),
                                 **(overrides or {}))
    rows = []
    for impl in impls:
        launches = capture_launches(lambda: api.bwd_fwd(**inputs, output_dtype=dtype, impl=impl, config=config))
        for name, args, kwargs in launches:
            kernel = compile_launch(name, args, kwargs)
            res = resources(kernel)
            consts = {k: v for k, v in kwargs.items() if k.startswith("BLOCK") or k in ("num_warps",)}
            rows.append((case, impl, name, res, consts))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(OFFICIAL_CASES))
    parser.add_argument("--impl", default="production,stage0")
    parser.add_argument("--config", help="ScanConfig fields key=value,... that replace the dispatcher's for production")
    parser.add_argument("--no-z", action="store_true")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--arch", type=int, default=90,
                        help="compute capability to compile for, e.g. 80 (A100), 86 / 89 (99 KB a block), 90")
    args = parser.parse_args(argv)
    global TARGET
    TARGET = GPUTarget("cuda", args.arch, 32)
    dtype = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)[args.dtype]
    config = None
    if args.config:
        config = parse_config(args.config)
    compile_as_cuda()
    print(f"{'case':<17} {'impl':<10} {'kernel':<18} {'regs':>4} {'stack B':>7} {'smem KB':>7}  blocks")
    worst_smem = 0
    for case in args.cases:
        for row in report_case(case, args.impl.split(","), config, 4, 2048, 16, 1, dtype, not args.no_z):
            case_name, impl, name, res, consts = row
            worst_smem = max(worst_smem, res["shared"])
            print(f"{case_name:<17} {impl:<10} {name:<18} {res['regs']:>4} {res['stack']:>7} "
                  f"{res['shared'] / 1024:>7.1f}  {consts}", flush=True)
    print(f"largest shared memory: {worst_smem} bytes ({'within' if worst_smem <= SMEM_LIMIT else 'OVER'} 99 KB)")


if __name__ == "__main__":
    main()
