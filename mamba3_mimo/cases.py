"""The declarative bwd_fwd case suite (``case_data/bwd_fwd.yaml``) and its accuracy-report CLI.

The YAML is generated, never edited by hand: ``generate_suite()`` expands the pairwise factors
into a covering array (every pair of factor levels appears in some case) and appends the fixed
tail and official lists of SPEC section 8.  ``python -m mamba3_mimo.cases --write-yaml`` rewrites
the file; tests/test_cases.py checks that the file on disk is what the generator makes.

    python -m mamba3_mimo.cases [--device cpu|cuda] [--impl stage0|production|all]
                                [--filter SUBSTR] [--size cpu|gpu|all] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import api
from .accuracy import check_outputs, tolerances
from .inputs import make_inputs
from .reference import bwd_fwd_reference

YAML_PATH = Path(__file__).parent / "case_data" / "bwd_fwd.yaml"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# SPEC section 7, once per precision class ("half" when inputs or outputs are fp16/bf16).
DUAL_BENCHMARK = dict(mere_factor=2.0, mere_floor=1e-6, mare_factor=10.0, mare_floor=1e-5)
TOLERANCE_PROFILES = {"fp32": dict(normwise=1e-5, near_zero=1e-5, **DUAL_BENCHMARK),
                      "half": dict(normwise=1e-2, near_zero=2e-2, **DUAL_BENCHMARK)}

SHAPE_KEYS = ("B", "S", "H", "G", "N", "P", "R", "chunk_size", "rotary_dim_divisor")
SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

# Pairwise grid of SPEC section 8 (plus the output dtype). G is relative to H. Output "half" is
# the activation dtype when that is half, else fp16: the Triton 3.6 interpreter casts fp32 to
# bf16 by truncation (GPUs round to nearest), which alone fails fp32-input dual benchmarks on CPU.
PAIRWISE_FACTORS = {"dtype": ["float16", "bfloat16", "float32"], "G": ["1", "H/2", "H"], "H": [2, 4],
                    "z": [True, False], "d": [True, False], "B": [1, 2], "S": [32, 64],
                    "output_dtype": ["float32", "half"]}
PAIRWISE_FIXED = dict(N=32, P=16, R=2, chunk_size=16, rotary_dim_divisor=4)
# Partial last chunks: every S of the grid, both chunk sizes, and R 1..4 (3 is not a power of two).
TAIL_CASES = [dict(S=33, chunk_size=16, R=2, G=1, dtype="bfloat16"),
              dict(S=40, chunk_size=32, R=3, G=1, dtype="float32"),
              dict(S=48, chunk_size=32, R=1, G=2, dtype="float16"),
              dict(S=50, chunk_size=16, R=4, G=2, dtype="float32")]
TAIL_FIXED = dict(B=2, H=2, N=16, P=32, rotary_dim_divisor=4)
OFFICIAL_SHAPES = ["N16_P64_R4_C8", "N32_P64_R4_C16", "N64_P64_R4_C16", "N128_P64_R4_C16", "N256_P64_R4_C8",
                   "N64_P128_R4_C16", "N128_P32_R4_C16", "N128_P128_R4_C8", "N128_P64_R8_C8", "N128_P64_R2_C32",
                   "N128_P64_R1_C64"]
# The quick subset covers R 1, 2, 4; N 16..256; P 64..128.
OFFICIAL_QUICK = ["N16_P64_R4_C8", "N256_P64_R4_C8", "N64_P128_R4_C16", "N128_P64_R2_C32", "N128_P64_R1_C64"]
OFFICIAL_FIXED = dict(B=4, S=2048, H=16, G=1, rotary_dim_divisor=4)


def pairwise_allowed(row: dict) -> bool:
    """G = H/2 only with H = 4: with H = 2 it is G = 1 again, a pair not worth a case."""
    return not (row.get("G") == "H/2" and row.get("H") == 2)


def covering_array(factors: dict, allowed=pairwise_allowed) -> list[dict]:
    """Rows covering every allowed pair of levels (in-parameter-order growth, deterministic).

    Starts from all combinations of the first two factors (put the largest first), then adds one
    factor at a time, its column chosen by exhaustive search for the most newly covered pairs;
    a pair still missing gets a row of its own.
    """
    names = list(factors)
    rows = [{names[0]: a, names[1]: b} for a in factors[names[0]] for b in factors[names[1]]]
    for i, name in enumerate(names[2:], start=2):
        done = names[:i]
        missing = {(p, lp, lv) for p in done for lp in factors[p] for lv in factors[name]
                   if allowed({p: lp, name: lv})}

        def newly_covered(column):
            if not all(allowed({**row, name: lv}) for row, lv in zip(rows, column)):
                return -1
            return len(missing & {(p, row[p], lv) for row, lv in zip(rows, column) for p in done})

        best = max(itertools.product(factors[name], repeat=len(rows)), key=newly_covered)
        for row, level in zip(rows, best):
            row[name] = level
        missing -= {(p, row[p], row[name]) for row in rows for p in done}
        for p, lp, lv in sorted(missing, key=repr):
            row = {p: lp, name: lv}
            for n in done:
                row.setdefault(n, next(level for level in factors[n] if allowed({**row, n: level})))
            rows.append(row)
    return rows


def _case(name, group, dims, dtype, output_dtype, z, d, size):
    return dict(name=name, group=group, shape={k: dims[k] for k in SHAPE_KEYS}, dtype=dtype,
                output_dtype=output_dtype, z=z, d=d, seed=zlib.crc32(name.encode()) % 2**31,
                tolerance="fp32" if dtype == output_dtype == "float32" else "half", size=size)


def generate_suite() -> dict:
    """The whole YAML document: profiles, the pairwise factors, and the expanded case list."""
    cases = []
    for i, row in enumerate(covering_array(PAIRWISE_FACTORS), start=1):
        H, dtype = row["H"], row["dtype"]
        G = {"1": 1, "H/2": H // 2, "H": H}[row["G"]]
        out = "float32" if row["output_dtype"] == "float32" else ("float16" if dtype == "float32" else dtype)
        name = (f"pw{i:02d}_{SHORT[dtype]}_B{row['B']}_S{row['S']}_H{H}_G{G}"
                f"_z{int(row['z'])}_d{int(row['d'])}_out{SHORT[out]}")
        dims = dict(PAIRWISE_FIXED, B=row["B"], S=row["S"], H=H, G=G)
        cases.append(_case(name, "pairwise", dims, dtype, out, row["z"], row["d"], "cpu"))
    for tail in TAIL_CASES:
        dims = dict(TAIL_FIXED, **{k: v for k, v in tail.items() if k != "dtype"})
        name = f"tail_S{tail['S']}_C{tail['chunk_size']}_R{tail['R']}_{SHORT[tail['dtype']]}"
        cases.append(_case(name, "tail", dims, tail["dtype"], "float32", True, True, "cpu"))
    rest = [tag for tag in OFFICIAL_SHAPES if tag not in OFFICIAL_QUICK]
    for group, tags in (("official_quick", OFFICIAL_QUICK), ("official_full", rest)):
        for tag in tags:
            N, P, R, C = (int(part[1:]) for part in tag.split("_"))
            dims = dict(OFFICIAL_FIXED, N=N, P=P, R=R, chunk_size=C)
            cases.append(_case(f"official_{tag}", group, dims, "bfloat16", "bfloat16", True, True, "gpu"))
    return dict(tolerance_profiles=TOLERANCE_PROFILES,
                pairwise=dict(factors=PAIRWISE_FACTORS, fixed=PAIRWISE_FIXED), cases=cases)


def render_yaml(suite: dict) -> str:
    import yaml  # pyyaml is needed by the suite only, not by the operator

    header = ("# The bwd_fwd accuracy suite (SPEC sections 7 and 8), generated by\n"
              "#   python -m mamba3_mimo.cases --write-yaml\n"
              "# from mamba3_mimo/cases.py: edit the generator, not this file.\n")
    return header + yaml.safe_dump(suite, sort_keys=False, default_flow_style=None, width=120)


def load_suite(path: Path = YAML_PATH) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text())


@dataclass
class Case:
    """One entry of the YAML; ``limits`` is its named profile."""

    name: str
    group: str
    shape: dict  # B S H G N P R chunk_size rotary_dim_divisor
    dtype: str
    output_dtype: str
    z: bool
    d: bool
    seed: int
    tolerance: str
    size: str  # "cpu": small enough for the interpreter in CI; "gpu": needs CUDA
    limits: dict = field(default_factory=dict)


def load_cases(path: Path = YAML_PATH) -> list[Case]:
    """The suite's cases, each with its profile, which must hold the contract's numbers.

    The run judges with accuracy.check_outputs (the contract itself); the profile names those
    thresholds in the YAML, so one that differs from accuracy.tolerances is refused here.
    """
    suite = load_suite(path)
    cases = [Case(**entry, limits=suite["tolerance_profiles"][entry["tolerance"]]) for entry in suite["cases"]]
    for case in cases:
        contract = tolerances(DTYPES[case.dtype], DTYPES[case.output_dtype])
        if case.limits != dict(normwise=contract.normwise, near_zero=contract.near_zero, **DUAL_BENCHMARK):
            raise ValueError(f"{case.name}: profile {case.tolerance!r} {case.limits} is not SPEC section 7's "
                             f"for {case.dtype} inputs and {case.output_dtype} outputs")
    return cases


@contextlib.contextmanager
def poisoned_outputs():
    """NaN-fill the API's outputs before each launch (when the API has the hook), then restore."""
    if not hasattr(api, "_POISON_OUTPUTS"):
        yield False
        return
    saved, api._POISON_OUTPUTS = api._POISON_OUTPUTS, True
    try:
        yield True
    finally:
        api._POISON_OUTPUTS = saved


