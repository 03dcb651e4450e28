"""Nsight Compute stall samples of one production kernel, summed by source line (no GPU needed).

    python benchmarks/ncu_lines.py \
        benchmarks/results/2026-12-04_h200_ncu_62b79ce_N128_P64_R4_C16_chunk_scan_sass.csv.gz \
        --case N128_P64_R4_C16 --kernel chunk_scan

``ncu_profile.sh`` saves the source page per SASS instruction (no line numbers: the report's CUDA view of a
Triton kernel comes back without metrics).  This compiles the same launch here as ``aot_report.py`` does,
reads each instruction's source line from ``nvdisasm -g`` and matches the rows by offset from the kernel's
start; it prints how many opcodes disagree: a few (predicated forms) when the tree here is the one that was
profiled, hundreds when the kernel's source has changed since (then check out the profiled commit).
"""
import argparse
import collections
import csv
import gzip
import io
import os
import re
import subprocess
import sys
import tempfile


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aot_report  # noqa: E402


def local_lines(case, kernel_name, config_text):
    """{offset: (opcode, 'file:line')} of the kernel as compiled here for sm_90."""
    aot_report.compile_as_cuda()
    launches = aot_report.official_launches(case, config_text)
    # the state scan that stores the states, where two passes launch it twice
    name, launch_args, kwargs = next(launch for launch in launches if launch[0] == kernel_name
                                     and launch[2].get("STORE_STATES", True))
    kernel = aot_report.compile_launch(name, launch_args, kwargs)
    nvdisasm = aot_report.nvidia_tool("nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-g", "-c", f.name], capture_output=True, text=True, check=True).stdout
    where, lines = None, {}
    for text in sass.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', text)
        if m:
            where = f"{os.path.basename(m.group(1))}:{m.group(2)}"
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", text)
        if m:
            lines[int(m.group(1), 16)] = (m.group(2), where)
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv_gz")
    parser.add_argument("--case", default="N128_P64_R4_C16")
    parser.add_argument("--kernel", default="chunk_scan", help="launch name as aot_report.py lists it")
    parser.add_argument("--config", help="ScanConfig overrides of the profiled run, key=value,...")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    lines = local_lines(args.case, args.kernel, args.config)
    rows = list(csv.reader(io.StringIO(gzip.open(args.csv_gz, "rt").read())))
    header_at = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    header = rows[header_at]
    data = [dict(zip(header, row)) for row in rows[header_at + 1:] if len(row) == len(header)]
    start = int(data[0]["Address"], 16)
    stall_names = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    by_line, totals, mismatched = collections.defaultdict(collections.Counter), collections.Counter(), 0
    for row in data:
        opcode, where = lines.get(int(row["Address"], 16) - start, ("?", "?"))
        remote = re.sub(r"^@!?U?P\w+\s+", "", row["Source"].strip()).split()
        mismatched += bool(remote) and remote[0] != opcode
        for name in stall_names:
            by_line[where][name] += int(row[name] or 0)
            totals[name] += int(row[name] or 0)
        by_line[where]["samples"] += int(row["Warp Stall Sampling (All Samples)"] or 0)
        by_line[where]["executed"] += int(row["Instructions Executed"] or 0)
    samples = sum(c["samples"] for c in by_line.values())
    print(f"{len(data)} SASS rows, {len(lines)} here, {mismatched} opcodes differ; {samples} stall samples")
    print("stalls %:", {k[6:]: round(100 * v / samples, 1) for k, v in totals.most_common(8)})
    running = 0
    for where, counts in sorted(by_line.items(), key=lambda kv: -kv[1]["samples"])[:args.top]:
        running += counts["samples"]
        top = [(k[6:], v) for k, v in counts.most_common() if k.startswith("stall_")][:3]
        print(f"{100 * counts['samples'] / samples:5.1f}% (cum {100 * running / samples:5.1f}%) "
              f"executed {counts['executed']:>9} {where} {dict(top)}")


if __name__ == "__main__":
    main()
