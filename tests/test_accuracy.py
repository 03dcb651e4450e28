"""Every accuracy metric can fail: poisoned candidates are caught, good ones pass."""

import math

import pytest
import torch

from mamba3_mimo.accuracy import (
    FP32_REDRAWS, NEAR_ZERO_OUTPUTS, OUTPUT_NAMES, FP32RedrawWarning, OutputCheck, assert_outputs_close, check_outputs,
    format_checks, judge_with_redraws, max_abs_relative_error, mere_mare, normwise_error, tolerances,
)
from mamba3_mimo.inputs import make_inputs
from mamba3_mimo.reference import bwd_fwd_reference

SMALL = dict(B=2, S=24, H=4, N=16, P=8, R=2, chunk_size=8)


@pytest.fixture(scope="module")
def fp32_case():
    """(golden float64, bench fp32) on fp32 inputs with the gate."""
    inputs = make_inputs(dtype=torch.float32, **SMALL)
    return bwd_fwd_reference(**inputs), bwd_fwd_reference(**inputs, compute_dtype=torch.float32)


@pytest.fixture(scope="module")
def bf16_case():
    inputs = make_inputs(dtype=torch.bfloat16, **SMALL)
    return bwd_fwd_reference(**inputs), bwd_fwd_reference(**inputs, compute_dtype=torch.bfloat16)


def _replace(outputs, index, value):
    outputs = list(outputs)
    outputs[index] = value
    return tuple(outputs)


# --- the metrics themselves -------------------------------------------------------------------

def test_metric_values():
    g = torch.tensor([1.0, -2.0, 0.0, 4.0])
    x = torch.tensor([1.0, -2.0, 0.5, 3.0])
    assert normwise_error(x, g) == pytest.approx(math.sqrt(0.25 + 1.0) / math.sqrt(21.0))
    assert max_abs_relative_error(x, g) == pytest.approx(1.0 / 4.0)
    mere, mare = mere_mare(x, g, eps=1e-6)
    rel = [0.0, 0.0, 0.5 / 1e-6, 1.0 / (4.0 + 1e-6)]
    assert mere == pytest.approx(sum(rel) / 4) and mare == pytest.approx(max(rel))
    assert normwise_error(g, g) == 0.0 and max_abs_relative_error(g, g) == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_candidate_is_infinite_error(bad):
    g = torch.randn(10, dtype=torch.float64)
    x = g.clone()
    x[3] = bad
    assert normwise_error(x, g) == math.inf
    assert max_abs_relative_error(x, g) == math.inf
    assert mere_mare(x, g) == (math.inf, math.inf)


def test_zero_golden():
    zero = torch.zeros(5)
    assert normwise_error(zero, zero) == 0.0
    assert normwise_error(torch.full((5,), 1e-3), zero) == math.inf
    assert max_abs_relative_error(torch.full((5,), 1e-3), zero) == math.inf


def test_metrics_upcast_half_inputs():
    g = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert normwise_error(g.to(torch.bfloat16), g) == 0.0


def test_tolerances():
    assert tolerances(torch.float32) == tolerances(torch.float32, torch.float32)
    assert (tolerances(torch.float32).normwise, tolerances(torch.float32).near_zero) == (1e-5, 1e-5)
    for half in (torch.float16, torch.bfloat16):
        assert (tolerances(half).normwise, tolerances(half).near_zero) == (1e-2, 2e-2)
        assert tolerances(torch.float32, half) == tolerances(half)


# --- check_outputs ----------------------------------------------------------------------------