@dataclass
class CaseResult:
    case: Case
    impl: str
    device: str
    checks: list = field(default_factory=list)  # one accuracy.OutputCheck per output
    kernel_s: float = 0.0
    reference_s: float = 0.0
    error: str = ""

    @property
    def passed(self) -> bool:
        return not self.error and bool(self.checks) and all(c.passed for c in self.checks)


_last_references: dict = {}  # the last case's (golden, bench): consecutive runs of one case share them


def _references(case: Case, inputs: dict, device: str):
    if _last_references.get("key") != (case.name, device):
        start = time.perf_counter()
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        golden = bwd_fwd_reference(**moved, compute_dtype=torch.float64)
        bench = bwd_fwd_reference(**moved, compute_dtype=DTYPES[case.dtype])
        _last_references.update(key=(case.name, device), value=(golden, bench), seconds=time.perf_counter() - start)
    return (*_last_references["value"], _last_references["seconds"])


def run_case(case: Case, impl: str, device: str) -> CaseResult:
    """Run one implementation on the case's inputs and judge every output (SPEC section 7).

    golden = float64 reference, bench = reference in the activation dtype, both on the CPU for
    ``cpu`` cases and on the kernel's device for the big ``gpu`` ones. Outputs are poisoned first.
    """
    inputs = make_inputs(**case.shape, dtype=DTYPES[case.dtype], z=case.z, d=case.d, seed=case.seed, device=device)
    golden, bench, reference_s = _references(case, inputs, "cpu" if case.size == "cpu" else device)
    with poisoned_outputs():
        start = time.perf_counter()
        candidate = api.bwd_fwd(**inputs, output_dtype=DTYPES[case.output_dtype], impl=impl)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        kernel_s = time.perf_counter() - start
    checks = check_outputs(candidate, golden, bench, DTYPES[case.dtype], DTYPES[case.output_dtype])
    return CaseResult(case, impl, device, checks, kernel_s, reference_s)


