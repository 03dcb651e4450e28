"""The TMA scan probe (benchmarks/tma_scan_probe.py) computes what chunk_local_states computes, so that its GPU
timings compare like with like."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import tma_scan_probe  # noqa: E402

# The interpreter's descriptor loads take tensor coordinates through numpy's deprecated array-to-int conversion.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def test_probe_matches_chunk_local_states():
    # The outputs start as NaN: an element the probe leaves unwritten reads as an infinite error.
    errors = tma_scan_probe.check_small()
    assert set(errors) == {(1, False), (2, True)}
    for variant, error in errors.items():
        assert error <= 1e-6, (variant, error)


def test_probe_refuses_shapes_without_boxes():
    with pytest.raises(ValueError, match="powers of two"):
        tma_scan_probe.tma_local_states(**_scan_args(R=3))


def _scan_args(R):
    import torch
    import triton.language as tl
    from mamba3_mimo.inputs import make_inputs

    inputs = make_inputs(B=1, S=32, H=2, G=1, N=32, P=32, R=R, chunk_size=8, dtype=torch.float32)
    scan = tma_scan_probe.scan_arguments(inputs, n_segments=2, block_half=16, block_p=16, num_warps=4,
                                         dot_dtype=tl.float32, dot_precision="ieee")
    return dict(scan, states=torch.empty(1))