@pytest.mark.parametrize("output_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_golden_and_fp32_reference_pass(fp32_case, output_dtype):
    golden, bench = fp32_case
    for candidate in (golden, bench):
        candidate = tuple(x.to(output_dtype) for x in candidate)
        checks = assert_outputs_close(candidate, golden, bench, torch.float32, output_dtype)
        assert [c.name for c in checks] == list(OUTPUT_NAMES)


def test_bf16_bench_itself_passes(bf16_case):
    golden, bench = bf16_case
    assert_outputs_close(bench, golden, bench, torch.bfloat16, torch.bfloat16)
    candidate = tuple(x.float() for x in bench)  # bf16 inputs, fp32 outputs
    assert_outputs_close(candidate, golden, bench, torch.bfloat16, torch.float32)


def _poisons(x):
    """Ways a kernel output goes wrong: NaN, one wrong entry, a block never written."""
    flat = x.reshape(-1)
    nan = flat.clone()
    nan[flat.numel() // 2] = float("nan")
    wrong = flat.clone()
    wrong[flat.numel() // 3] += 10 * flat.abs().max()
    unwritten = flat.clone()
    unwritten[: max(1, flat.numel() // 8)] = 1e4  # stands for torch.empty garbage
    return {"nan": nan.view_as(x), "wrong": wrong.view_as(x), "unwritten": unwritten.view_as(x)}


@pytest.mark.parametrize("index,name", list(enumerate(OUTPUT_NAMES)))
@pytest.mark.parametrize("poison", ["nan", "wrong", "unwritten"])
def test_poisoned_output_fails(fp32_case, index, name, poison):
    golden, bench = fp32_case
    candidate = tuple(x.float() for x in golden)
    bad = _poisons(candidate[index])[poison]
    checks = check_outputs(_replace(candidate, index, bad), golden, bench, torch.float32,
                           torch.float32)
    assert [c.passed for c in checks] == [i != index for i in range(len(checks))]
    assert checks[index].reason and not checks[index].dual_only
    with pytest.raises(AssertionError, match=name):
        assert_outputs_close(_replace(candidate, index, bad), golden, bench, torch.float32,
                             torch.float32)


def test_small_uniform_error_fails_fp32_but_passes_bf16(fp32_case, bf16_case):
    """A 1e-4 relative error everywhere: far above fp32 accuracy, well within bf16 accuracy."""
    golden, bench = fp32_case
    candidate = tuple((x * (1 + 1e-4)).float() for x in golden)
    checks = check_outputs(candidate, golden, bench, torch.float32, torch.float32)
    assert not any(c.passed for c in checks)
    golden, bench = bf16_case
    candidate = tuple((x * (1 + 1e-4)).float() for x in golden)
    assert_outputs_close(candidate, golden, bench, torch.bfloat16, torch.float32)


def test_dual_benchmark_can_fail(fp32_case):
    """Errors within the normwise bound that the MARE or MERE comparison with the bench catches."""
    golden, bench = fp32_case
    index = OUTPUT_NAMES.index("dmimo_o")
    g = golden[index]
    passing = check_outputs(golden, golden, bench, torch.float32, torch.float64)[index]

    # MARE: a 10% error on the smallest entry barely moves the norm.
    x = g.clone()
    smallest = g.abs().argmin()
    x.view(-1)[smallest] *= 1.1
    check = check_outputs(_replace(golden, index, x), golden, bench, torch.float32,
                          torch.float64)[index]
    assert check.normwise <= 1e-5 and not check.passed and "MARE" in check.reason and check.dual_only

    # MERE: the same small relative error everywhere, 1.5x what the MERE bound allows.
    rel = 1.5 * (2 * passing.mere_bench + 1e-6)
    assert rel < 1e-5 <= 10 * passing.mare_bench + 1e-5  # normwise and MARE stay within bounds
    check = check_outputs(_replace(golden, index, g * (1 + rel)), golden, bench, torch.float32,
                          torch.float64)[index]
    assert check.normwise <= 1e-5 and not check.passed and check.reason.startswith("MERE") and check.dual_only
    assert not passing.dual_only


def test_near_zero_metric_ignores_normwise(fp32_case):
    """qk_dot / dmimo_z are judged by max-abs-relative only, and it does catch errors."""
    golden, bench = fp32_case
    for name in NEAR_ZERO_OUTPUTS:
        index = OUTPUT_NAMES.index(name)
        g = golden[index]
        checks = check_outputs(_replace(golden, index, g + 1e-6 * g.abs().max()), golden, bench,
                               torch.float32, torch.float64)
        assert checks[index].passed and checks[index].mere is None
        checks = check_outputs(_replace(golden, index, g + 1e-4 * g.abs().max()), golden, bench,
                               torch.float32, torch.float64)
        assert not checks[index].passed and "max-abs-rel" in checks[index].reason


def test_bf16_outputs_judged_against_rounded_golden(fp32_case):
    golden, bench = fp32_case
    rounded = tuple(g.to(torch.bfloat16) for g in golden)
    checks = assert_outputs_close(rounded, golden, bench, torch.float32, torch.bfloat16)
    for c in checks:  # exactly the rounded golden: no error at all
        assert c.normwise == 0.0 and c.mere in (None, 0.0) and c.near_zero in (None, 0.0)
    # One bf16 ulp up everywhere is not the rounded golden, and the dual benchmark notices.
    ulp_up = tuple(torch.nextafter(r, torch.full_like(r, math.inf)) for r in rounded)
    checks = check_outputs(ulp_up, golden, bench, torch.float32, torch.bfloat16)
    assert checks[0].normwise > 0 and not checks[0].passed


def test_wrong_dtype_or_shape_fails(fp32_case):
    golden, bench = fp32_case
    candidate = tuple(x.float() for x in golden)
    checks = check_outputs(_replace(candidate, 0, candidate[0].double()), golden, bench,
                           torch.float32, torch.float32)
    assert not checks[0].passed and "dtype" in checks[0].reason
    checks = check_outputs(_replace(candidate, 2, candidate[2][:1]), golden, bench,
                           torch.float32, torch.float32)
    assert not checks[2].passed and "shape" in checks[2].reason


def test_none_outputs():
    inputs = make_inputs(dtype=torch.float32, z=False, **SMALL)
    golden = bwd_fwd_reference(**inputs)
    bench = bwd_fwd_reference(**inputs, compute_dtype=torch.float32)
    assert golden[3] is None and golden[4] is None
    candidate = tuple(None if x is None else x.float() for x in golden)
    checks = assert_outputs_close(candidate, golden, bench, torch.float32, torch.float32)
    assert checks[3].passed and checks[4].passed
    # A gate output where none is expected, and a missing output where one is.
    checks = check_outputs(_replace(candidate, 4, torch.zeros(2, 24, 4, 8)), golden, bench,
                           torch.float32, torch.float32)
    assert not checks[4].passed and checks[4].reason == "expected None"
    checks = check_outputs(_replace(candidate, 0, None), golden, bench, torch.float32,
                           torch.float32)
    assert not checks[0].passed and checks[0].reason == "missing output"


def test_format_checks_table(fp32_case):
    golden, bench = fp32_case
    candidate = tuple(x.float() for x in golden)
    table = format_checks(check_outputs(_replace(candidate, 0, candidate[0] * 2), golden, bench,
                                        torch.float32, torch.float32))
    lines = table.splitlines()
    assert len(lines) == 1 + len(OUTPUT_NAMES)
    assert lines[1].startswith("states") and "FAIL" in lines[1]
    assert all(line.rstrip().endswith("ok") for line in lines[2:])
    # Columns line up: every row has the result column at the same offset.
    assert len({line.index("ok") if "ok" in line else line.index("FAIL")
                for line in lines[1:]}) == 1


# --- fp32 re-draws after a dual-benchmark failure -------------------------------------------------------------

def _verdicts(*draws):
    """A fake ``judge``: the n-th call returns the n-th draw's checks (each "pass", "dual" or "normwise" for
    dmimo_o, every other output passing) and records the seeds it was called with."""
    seeds = []

    def judge(seed):
        kind = draws[len(seeds)]
        seeds.append(seed)
        checks = [OutputCheck(name, passed=True) for name in OUTPUT_NAMES]
        if kind != "pass":
            checks[2] = OutputCheck("dmimo_o", passed=False, dual_only=kind == "dual",
                                    reason="MERE 3e-06 > 2*bench+1e-6" if kind == "dual" else "normwise 1e-04 > 1e-05")
        return checks

    return judge, seeds


def test_redraw_passes_after_a_dual_only_fp32_failure():
    judge, seeds = _verdicts("dual", *["pass"] * FP32_REDRAWS)
    with pytest.warns(FP32RedrawWarning, match="seed 1234 failed only the dual benchmark .dmimo_o: MERE"):
        checks = judge_with_redraws(judge, 1234, torch.float32)
    assert all(c.passed for c in checks)
    assert len(seeds) == 1 + FP32_REDRAWS and len(set(seeds)) == len(seeds) and seeds[0] == 1234


@pytest.mark.parametrize("draws, dtype, calls", [
    (("normwise",), torch.float32, 1),                      # any other failure: at once
    (("dual",), torch.bfloat16, 1),                         # 16-bit inputs: no re-draw
    (("dual", "pass", "dual"), torch.float32, 3),           # every re-draw must pass
    (("dual", "normwise"), torch.float32, 2),
])
def test_redraw_fails(draws, dtype, calls):
    judge, seeds = _verdicts(*draws)
    with pytest.raises(AssertionError, match="dmimo_o") as raised:
        judge_with_redraws(judge, 99, dtype)
    assert len(seeds) == calls
    assert str(raised.value).count("seed ") == calls  # every draw's table is reported


def test_passing_draw_is_not_redrawn():
    judge, seeds = _verdicts("pass")
    judge_with_redraws(judge, 5, torch.float32)
    assert seeds == [5]
