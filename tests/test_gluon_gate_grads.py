"""The Gluon gate_grads (mamba3_mimo/ops/gluon_gate_grads.py) and the production path's ``gluon_gate`` knob.

Gluon kernels do not run in the Triton interpreter: on the CPU the kernel is compiled for sm_90 on the official
shapes (registers, no spill, shared memory within the 99 KB bound), its reasons for refusing a call are checked,
and the knob is shown inert where the kernel does not apply.  On a Hopper GPU its dz and partials are compared with
the Triton ``gate_grads`` on the same scratch (tails, token ranges, with and without Z and D, R = 1..8, P tiles of 32
and 64), and production calls with the knob against the reference.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_knob_inert, assert_next_call_replays, spy_on_replays

from mamba3_mimo import api
from mamba3_mimo.inputs import make_inputs
from mamba3_mimo.ops import gluon_gate_grads
from mamba3_mimo.ops.gate_grads import gate_grads
from mamba3_mimo.ops.production import choose_config

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture(scope="module")
def compiled():
    """The check script's --compile-only records (a process of its own: Gluon is compiled for sm_90 there, outside
    the interpreter the CPU tests run in)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gluon_gate_grads_check.py")
    run = subprocess.run([sys.executable, script, "--compile-only"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_compiles_on_the_official_gate_shapes_without_spill_within_99_kb(compiled):
    # Every official shape whose dispatcher config runs gate_grads (Z on): all but R1_C64 and N16 (the gate in
    # chunk_scan: sections 18 and 43).
    assert len(compiled) == 9, compiled
    assert not {"N16_P64_R4_C8", "N128_P64_R1_C64"} & {record["case"] for record in compiled}
    for record in compiled:
        R = int(record["case"].split("_")[2][1:])
        assert record["num_buffers"] == gluon_gate_grads.tile_variant(R)["num_buffers"]
        assert record["stack"] == 0 and record["regs"] <= (128 if R <= 4 else 255), record
        assert record["shared"] <= gluon_gate_grads.SMEM_LIMIT, record
        assert record["shared"] >= gluon_gate_grads.shared_bytes(R=R, block_p=record["block_p"],
                                                                  block_t=record["block_t"],
                                                                  num_buffers=record["num_buffers"])


def _scratch(*, B=2, S=100, H=2, R=4, P=64, scale_block_p=64, z=True, d=True, device="cuda", seed=0,
             dtype=torch.bfloat16):
    """What chunk_scan hands gate_grads: an fp16 raw_y with per-row inverse scales, and the activations."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*size, to=torch.float32):
        return torch.randn(*size, generator=gen).to(device=device, dtype=to)

    n_scale = -(-P // scale_block_p)
    return dict(raw_y=rand(B, H, S, R, P, to=torch.float16),
                raw_y_scale=(torch.rand(B, H, S, R, n_scale, generator=gen) + 0.5).to(device),
                scale_block_p=scale_block_p, dout=rand(B, S, H, P, to=dtype),
                z=rand(B, S, H, P, to=dtype) if z else None,
                mimo_o=rand(H, R, P), mimo_z=rand(H, R, P) if z else None,
                dz=torch.full((B, S, H, P), float("nan"), device=device, dtype=dtype) if z else None,
                **(dict(v=rand(B, S, H, P, to=dtype), mimo_v=rand(H, R, P), d=rand(H)) if d else {}))


def test_unsupported_names_the_reason(device):
    scratch = _scratch(device=device)
    reason = gluon_gate_grads.unsupported(**scratch, block_p=64)
    if not HOPPER:
        assert reason is not None and "Hopper" in reason
        return
    assert reason is None
    assert "fp16 raw_y" in gluon_gate_grads.unsupported(**dict(scratch, raw_y=scratch["raw_y"].float()), block_p=64)
    assert "power of two" in gluon_gate_grads.unsupported(**_scratch(R=3), block_p=64)
    assert "16-bit dout" in gluon_gate_grads.unsupported(**_scratch(dtype=torch.float32), block_p=64)
    odd = torch.empty(scratch["dout"].numel() + 1, device=device, dtype=torch.bfloat16)[1:].view(scratch["dout"].shape)
    assert "dout contiguous and 16-byte aligned" in gluon_gate_grads.unsupported(**dict(scratch, dout=odd), block_p=64)
    with pytest.raises(ValueError, match="gluon_gate_grads: needs R a power of two"):
        gluon_gate_grads.gluon_gate_grads(**_scratch(R=3))


def test_gluon_gate_knob_is_inert_where_the_kernel_does_not_apply(device, monkeypatch):
    """Off Hopper (here: the interpreter) and on calls it does not cover (R = 3), ``gluon_gate`` runs the Triton
    gate_grads: the same outputs bit for bit, no Gluon call."""
    calls = []
    monkeypatch.setattr(gluon_gate_grads, "gluon_gate_grads", lambda **kw: calls.append(1))
    inputs = make_inputs(B=1, S=48, H=2, G=1, N=32, P=32, R=3, chunk_size=16, dtype=torch.bfloat16, seed=3,
                         device=device)
    base = dataclasses.replace(choose_config(B=1, H=2, S=48, N=32, P=32, R=3, chunk_size=16, num_sms=4),
                               split_gate=True, gate_in_scan=False)
    assert_knob_inert(inputs, base, "gluon_gate")
    assert calls == []


# (shape, tokens a program): a partial last tile and range (S = 100), several ranges, P = 128 over two P tiles, R = 8 on
# 32-column tiles, R = 1 and 2, no Z, no D, fp16 activations, the whole sequence in one range.
GPU_CASES = [
    (dict(), 32),
    (dict(S=257, P=128, scale_block_p=128), 64),
    (dict(P=128, scale_block_p=64), 48),
    (dict(R=8, P=64), 40),
    (dict(R=1), 16),
    (dict(R=2, S=64), 256),
    (dict(z=False), 32),
    (dict(d=False), 24),
    (dict(z=False, d=False, P=32, scale_block_p=32), 32),
    (dict(dtype=torch.float16, H=3), 64),
]


@pytest.mark.skipif(not HOPPER, reason="Gluon's TMA kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("variant", [dict(), dict(num_buffers=2, tokens_per_thread=1),
                                     dict(num_buffers=3, tokens_per_thread=4), dict(ranks_per_thread=4)],
                         ids=["default", "short", "long", "ranks_in_thread"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c[0].items()) or "base")
def test_matches_the_triton_gate_grads(case, variant):
    shape, tokens = case
    scratch = _scratch(**shape, seed=len(GPU_CASES))
    want_dphi, want_dzeta = gate_grads(**scratch, tokens_per_program=tokens)
    want_dz = None if scratch["dz"] is None else scratch["dz"].float().clone()
    if want_dz is not None:
        scratch["dz"].fill_(float("nan"))
    dphi, dzeta = gluon_gate_grads.gluon_gate_grads(**scratch, tokens_per_program=tokens, **variant)
    # Token ranges may differ (the tiles differ), so the partials are compared summed over them.
    pairs = [("dphi", dphi.sum(2), want_dphi.sum(2))]
    if want_dz is not None:
        pairs += [("dzeta", dzeta.sum(2), want_dzeta.sum(2)), ("dz", scratch["dz"].float(), want_dz)]
    else:
        assert dzeta is None
    for name, got, want in pairs:
        assert torch.isfinite(got).all(), name
        # fp32 sums in another order; dz is rounded to the activations' dtype by both.
        tol = 2 ** -7 if name == "dz" else 1e-4
        err = ((got - want).abs() / (want.abs() + want.abs().max() * 1e-3)).max().item()
        assert err <= tol, (name, err)


# Official-like shapes at test size on the split stage with the fp16 scratch: R = 4 over a P tile of 64 with D, and
# P = 128 (two tiles) at R = 2 without D; the knob is on and the Gluon kernel must run.
PRODUCTION_CASES = [
    dict(N=64, P=64, R=4, chunk_size=16, S=160, H=4, G=2, d=True),
    dict(N=128, P=128, R=2, chunk_size=32, S=256, H=2, G=1, d=False),
]


@pytest.mark.skipif(not HOPPER, reason="Gluon's TMA kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("case", PRODUCTION_CASES, ids=["R4-D", "P128-R2"])
def test_production_with_gluon_gate_matches_the_reference(check_kernel, monkeypatch, case):
    calls = []
    real = gluon_gate_grads.gluon_gate_grads
    monkeypatch.setattr(gluon_gate_grads, "gluon_gate_grads", lambda **kw: (calls.append(1), real(**kw))[1])
    shape = {name: case[name] for name in ("N", "P", "R", "chunk_size", "S", "H")}
    config = dataclasses.replace(choose_config(B=2, num_sms=132, **shape), split_gate=True, gate_in_scan=False,
                                 gluon_gate=True)
    check_kernel("production", B=2, G=case["G"], dtype=torch.bfloat16, output_dtype=torch.bfloat16, config=config,
                 d=case["d"], **shape)
    assert calls, "the Gluon gate_grads did not run"


@pytest.mark.skipif(not HOPPER, reason="Gluon's TMA kernel runs on Hopper GPUs only")
def test_production_call_with_gluon_gate_replays(monkeypatch, poison_outputs):
    """The second call of a signature replays the whole call, the Gluon gate_grads with its descriptors (one over the
    call's raw_y scratch) rebuilt around the new tensors, into NaN-poisoned outputs; bitwise equal to the same call
    through Triton's JIT."""
    replays = spy_on_replays(monkeypatch)  # the first call below records
    calls = []
    real = gluon_gate_grads.gluon_gate_grads
    monkeypatch.setattr(gluon_gate_grads, "gluon_gate_grads", lambda **kw: (calls.append(1), real(**kw))[1])
    case = PRODUCTION_CASES[0]
    shape = {name: case[name] for name in ("N", "P", "R", "chunk_size", "S", "H")}
    config = dataclasses.replace(choose_config(B=2, num_sms=132, **shape), split_gate=True, gate_in_scan=False,
                                 gluon_gate=True)

    def call(seed):
        inputs = make_inputs(B=2, G=case["G"], dtype=torch.bfloat16, device="cuda", seed=seed, **shape)
        return inputs, api.bwd_fwd(**inputs, output_dtype=torch.bfloat16, config=config)

    call(1)
    assert calls == [1], "the Gluon gate_grads did not run"
    assert_next_call_replays(monkeypatch, call, replays, seed=2, config=config, output_dtype=torch.bfloat16,
                             calls=calls)
    assert calls == [1, 1]  # once when recorded, once through the JIT
