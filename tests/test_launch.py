"""ops/launch.py: launches through the compiled kernel's launcher once a specialization is known.

The key must separate every launch Triton would compile differently (dtype, 16-byte alignment, int
values, constexprs), and a cached launch must compute what the JIT's does.  The CPU runs check the key and
the argument handling; the GPU runs launch for real.
"""

import os

import pytest
import torch
from conftest import requires_cuda, seed_for

import mamba3_mimo.ops.launch as launch_module
from mamba3_mimo.ops.token_tables import _token_tables_kernel, token_tables


def test_key_separates_dtype_and_alignment():
    x = torch.zeros(64, dtype=torch.float32)
    assert launch_module._spec(x) == (torch.float32, True)
    assert launch_module._spec(x[1:]) == (torch.float32, False)  # 4 bytes in: not 16-byte aligned
    assert launch_module._spec(x[4:]) == (torch.float32, True)
    assert launch_module._spec(x.to(torch.bfloat16)) == (torch.bfloat16, True)
    assert launch_module._spec(7) == 7 and launch_module._spec(None) is None
    assert launch_module._spec(0.5) is float
    assert launch_module._spec(True) != launch_module._spec(1)


def test_trailing_args_take_kwargs_then_defaults():
    n_positional = 10  # the pointers and S, H, RD of _token_tables_kernel
    trailing = launch_module._trailing_args(_token_tables_kernel, n_positional,
                                            dict(BLOCK_T=256, BLOCK_RD=16, ANGLE_ROWS=32, FAST_TRIG=False,
                                                 num_warps=4))
    assert trailing == (256, 16, 32, False)
    with pytest.raises(TypeError, match="ANGLE_ROWS was not given"):
        launch_module._trailing_args(_token_tables_kernel, n_positional, dict(BLOCK_T=256, BLOCK_RD=16))
    with pytest.raises(TypeError, match="pass tensor BLOCK_T positionally"):
        launch_module._trailing_args(_token_tables_kernel, n_positional,
                                     dict(BLOCK_T=torch.zeros(1), BLOCK_RD=16, ANGLE_ROWS=32, FAST_TRIG=False))


def _tables_inputs(gen, B, H, S, RD, device, offset=0):
    """dt, trap, angles on ``device``; with ``offset`` every tensor is a view ``offset`` elements into
    a larger buffer (misaligned for offsets that are not a multiple of 4 fp32)."""
    def view(shape, scale):
        numel = torch.Size(shape).numel()
        buffer = torch.randn(numel + offset, generator=gen) * scale
        return buffer.to(device)[offset:].view(shape)
    return view((B, H, S), 0.1), view((B, H, S), 1.0), view((B, S, H, RD), 30.0)


@requires_cuda
def test_cached_launch_matches_jit_and_respecializes():
    """The second call goes through the cached launcher and is bitwise the JIT's; misaligned views,
    launched after aligned ones, get their own specialization and stay exact."""
    gen = torch.Generator().manual_seed(seed_for("cached_launch"))
    aligned = _tables_inputs(gen, 2, 3, 300, 16, "cuda")
    dt, trap, angles = aligned
    first = token_tables(dt=dt, trap=trap, angles=angles)
    entries = len(launch_module._compiled)
    cached = token_tables(dt=dt, trap=trap, angles=angles)
    assert len(launch_module._compiled) == entries  # a hit
    os.environ["MAMBA3_MIMO_JIT_LAUNCH"] = "1"
    try:
        through_jit = token_tables(dt=dt, trap=trap, angles=angles)
    finally:
        del os.environ["MAMBA3_MIMO_JIT_LAUNCH"]
    for a, b, c in zip(first, cached, through_jit):
        assert torch.equal(a, b) and torch.equal(a, c)

    dt, trap, angles = _tables_inputs(gen, 2, 3, 300, 16, "cuda", offset=1)
    assert dt.data_ptr() % 16 != 0
    gamma, trap_scale, cos_angles, sin_angles = token_tables(dt=dt, trap=trap, angles=angles)
    assert len(launch_module._compiled) == entries + 1
    want_gamma = dt.double() * torch.sigmoid(trap.double())
    torch.testing.assert_close(gamma.double(), want_gamma, atol=1e-6, rtol=1e-5)  # dt < 0 is fine here
    torch.testing.assert_close(cos_angles.double(), angles.double().cos(), atol=2e-6, rtol=0)
    torch.testing.assert_close(sin_angles.double(), angles.double().sin(), atol=2e-6, rtol=0)


