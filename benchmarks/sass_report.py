"""Static SASS instruction mix of the production kernels for sm_90, on a machine without a GPU.

    python benchmarks/sass_report.py                          # N128_P64_R4_C16, dispatcher config
    python benchmarks/sass_report.py --cases N16_P64_R4_C8 --config block_p=32,n_segments=8
    python benchmarks/sass_report.py --kernels chunk_scan --order   # loads, stores, barriers in program order

Both production kernels are bound by instruction issue and load latency, not by bytes or
tensor-core FLOPs (docs/optimization.md, sections 9-11), so the instructions of their chunk loop
are a first-order predictor of a change: this compiles each launch the way
``benchmarks/aot_report.py`` does, disassembles the cubin with the cuobjdump in Triton's wheel,
finds the largest loop (the backward branch spanning the most instructions) and counts its
instructions by kind.
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile


sys.path.insert(0, os.path.dirname(__file__))

import aot_report  # noqa: E402

KINDS = {
    "LDG": "global load", "STG": "global store", "LDS": "shared load", "STS": "shared store",
    "LDSM": "shared load", "STSM": "shared store", "LDL": "local (spill) load", "STL": "local (spill) store",
    "HGMMA": "tensor core", "HMMA": "tensor core", "WARPGROUP": "tensor core",
    "FFMA": "fp32 math", "FMUL": "fp32 math", "FADD": "fp32 math", "FMNMX": "fp32 math", "MUFU": "transcendental",
    "F2F": "convert", "F2FP": "convert", "I2F": "convert", "F2I": "convert", "I2FP": "convert",
    "FSEL": "select", "SEL": "select", "FSETP": "compare", "ISETP": "compare", "PLOP3": "compare",
    "IMAD": "integer / address", "IADD3": "integer / address", "VIADD": "integer / address",
    "LEA": "integer / address", "SHF": "integer / address", "LOP3": "integer / address",
    "IABS": "integer / address", "SGXT": "integer / address",
    "MOV": "move", "PRMT": "move", "R2UR": "move", "P2R": "move", "R2P": "move",
    "CS2R": "zero fill / special reg", "S2R": "zero fill / special reg", "SHFL": "shuffle",
    "BAR": "barrier", "DEPBAR": "barrier", "WARPSYNC": "barrier",
}


# The opcodes ``--order`` prints: memory traffic, spills, barriers and tensor-core ops.
ORDER_OPS = {"LDG", "STG", "LDL", "STL", "BAR", "HGMMA", "HMMA"}


def kind(opcode):
    base = opcode.split(".")[0]
    if base.startswith("U"):
        return "uniform datapath"
    return KINDS.get(base, "other")


def sass_ops(kernel):
    """[(address, opcode)] of a compiled kernel's SASS."""
    cuobjdump = aot_report.nvidia_tool("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            ops.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return ops


def largest_loop(ops):
    """Opcodes between the target and the source of the longest backward branch (None if no loop)."""
    best = None
    for addr, opcode, rest in ops:
        target = re.search(r"0x([0-9a-f]+)", rest) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            span = (addr - int(target.group(1), 16), int(target.group(1), 16), addr)
            best = max(best, span) if best else span
    if best is None:
        return None
    return [opcode for addr, opcode, _ in ops if best[1] <= addr <= best[2]]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["N128_P64_R4_C16"])
    parser.add_argument("--config", help="ScanConfig fields key=value,... that replace the dispatcher's")
    parser.add_argument("--no-z", action="store_true")
    parser.add_argument("--opcodes", action="store_true", help="also count the loop body's opcodes (first two parts)")
    parser.add_argument("--kernels", nargs="+", help="only these kernels (state_scan, chunk_scan, ...)")
    parser.add_argument("--order", action="store_true",
                        help="print each kernel's global loads / stores, spills, barriers and tensor-core ops in "
                             "program order (which loads wait behind a store or a barrier) instead of the counts")
    args = parser.parse_args(argv)
    aot_report.compile_as_cuda()
    for case in args.cases:
        for name, launch_args, kwargs in aot_report.official_launches(case, args.config, z=not args.no_z):
            if args.kernels and name not in args.kernels:
                continue
            if name == "state_scan":  # the end-state pass, or the pass that stores the states
                name += " (stores states)" if kwargs["STORE_STATES"] else " (end states)"
            ops = sass_ops(aot_report.compile_launch(name.split()[0], launch_args, kwargs))
            if args.order:
                print(f"{case} {name}: {len(ops)} SASS instructions")
                print("    " + " ".join(f"{i}:{op.split('.')[0]}" for i, (_, op, _) in enumerate(ops)
                                        if op.split(".")[0] in ORDER_OPS))
                continue
            body = largest_loop(ops)
            print(f"{case} {name}: {len(ops)} SASS instructions"
                  + (f", largest loop body {len(body)}" if body else ", no loop"))
            counted = body or [o for _, o, _ in ops]
            for group, count in collections.Counter(kind(op) for op in counted).most_common():
                print(f"    {group:<24} {count:>5}")
            if args.opcodes:
                opcodes = collections.Counter(".".join(op.split(".")[:2]) for op in counted).most_common()
                print("    " + ", ".join(f"{op} {count}" for op, count in opcodes))


if __name__ == "__main__":
    main()