def _cuda_usable() -> bool:
    try:
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception:
        return False


def _fmt(value):
    return "-" if value is None else f"{value:.2e}"


def _ratio(x, bench):
    """x / bench of the dual benchmark (the contract allows 2 for MERE, 10 for MARE, plus floors)."""
    if x is None or bench is None:
        return "-"
    return f"{x / bench:.2f}" if bench else ("0.00" if x == 0 else "inf")


HEADER = (f"{'case':<38} {'impl':<10} {'output':<8} {'normwise':>9} {'near-zero':>9} {'MERE/bench':>10} "
          f"{'MARE/bench':>10}  result")


def print_result(result: CaseResult) -> None:
    label = f"{result.case.name:<38} {result.impl:<10}"
    if result.error:
        print(f"{label} {'-':<8} FAIL {result.error}")
    for c in result.checks:
        print(f"{label} {c.name:<8} {_fmt(c.normwise):>9} {_fmt(c.near_zero):>9} {_ratio(c.mere, c.mere_bench):>10} "
              f"{_ratio(c.mare, c.mare_bench):>10}  {'ok' if c.passed else 'FAIL ' + c.reason}")
    print(f"{label} {'':<8} {'PASS' if result.passed else 'FAIL'}: kernel {result.kernel_s:.2f} s, "
          f"references {result.reference_s:.2f} s", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mamba3_mimo.cases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--impl", choices=[*api.IMPLEMENTATIONS, "all"], default="all")
    parser.add_argument("--filter", default="", metavar="SUBSTR", help="only cases whose name or group holds SUBSTR")
    parser.add_argument("--size", choices=["cpu", "gpu", "all"], help="default: cpu on the CPU, all on CUDA")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results to PATH")
    parser.add_argument("--write-yaml", action="store_true", help=f"regenerate {YAML_PATH.name} and exit")
    parser.add_argument("--list", action="store_true", help="list the selected cases and exit")
    args = parser.parse_args(argv)
    if args.write_yaml:
        YAML_PATH.write_text(render_yaml(generate_suite()))
        print(f"wrote {YAML_PATH}")
        return 0
    size = args.size or ("cpu" if args.device == "cpu" else "all")
    cases = [c for c in load_cases() if (args.filter in c.name or args.filter in c.group) and size in ("all", c.size)]
    if args.list:
        for c in cases:
            print(f"{c.name:<38} {c.group:<15} {c.size:<4} {c.dtype:<9} -> {c.output_dtype:<9} profile {c.tolerance}")
        return 0
    if args.device == "cpu" and not api.interpreter_enabled():
        # `python -m` imported the package, hence triton (which reads TRITON_INTERPRET at @triton.jit),
        # before this line: restart with the interpreter on.
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "mamba3_mimo.cases", *(sys.argv[1:] if argv is None else argv)])
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    impls = api.IMPLEMENTATIONS if args.impl == "all" else (args.impl,)
    print(f"{len(cases)} cases x {len(impls)} impls on {args.device}, outputs poisoned: "
          f"{'yes' if hasattr(api, '_POISON_OUTPUTS') else 'no (api has no _POISON_OUTPUTS)'}")
    print(HEADER)
    start, results, runs = time.perf_counter(), [], list(itertools.product(cases, impls))
    for case, impl in runs:
        try:
            result = run_case(case, impl, args.device)
        except Exception as err:  # a crash is a failed case, not the end of the report
            result = CaseResult(case, impl, args.device, error=f"{type(err).__name__}: {err}".splitlines()[0])
        results.append(result)
        print_result(result)
        if result.error and args.device == "cuda" and not _cuda_usable():
            # A sticky CUDA error (illegal address...) fails every later call in this process: say so instead.
            print(f"CUDA context lost after {case.name}[{impl}]: {len(runs) - len(results)} runs not run")
            break
    if args.json:
        args.json.write_text(json.dumps([dict(asdict(r), passed=r.passed) for r in results], indent=1))
    failed = [f"{r.case.name}[{r.impl}]" for r in results if not r.passed]
    not_run = f", {len(runs) - len(results)} not run" if len(results) < len(runs) else ""
    failed_list = ": " + ", ".join(failed) if failed else ""
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed{not_run} ({len(cases)} cases x {len(impls)} "
          f"impls, {args.device}) in {time.perf_counter() - start:.1f} s{failed_list}")
    return 1 if failed or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