def test_plan_key_separates_alignment_config_and_implementation():
    from mamba3_mimo.api import launch_plan_key
    from mamba3_mimo.ops.production import ScanConfig

    x = torch.zeros(64)
    signature = (((64,), torch.float32),)
    aligned = launch_plan_key(signature, "production", None, (x, None, x[4:]))
    assert aligned == launch_plan_key(signature, "production", None, (x[8:], None, x))
    assert aligned != launch_plan_key(signature, "production", None, (x, None, x[1:]))
    assert aligned != launch_plan_key(signature, "production", None, (x, x, x))  # an optional tensor given
    assert aligned != launch_plan_key(signature, "stage0", None, (x, None, x))
    assert aligned != launch_plan_key(signature, "production", ScanConfig(block_p=16, n_segments=1), (x, None, x))
    assert launch_plan_key(None, "production", None, (x,)) is None  # unhashable signature: no plan


@requires_cuda
def test_launch_plan_replays_the_first_calls_kernels(monkeypatch):
    """A second call with the same signature replays the plan's kernels (no new slots), bitwise equal to the
    first call and to the JIT's launches; a misaligned input makes a new plan whose results match; the plan
    check catches a slot that holds a kernel its full key does not select."""
    from mamba3_mimo.api import bwd_fwd
    from mamba3_mimo.inputs import make_inputs

    monkeypatch.setenv("MAMBA3_MIMO_CHECK_PLAN", "1")
    monkeypatch.setattr(launch_module, "_plan_slots", {})  # every slot below is this test's
    inputs = make_inputs(B=1, S=96, H=2, N=32, P=32, R=2, chunk_size=16, device="cuda",
                         seed=seed_for("launch_plan"))
    first = bwd_fwd(**inputs, output_dtype=torch.float32)
    slots = dict(launch_module._plan_slots)
    second = bwd_fwd(**inputs, output_dtype=torch.float32)
    assert launch_module._plan_slots == slots and len(slots) >= 5
    monkeypatch.setenv("MAMBA3_MIMO_JIT_LAUNCH", "1")
    through_jit = bwd_fwd(**inputs, output_dtype=torch.float32)
    monkeypatch.delenv("MAMBA3_MIMO_JIT_LAUNCH")
    for a, b, c in zip(first, second, through_jit):
        assert a is None or (torch.equal(a, b) and torch.equal(a, c))

    buffer = torch.empty(inputs["v"].numel() + 1, device="cuda", dtype=inputs["v"].dtype)
    shifted = buffer[1:].view(inputs["v"].shape)
    shifted.copy_(inputs["v"])
    assert shifted.data_ptr() % 16 != 0
    misaligned = bwd_fwd(**dict(inputs, v=shifted), output_dtype=torch.float32)
    assert len(launch_module._plan_slots) > len(slots)
    for a, b in zip(first, misaligned):
        assert a is None or torch.allclose(a, b, rtol=1e-6, atol=1e-6)

    # Swap the first two slots of the aligned plan (two different kernels): a replay must notice.
    (key,) = {slot[0] for slot in slots}
    (k0, *entry0), (_, *entry1) = slots[(key, 0)], slots[(key, 1)]
    launch_module._plan_slots[(key, 0)] = (k0, *entry1)
    try:
        with pytest.raises(AssertionError, match="launch plan"):
            bwd_fwd(**inputs, output_dtype=torch.float32)
    finally:
        launch_module._plan_slots[(key, 0)] = (k0, *entry0)
