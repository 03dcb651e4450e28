"""The accuracy contract of SPEC section 7.

``golden`` is the reference in float64 on the same inputs, ``bench`` the reference run in the
input dtype. Every metric is computed in float64 on the candidate's device. A candidate that is
NaN or Inf where the golden is finite gets an infinite error, so it fails every threshold.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "OUTPUT_NAMES", "NEAR_ZERO_OUTPUTS", "Tolerances", "OutputCheck", "normwise_error",
    "max_abs_relative_error", "mere_mare", "tolerances", "check_outputs", "format_checks",
    "assert_outputs_close", "FP32_REDRAWS", "FP32RedrawWarning", "judge_with_redraws",
]

OUTPUT_NAMES = ("states", "qk_dot", "dmimo_o", "dmimo_z", "dz")
# Outputs whose entries cluster around zero: a normwise or elementwise-relative error is
# dominated by tiny entries there, so they are judged relative to their largest entry.
NEAR_ZERO_OUTPUTS = ("qk_dot", "dmimo_z")

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_INF = float("inf")


def _as_float64(x: Tensor, g: Tensor) -> tuple[Tensor, Tensor] | None:
    """(x, g) in float64 on x's device, restricted to positions where g is finite.

    None when x is non-finite where g is finite, or x differs from g where g is not finite.
    """
    x = x.detach().to(torch.float64)
    g = g.detach().to(device=x.device, dtype=torch.float64)
    if x.shape != g.shape:
        raise ValueError(f"shape mismatch: candidate {tuple(x.shape)}, golden {tuple(g.shape)}")
    g_finite = torch.isfinite(g)
    if not bool(torch.isfinite(x[g_finite]).all()):
        return None
    if not bool(g_finite.all()):
        # Non-finite golden entries must be reproduced exactly (NaN matching NaN).
        x_off, g_off = x[~g_finite], g[~g_finite]
        if not bool(((x_off == g_off) | (x_off.isnan() & g_off.isnan())).all()):
            return None
        x, g = x[g_finite], g[g_finite]
    return x, g


def _ratio(num: Tensor, den: Tensor) -> float:
    """num / den, with 0 / 0 = 0 (an exact match of an all-zero golden) and c / 0 = inf."""
    num, den = float(num), float(den)
    if den == 0.0:
        return 0.0 if num == 0.0 else _INF
    return num / den


def normwise_error(x: Tensor, g: Tensor) -> float:
    """||x - g|| / ||g|| (Frobenius norms over all entries)."""
    pair = _as_float64(x, g)
    if pair is None:
        return _INF
    x, g = pair
    return _ratio(torch.linalg.vector_norm(x - g), torch.linalg.vector_norm(g))


def max_abs_relative_error(x: Tensor, g: Tensor) -> float:
    """max |x - g| / max |g|."""
    pair = _as_float64(x, g)
    if pair is None:
        return _INF
    x, g = pair
    if x.numel() == 0:
        return 0.0
    return _ratio((x - g).abs().max(), g.abs().max())


def mere_mare(x: Tensor, g: Tensor, eps: float = 1e-6) -> tuple[float, float]:
    """(MERE, MARE) = (mean, max) of |x - g| / (|g| + eps)."""
    pair = _as_float64(x, g)
    if pair is None:
        return _INF, _INF
    x, g = pair
    if x.numel() == 0:
        return 0.0, 0.0
    rel = (x - g).abs() / (g.abs() + eps)
    return float(rel.mean()), float(rel.max())


@dataclass(frozen=True)
class Tolerances:
    normwise: float
    near_zero: float


def tolerances(input_dtype: torch.dtype, output_dtype: torch.dtype | None = None) -> Tolerances:
    """Thresholds of SPEC section 7: fp32 1e-5 / 1e-5, fp16 and bf16 1e-2 / 2e-2.

    The half-precision thresholds apply when either the inputs or the outputs are half
    precision: a bf16 output alone is off by up to half a bf16 ulp (2^-9) wherever it rounds
    differently from the rounded golden, far above 1e-5.
    """
    if input_dtype in _HALF_DTYPES or output_dtype in _HALF_DTYPES:
        return Tolerances(normwise=1e-2, near_zero=2e-2)
    return Tolerances(normwise=1e-5, near_zero=1e-5)


@dataclass
class OutputCheck:
    """One output's metrics (None where not computed) and verdict."""

    name: str
    normwise: float | None = None
    near_zero: float | None = None
    mere: float | None = None
    mare: float | None = None
    mere_bench: float | None = None
    mare_bench: float | None = None
    passed: bool = False
    reason: str = ""
    # Failed, and only on the dual benchmark's bounds (every other metric of the output passed).
    dual_only: bool = False


