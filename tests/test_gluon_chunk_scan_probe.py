"""The Gluon chunk_scan probe (benchmarks/gluon_chunk_scan_probe.py), a candidate never run on a GPU yet: it compiles
for sm_90 within the 99 KB bound, and its programs, replayed in torch from its own descriptors, compute what the
production chunk_scan computes (interpreter).  Its Gluon code itself can only be checked on a Hopper GPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import gluon_chunk_scan_probe  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.mark.parametrize("split_loads", [False, True], ids=["one-barrier", "split-loads"])
def test_probe_compiles_within_99_kb(split_loads):
    # In a process of its own: Gluon cannot compile in a session that runs the interpreter (the CPU tests).
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import aot_report, gluon_chunk_scan_probe as p,"
            f" sass_report; k = p.compile_for_sm90('N128_P64_R4_C16', split_loads={split_loads});"
            " ops = [op for _, op, _ in sass_report.sass_ops(k)];"
            " print(json.dumps(dict(aot_report.resources(k), HGMMA=sum(op.startswith('HGMMA') for op in ops),"
            " SYNCS=sum(op.startswith('SYNCS') for op in ops))))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["shared"] <= 101_376 and found["stack"] == 0, found
    # Three wgmma chains: scores and q~ @ state over N = 128 (4 x 4 K-steps of 16 each), the mixing (4).
    assert found["HGMMA"] >= 20, found
    # The mbarrier operations: init, expect, wait (and invalidate) of one barrier, or of two.
    assert found["SYNCS"] == (10 if split_loads else 5), found


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="production chunk_scan on CPU tensors: interpreter")


@CPU_ONLY
def test_emulated_programs_match_the_production_chunk_scan():
    # Chunks of 16, spans of two chunks of 8 (the two-pass official shapes' form), and the local-state schedule's
    # entry states (with the states written back), at N = 128 and at N = 64 (32-wide pieces).  Planted faults gave
    # 0.079 (no exp(da_cs) on the state term), 0.10 (no gamma on the diagonal), NaN (raw_y rows token-major), an index
    # error (the RD mask one column off), 0.046 in the spans only (da_cs not re-based to the span's start), states
    # 0.63 / 0.16 (no entry state; the previous chunk's decay).
    errors = gluon_chunk_scan_probe.check_emulation()
    assert max(errors.values()) <= 1e-2, errors


def test_probe_refuses_shapes_its_boxes_do_not_cover():
    problems = gluon_chunk_scan_probe.shape_problems(S=100, R=4, N=96, P=96, RD=16, H=16, chunk_size=8, block_p=64)
    assert len(problems) == 4  # N, R * C, the P tile, S % C
    # N256_P64_R4_C8 in spans of two: 122 KB of boxes and operands.
    assert gluon_chunk_scan_probe.shape_problems(S=2048, R=4, N=256, P=64, RD=64, H=16, chunk_size=8, block_p=64,
                                                 span_chunks=2) == ["shared memory within 99 KB, got 124936 at N=256"]
    assert not gluon_chunk_scan_probe.shape_problems(S=2048, R=4, N=128, P=128, RD=32, H=16, chunk_size=8, block_p=64,
                                                     span_chunks=2)
    # N = 64 at R8_C8: 8 tokens, fewer rows than the 32-column rotation layout covers (rows would repeat).
    assert gluon_chunk_scan_probe.shape_problems(S=2048, R=8, N=64, P=64, RD=16, H=16, chunk_size=8,
                                                 block_p=64) == ["a span of at least 16 tokens, got 8"]


@CPU_ONLY
@pytest.mark.parametrize("N, chunk_size, span_chunks, local", [(128, 16, 1, False), (128, 8, 2, False),
                                                               (128, 16, 1, True), (64, 16, 1, True)])
def test_probe_in_production_meets_the_contract_through_its_emulation(monkeypatch, N, chunk_size, span_chunks, local):
    """The host wiring the GPU timing uses (``probe_in_production``): a two-pass production call whose chunk_scan is
    the probe, here its torch replay, meets the accuracy contract against the float64 reference."""
    from conftest import run_and_check, seed_for

    from mamba3_mimo.ops.production import ScanConfig

    monkeypatch.setattr(gluon_chunk_scan_probe, "gluon_chunk_scan", gluon_chunk_scan_probe.emulate)
    # On the CPU bf16 outputs are written in fp32 (api.kernel_output_dtype), the state hand-off with them.
    monkeypatch.setattr(gluon_chunk_scan_probe, "STATES_DTYPES", (torch.bfloat16, torch.float32))
    config = ScanConfig(block_p=64, n_segments=2, block_half=N // 2, out_block_p=64, split_gate=True,
                        half_raw_y=True, out_span_chunks=span_chunks, local_states=local)
    with gluon_chunk_scan_probe.probe_in_production() as patch:
        run_and_check("production", device="cpu", seed=seed_for("probe_in_production"), dtype=torch.bfloat16,
                      output_dtype=torch.bfloat16, config=config, B=1, S=64, H=2, G=1, N=N, P=64, R=4,
                      chunk_size=chunk_size)
    assert patch.calls == [1]
