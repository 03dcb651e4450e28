"""``python -m mamba3_mimo``: run bwd_fwd on one problem, check it against the references, time it.

On CUDA the default is the official N128_P64_R4_C16 shape (B=4, S=2048, H=16, G=1, bf16, Z and
D on); on the CPU (Triton interpreter) a small problem. Exit status 1 when any output fails the
accuracy contract of SPEC section 7.
"""

import argparse
import os
import sys
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CUDA_DEFAULT = dict(B=4, S=2048, H=16, G=1, shape="N128_P64_R4_C16")
CPU_DEFAULT = dict(B=1, S=64, H=2, G=1, shape="N32_P32_R2_C16")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m mamba3_mimo", description=__doc__.split("\n")[0])
    parser.add_argument("--impl", choices=("production", "stage0"), default="production")
    parser.add_argument("--shape", help="N_P_R_C, e.g. N128_P64_R4_C16 (default: official on CUDA, small on CPU)")
    for size in ("B", "S", "H", "G"):
        parser.add_argument(f"--{size}", type=int, help=f"{size} (default depends on the device)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="activation dtype")
    parser.add_argument("--output-dtype", choices=DTYPES, help="output dtype (default: the activation dtype)")
    parser.add_argument("--no-z", action="store_true", help="without the SiLU gate (mimo_z, z)")
    parser.add_argument("--no-d", action="store_true", help="without the D skip")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def parse_shape(shape):
    try:
        sizes = {part[0]: int(part[1:]) for part in shape.split("_")}
        return dict(N=sizes["N"], P=sizes["P"], R=sizes["R"], chunk_size=sizes["C"])
    except (KeyError, ValueError, IndexError):
        raise SystemExit(f"--shape: expected N<int>_P<int>_R<int>_C<int>, got {shape!r}")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    on_cuda = torch.cuda.is_available()
    # Kernels are built when the package is imported, so the interpreter switch needs a fresh process.
    if not on_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "mamba3_mimo", *sys.argv[1:]])

    import triton

    from .accuracy import check_outputs, format_checks
    from .api import bwd_fwd
    from .inputs import make_inputs
    from .reference import bwd_fwd_reference

    defaults = CUDA_DEFAULT if on_cuda else CPU_DEFAULT
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else defaults[k] for k in ("B", "S", "H", "G")}
    sizes.update(parse_shape(args.shape or defaults["shape"]))
    dtype = DTYPES[args.dtype]
    output_dtype = DTYPES[args.output_dtype or args.dtype]
    device = torch.device("cuda" if on_cuda else "cpu")
    inputs = make_inputs(**sizes, dtype=dtype, z=not args.no_z, d=not args.no_d, device=device, seed=args.seed)

    def run():
        return bwd_fwd(**inputs, output_dtype=output_dtype, impl=args.impl)

    print(f"mamba3_mimo bwd_fwd, impl={args.impl}, device={torch.cuda.get_device_name() if on_cuda else 'cpu'}"
          f"{'' if on_cuda else ' (Triton interpreter)'}")
    print("problem: " + ", ".join(f"{k}={v}" for k, v in sizes.items())
          + f", dtype={args.dtype}, output={args.output_dtype or args.dtype}, Z={'off' if args.no_z else 'on'}"
          + f", D={'off' if args.no_d else 'on'}, seed={args.seed}")
    start = time.perf_counter()
    outputs = run()
    if on_cuda:
        torch.cuda.synchronize()
    first_call = time.perf_counter() - start

    # The float64 golden on the CPU is slow for the official sizes: it runs where the kernel ran.
    golden = bwd_fwd_reference(**inputs, compute_dtype=torch.float64)
    bench = bwd_fwd_reference(**inputs, compute_dtype=dtype)
    checks = check_outputs(outputs, golden, bench, dtype, output_dtype)
    print(format_checks(checks))
    passed = all(c.passed for c in checks)

    if on_cuda:
        ms = triton.testing.do_bench(run, return_mode="median")
        print(f"time: {ms:.4f} ms (triton.testing.do_bench median; first call incl. compile {first_call:.2f} s)")
    else:
        start = time.perf_counter()
        run()
        print(f"time: {time.perf_counter() - start:.2f} s interpreter wall time of one call "
              f"(first call {first_call:.2f} s; not a GPU timing)")
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