def _rounded(g: Tensor, dtype: torch.dtype) -> Tensor:
    """g rounded to ``dtype`` when that is a half precision, in float64 either way."""
    if dtype in _HALF_DTYPES:
        g = g.to(dtype)
    return g.to(torch.float64)


def _check_one(name, x, g, bench, tol: Tolerances, output_dtype) -> OutputCheck:
    check = OutputCheck(name)
    if g is None or x is None:
        check.passed = g is None and x is None
        if not check.passed:
            check.reason = "expected None" if g is None else "missing output"
        return check
    if tuple(x.shape) != tuple(g.shape):
        check.reason = f"shape {tuple(x.shape)}, expected {tuple(g.shape)}"
        return check
    if x.dtype != output_dtype:
        check.reason = f"dtype {x.dtype}, expected {output_dtype}"
        return check

    target = _rounded(g, output_dtype)  # what an exact result written in output_dtype holds
    check.normwise = normwise_error(x, target)
    failures = []
    if name in NEAR_ZERO_OUTPUTS:
        check.near_zero = max_abs_relative_error(x, target)
        if not check.near_zero <= tol.near_zero:
            failures.append(f"max-abs-rel {check.near_zero:.2e} > {tol.near_zero:.0e}")
    else:
        if not check.normwise <= tol.normwise:
            failures.append(f"normwise {check.normwise:.2e} > {tol.normwise:.0e}")
        if bench is None:
            failures.append("no bench output")
        else:
            # The bench stands for an implementation that also writes output_dtype, so it is
            # rounded the same way, then measured against the exact golden.
            check.mere, check.mare = mere_mare(x, target)
            check.mere_bench, check.mare_bench = mere_mare(_rounded(bench, output_dtype), g)
            if not check.mere <= 2 * check.mere_bench + 1e-6:
                failures.append(f"MERE {check.mere:.2e} > 2*bench+1e-6")
            if not check.mare <= 10 * check.mare_bench + 1e-5:
                failures.append(f"MARE {check.mare:.2e} > 10*bench+1e-5")
    check.passed = not failures
    check.reason = "; ".join(failures)
    check.dual_only = bool(failures) and all(f.startswith(("MERE", "MARE")) for f in failures)
    return check


def check_outputs(candidate: tuple, golden: tuple, bench: tuple, input_dtype: torch.dtype,
                  output_dtype: torch.dtype, names=OUTPUT_NAMES) -> list[OutputCheck]:
    """Judge each candidate output against the golden and the bench (tuples ordered as ``names``).

    - qk_dot, dmimo_z: max|x - g| / max|g| <= near-zero tolerance (only this metric);
    - states, dmimo_o, dz: normwise <= tolerance, and the dual benchmark
      MERE(x) <= 2 MERE(bench) + 1e-6, MARE(x) <= 10 MARE(bench) + 1e-5;
    - half-precision outputs are compared with the golden rounded to output_dtype; the bench,
      rounded to output_dtype as well, is compared with the unrounded golden;
    - an output that is None must be None on both sides; shape and dtype must match.
    """
    if not (len(candidate) == len(golden) == len(bench) == len(names)):
        raise ValueError(f"expected {len(names)} outputs each, got candidate {len(candidate)}, "
                         f"golden {len(golden)}, bench {len(bench)}")
    tol = tolerances(input_dtype, output_dtype)
    return [_check_one(name, x, g, b, tol, output_dtype)
            for name, x, g, b in zip(names, candidate, golden, bench)]


