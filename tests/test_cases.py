"""The declarative suite of mamba3_mimo/case_data/bwd_fwd.yaml (SPEC section 8).

The file on disk is what the generator makes, its pairwise cases cover every pair of factor
levels, its profiles are the contract's numbers, and every case meets the accuracy contract for
both implementations: ``cpu`` cases everywhere (in the Triton interpreter without CUDA, which
tests/conftest.py switches on), ``gpu`` cases only where CUDA is present.
"""

import itertools

import pytest
import torch
import yaml

from mamba3_mimo import cases
from mamba3_mimo.accuracy import format_checks, tolerances
from mamba3_mimo.api import IMPLEMENTATIONS

HAS_CUDA = torch.cuda.is_available()
SUITE = cases.load_suite()
CASES = cases.load_cases()


def test_yaml_on_disk_is_the_generated_suite():
    generated = yaml.safe_load(cases.render_yaml(cases.generate_suite()))
    assert cases.load_suite() == generated, "run `python -m mamba3_mimo.cases --write-yaml` and commit the file"


def test_tests_cases_path_is_the_packaged_suite():
    """tests/cases/bwd_fwd.yaml (where issue 4 asks for it) is the file the installed CLI reads."""
    import pathlib

    here = pathlib.Path(__file__).parent / "cases" / "bwd_fwd.yaml"
    assert yaml.safe_load(here.read_text()) == cases.load_suite()


def test_suite_layout():
    assert len(CASES) == 24
    assert len({c.name for c in CASES}) == 24 and len({c.seed for c in CASES}) == 24
    by_group = {g: [c for c in CASES if c.group == g] for g in ("pairwise", "tail", "official_quick", "official_full")}
    assert sum(map(len, by_group.values())) == 24
    assert sum(c.size == "cpu" for c in CASES) >= 12
    assert all(c.size == "cpu" for c in by_group["pairwise"] + by_group["tail"])

    official = by_group["official_quick"] + by_group["official_full"]
    tags = {f"N{c.shape['N']}_P{c.shape['P']}_R{c.shape['R']}_C{c.shape['chunk_size']}" for c in official}
    assert tags == set(cases.OFFICIAL_SHAPES) and len(official) == 11
    for c in official:
        assert (c.shape["B"], c.shape["S"], c.shape["H"], c.shape["G"]) == (4, 2048, 16, 1)
        assert (c.dtype, c.output_dtype, c.z, c.d, c.size) == ("bfloat16", "bfloat16", True, True, "gpu")
    quick = by_group["official_quick"]
    assert len(quick) == 5 and {c.shape["R"] for c in quick} == {1, 2, 4}
    assert {16, 256} <= {c.shape["N"] for c in quick} and {64, 128} <= {c.shape["P"] for c in quick}

    tails = by_group["tail"]
    assert {c.shape["S"] for c in tails} == {33, 40, 48, 50}
    assert {c.shape["chunk_size"] for c in tails} == {16, 32}
    assert all(c.shape["S"] % c.shape["chunk_size"] for c in tails)


def _pairwise_levels(case):
    """The factor levels a pairwise case was made from (inverse of the generator's mapping)."""
    H, G = case.shape["H"], case.shape["G"]
    return dict(dtype=case.dtype, G="1" if G == 1 else "H" if G == H else "H/2", H=H, z=case.z, d=case.d,
                B=case.shape["B"], S=case.shape["S"],
                output_dtype="float32" if case.output_dtype == "float32" else "half")


def test_pairwise_cases_cover_every_pair():
    factors = SUITE["pairwise"]["factors"]
    rows = [_pairwise_levels(c) for c in CASES if c.group == "pairwise"]
    for a, b in itertools.combinations(factors, 2):
        for la, lb in itertools.product(factors[a], factors[b]):
            if cases.pairwise_allowed({a: la, b: lb}):
                assert any(r[a] == la and r[b] == lb for r in rows), f"pair {a}={la}, {b}={lb} not covered"
    for c in CASES:
        if c.group == "pairwise":
            assert all(c.shape[k] == v for k, v in SUITE["pairwise"]["fixed"].items())


def test_profiles_are_the_contract():
    assert SUITE["tolerance_profiles"] == cases.TOLERANCE_PROFILES
    for c in CASES:
        contract = tolerances(cases.DTYPES[c.dtype], cases.DTYPES[c.output_dtype])
        assert c.limits == dict(cases.DUAL_BENCHMARK, normwise=contract.normwise, near_zero=contract.near_zero), c.name


def _params():
    for case, impl in itertools.product(CASES, IMPLEMENTATIONS):  # case-major: both impls reuse the references
        marks = [] if case.size == "cpu" else [
            pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="gpu-sized case: needs a CUDA device")]
        yield pytest.param(case, impl, id=f"{case.name}-{impl}", marks=marks)


@pytest.mark.parametrize("case, impl", _params())
def test_case_meets_accuracy_contract(case, impl):
    result = cases.run_case(case, impl, "cuda" if HAS_CUDA else "cpu")
    assert result.passed, f"{case.name} ({impl}) violates the accuracy contract:\n{format_checks(result.checks)}"