def format_checks(checks: list[OutputCheck]) -> str:
    """A small aligned table of the metrics and verdicts."""
    header = ("output", "normwise", "near-zero", "MERE", "MERE bench", "MARE", "MARE bench",
              "result")

    def fmt(value):
        return "-" if value is None else f"{value:.2e}"

    rows = [header]
    for c in checks:
        verdict = "ok" if c.passed else f"FAIL {c.reason}"
        rows.append((c.name, fmt(c.normwise), fmt(c.near_zero), fmt(c.mere), fmt(c.mere_bench),
                     fmt(c.mare), fmt(c.mare_bench), verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]
                     for row in rows)


def assert_outputs_close(candidate: tuple, golden: tuple, bench: tuple, input_dtype: torch.dtype,
                         output_dtype: torch.dtype, names=OUTPUT_NAMES) -> list[OutputCheck]:
    """Run ``check_outputs``; raise AssertionError with the table when any output fails."""
    checks = check_outputs(candidate, golden, bench, input_dtype, output_dtype, names)
    if not all(c.passed for c in checks):
        raise AssertionError("accuracy contract violated:\n" + format_checks(checks))
    return checks


# With fp32 inputs one draw fails the dual benchmark about 1% of the time for any fp32 implementation whose rounding
# is independent of the bench's: the token recurrence in fp32 (reference.py), an exact implementation, fails it on
# dmimo_o in 1-2% of draws on small problems, where one element near zero carries MERE and MARE and its error in
# the bench can be lucky (``benchmarks/fp32_margins.py --recurrence``; docs/optimization.md section 36).
FP32_REDRAWS = 2


def judge_with_redraws(judge, seed: int, input_dtype: torch.dtype, redraws: int = FP32_REDRAWS) -> list[OutputCheck]:
    """Judge one draw, ``judge(seed) -> list[OutputCheck]`` on fresh inputs of that seed; raise AssertionError with
    the table of every draw judged when the contract fails.

    With fp32 inputs a draw whose failures are all on the dual benchmark's bounds (``OutputCheck.dual_only``: the
    normwise, near-zero, finiteness, shape and dtype checks passed) is judged again on ``redraws`` fresh draws
    (seeds derived from ``seed``), each of which must pass outright; an exact fp32 implementation then fails with
    probability ~2 p^2 (p ~ 1-2% a draw) instead of p, and any other failure, or any failure of 16-bit inputs, fails
    at once.  Returns the checks of the last draw judged.
    """
    checks = judge(seed)
    failed = [c for c in checks if not c.passed]
    if not failed:
        return checks
    tables = [f"seed {seed}:\n" + format_checks(checks)]
    if input_dtype != torch.float32 or not all(c.dual_only for c in failed):
        raise AssertionError("accuracy contract violated:\n" + "\n".join(tables))
    for redraw in range(1, redraws + 1):
        redraw_seed = (seed * 1_000_003 + redraw) % 2**31
        checks = judge(redraw_seed)
        tables.append(f"re-draw {redraw}, seed {redraw_seed}:\n" + format_checks(checks))
        if not all(c.passed for c in checks):
            raise AssertionError("accuracy contract violated (fp32: a dual-benchmark failure, then a failing "
                                 "re-draw):\n" + "\n".join(tables))
    warnings.warn(f"fp32 draw of seed {seed} failed only the dual benchmark ("
                  + "; ".join(f"{c.name}: {c.reason}" for c in failed) + f"); {redraws} re-draws passed",
                  FP32RedrawWarning, stacklevel=2)
    return checks


class FP32RedrawWarning(UserWarning):
    """An fp32 draw failed only the dual benchmark and its re-draws passed (``judge_with_redraws``)."""
