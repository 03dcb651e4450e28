"""Robustness of both implementations: edge inputs, device handling, CUDA graphs, determinism,
tensors beyond 2^31 elements, and Triton compile caching.

The edge-input tests run everywhere (the CPU through the Triton interpreter); the rest needs CUDA
and is skipped with a reason without it.
"""

import dataclasses
import math

import pytest
import torch
import triton

import mamba3_mimo.api as api
from conftest import HAS_CUDA, requires_cuda, seed_for, to_device
from mamba3_mimo.accuracy import assert_outputs_close
from mamba3_mimo.inputs import build_discretization, make_inputs
from mamba3_mimo.ops import chunk_output, chunk_state, stage0
from mamba3_mimo.ops.production import ScanConfig, choose_config
from mamba3_mimo.reference import bwd_fwd_reference

IMPLS = ("production", "stage0")
F32, BF16 = torch.float32, torch.bfloat16
OUTPUT_NAMES = ("states", "qk_dot", "dmimo_o", "dmimo_z", "dz")
# bf16 activations as well on the GPU; the interpreter is too slow for more than fp32 on the CPU.
EDGE_DTYPES = (F32, BF16) if HAS_CUDA else (F32,)
EDGE_SHAPE = dict(B=2, S=200, H=4, G=2, N=64, P=64, R=4, chunk_size=16) if HAS_CUDA else \
    dict(B=1, S=40, H=2, G=1, N=16, P=16, R=2, chunk_size=16)


def assert_same(got, want, what=""):
    """Bitwise equality of two output tuples (None where the other is None)."""
    for name, x, y in zip(OUTPUT_NAMES, got, want):
        if y is None:
            assert x is None, f"{what} {name}: expected None"
        else:
            assert x.shape == y.shape and x.dtype == y.dtype, f"{what} {name}"
            assert torch.equal(x, y), f"{what} {name}: max diff {(x.float() - y.float()).abs().max().item()}"


def check_against_reference(outputs, inputs, dtype, output_dtype=F32):
    ref_inputs = to_device(inputs, "cpu")
    golden = bwd_fwd_reference(**ref_inputs, compute_dtype=torch.float64)
    bench = bwd_fwd_reference(**ref_inputs, compute_dtype=dtype)
    assert_outputs_close(outputs, golden, bench, dtype, output_dtype)


# --- edge inputs, any device ----------------------------------------------------------------------

def strong_decay(inputs):
    """Replace the discretization by one with dA ~ -50 per token (exp(da_cs) underflows in a chunk)."""
    B, H, S = inputs["dt"].shape
    gen = torch.Generator().manual_seed(7)
    dA = -50.0 * (0.9 + 0.2 * torch.rand((B, H, S), generator=gen))
    da_cs, da_cs_rev, segsum = build_discretization(dA, inputs["chunk_size"])
    device = inputs["dt"].device
    return dict(inputs, da_cs=da_cs.to(device), da_cs_rev=da_cs_rev.to(device), segsum=segsum.to(device))


def zero_dout(inputs):
    return dict(inputs, dout=torch.zeros_like(inputs["dout"]))


# name -> (make_inputs keywords, transform)
EDGE_CASES = {
    "strong_decay": (dict(), strong_decay),
    "dt_near_zero": (dict(dt_range=(1e-6, 1e-5)), None),
    "saturated_trap": (dict(trap_scale=30.0), None),
    "zero_dout": (dict(), zero_dout),  # dmimo_o, dmimo_z, dz are exactly zero
    "large_z": (dict(z_scale=50.0), None),
}


@pytest.mark.parametrize("dtype", EDGE_DTYPES, ids=lambda dt: str(dt).replace("torch.", ""))
@pytest.mark.parametrize("case", list(EDGE_CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_edge_inputs(check_kernel, impl, case, dtype):
    """Finite outputs within the accuracy contract (check_outputs fails on any NaN/Inf)."""
    kwargs, transform = EDGE_CASES[case]
    checks = check_kernel(impl, **EDGE_SHAPE, dtype=dtype, z=True, d=True, transform=transform, **kwargs)
    assert all(c.passed for c in checks)


def test_trap_range_is_saturated():
    """The saturated-trap case really saturates the sigmoid (|trap| well past 20 somewhere)."""
    inputs = make_inputs(**EDGE_SHAPE, dtype=F32, trap_scale=30.0, seed=0)
    assert inputs["trap"].abs().max() > 40.0
    assert make_inputs(**EDGE_SHAPE, dtype=F32, z_scale=50.0, seed=0)["z"].abs().max() > 100.0


# --- device handling ------------------------------------------------------------------------------

@pytest.mark.parametrize("other", ["meta"] + (["cpu"] if HAS_CUDA else []))
def test_mixed_devices_raise(device, other):
    inputs = make_inputs(B=1, S=16, H=2, N=16, P=16, R=1, chunk_size=16, dtype=F32, device=device, seed=0)
    for name in ("v", "mimo_z", "segsum"):
        moved = dict(inputs, **{name: inputs[name].to(other)})
        with pytest.raises(ValueError, match=f"{name} is on {other}"):
            api.bwd_fwd(**moved)


@requires_cuda
@pytest.mark.skipif(HAS_CUDA and torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("impl", IMPLS)
def test_other_cuda_device(impl):
    """Tensors on cuda:1 while cuda:0 is current: outputs on cuda:1, correct, current device unchanged."""
    torch.cuda.set_device(0)
    inputs = make_inputs(B=2, S=72, H=4, N=32, P=32, R=2, chunk_size=16, dtype=F32, device="cuda:1",
                         seed=seed_for("cuda1", impl))
    outputs = api.bwd_fwd(**inputs, impl=impl)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert all(x.device == torch.device("cuda:1") for x in outputs if x is not None)
    check_against_reference(outputs, inputs, F32)
    on_0 = api.bwd_fwd(**to_device(inputs, "cuda:0"), impl=impl)
    assert_same([None if x is None else x.to("cuda:0") for x in outputs], on_0, "cuda:1 vs cuda:0")


# --- CUDA graphs and determinism ------------------------------------------------------------------

GRAPH_SHAPE = dict(B=2, S=520, H=4, G=2, N=32, P=64, R=2, chunk_size=16)  # 33 chunks, a partial last one
# (impl, config): the default dispatch, an explicit P split with 3 sequence segments, and the dispatcher's config with
# programmatic dependent launch (captured into the graph as programmatic edges).
GRAPH_VARIANTS = {
    "production": ("production", None),
    "production_segments": ("production", ScanConfig(block_p=16, n_segments=3)),
    "production_pdl": ("production", dataclasses.replace(
        choose_config(B=2, H=4, S=520, N=32, P=64, R=2, chunk_size=16, num_sms=132), pdl=True)),
    "stage0": ("stage0", None),
}


@requires_cuda
@pytest.mark.parametrize("variant", list(GRAPH_VARIANTS))
def test_cuda_graph_replay_with_new_inputs(variant):
    """Capture one call, copy new values into the captured inputs, replay: equals a fresh eager call.

    A host-device sync inside the call would fail the capture; an allocation sized from tensor
    values, or a launch that read host copies of the inputs, would give wrong results on replay.
    """
    impl, config = GRAPH_VARIANTS[variant]
    for dtype in (F32, BF16):
        static = make_inputs(**GRAPH_SHAPE, dtype=dtype, device="cuda", seed=seed_for("graph", variant, 0))
        fresh = make_inputs(**GRAPH_SHAPE, dtype=dtype, device="cuda", seed=seed_for("graph", variant, 1))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compiles the kernels) outside the capture
            for _ in range(2):
                api.bwd_fwd(**static, impl=impl, config=config)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = api.bwd_fwd(**static, impl=impl, config=config)
        for name, x in fresh.items():
            if isinstance(x, torch.Tensor):
                static[name].copy_(x)
        graph.replay()
        torch.cuda.synchronize()

        eager = api.bwd_fwd(**fresh, impl=impl, config=config)
        assert_same(captured, eager, f"{variant} {dtype} replay vs eager")
        check_against_reference(captured, fresh, dtype)
        del graph


@requires_cuda
@pytest.mark.parametrize("variant", list(GRAPH_VARIANTS))
def test_bitwise_deterministic(variant):
    impl, config = GRAPH_VARIANTS[variant]
    inputs = make_inputs(B=2, S=1000, H=8, G=2, N=64, P=64, R=4, chunk_size=16, dtype=BF16, device="cuda",
                         seed=seed_for("determinism", variant))
    first = api.bwd_fwd(**inputs, impl=impl, config=config)
    for _ in range(3):
        assert_same(api.bwd_fwd(**inputs, impl=impl, config=config), first, f"{variant} repeat")


# --- tensors beyond 2^31 elements -----------------------------------------------------------------

def big_inputs(B, S, H, G, N, P, R, chunk_size, dtype, device, seed=0):
    """Random inputs drawn directly on the GPU (make_inputs draws on the CPU: too slow at this size).

    Same distributions as make_inputs; every batch element holds different values.
    """
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape, scale=1.0):
        return torch.randn(shape, generator=gen, device=device) * scale

    def uniform(low, high, *shape):
        return low + (high - low) * torch.rand(shape, generator=gen, device=device)

    rd = N // 4
    dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1), B, H, S))
    dA = -dt * torch.exp(uniform(0.0, math.log(16.0), H))[None, :, None]
    da_cs, da_cs_rev, segsum = build_discretization(dA, chunk_size)
    frequencies = 10000.0 ** (-torch.arange(rd, device=device, dtype=F32) / rd)
    angles = torch.cumsum(dt[..., None] * frequencies, dim=2).permute(0, 2, 1, 3).contiguous()
    return dict(
        dout=normal(B, S, H, P).to(dtype), q=normal(B, S, R, G, N, scale=N ** -0.25).to(dtype),
        k=normal(B, S, R, G, N, scale=N ** -0.25).to(dtype), v=normal(B, S, H, P).to(dtype),
        q_bias=normal(H, R, N, scale=0.1), k_bias=normal(H, R, N, scale=0.1),
        mimo_v=normal(H, R, P, scale=R ** -0.5), mimo_o=normal(H, R, P, scale=R ** -0.5),
        mimo_z=normal(H, R, P), d=normal(H), z=normal(B, S, H, P).to(dtype), angles=angles,
        da_cs=da_cs, da_cs_rev=da_cs_rev, dt=dt, trap=normal(B, H, S).to(dtype), segsum=segsum,
        chunk_size=chunk_size, rotary_dim_divisor=4)


def batch_slice(inputs, b):
    """The inputs of batch element b alone (every [B, ...] tensor sliced, parameters unchanged)."""
    per_batch = ("dout", "q", "k", "v", "z", "angles", "da_cs", "da_cs_rev", "dt", "trap", "segsum")
    return {name: x[b:b + 1] if name in per_batch else x for name, x in inputs.items()}


# S = 8328 = 520.5 chunks of 16: states [16, 32, 521, 128, 64] has 2.18e9 > 2^31 elements and the
# base offset of (b, h) = (15, h >= 24) itself exceeds 2^31 (an int32 base would wrap there).
# states is 4.1 GiB in bf16; the whole test needs about 9 GiB.
BIG = dict(B=16, S=8328, H=32, G=1, N=128, P=64, R=4, chunk_size=16)
BIG_BYTES_NEEDED = 16 * 2 ** 30


@requires_cuda
def test_states_beyond_int32_elements(poison_outputs):
    """Production on a problem whose states exceed 2^31 elements = the same call per batch element."""
    free, _ = torch.cuda.mem_get_info()
    if free < BIG_BYTES_NEEDED:
        pytest.skip(f"needs {BIG_BYTES_NEEDED / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    inputs = big_inputs(**BIG, dtype=BF16, device="cuda")
    B, S, H, N, P, R, C = (BIG[k] for k in ("B", "S", "H", "N", "P", "R", "chunk_size"))
    nch = triton.cdiv(S, C)
    assert (B * H - 1) * nch * N * P > 2 ** 31  # the last (b, h) starts past 2^31
    # One config for every call, so the per-element runs do the same arithmetic as the big one.
    config = choose_config(B=B, H=H, S=S, N=N, P=P, R=R, chunk_size=C,
                           num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    states, qk_dot, dmimo_o, dmimo_z, dz = api.bwd_fwd(**inputs, output_dtype=BF16, config=config)
    assert states.numel() > 2 ** 31
    # Outputs were NaN-poisoned: every element written, none overflowed to inf.
    assert bool(torch.isfinite(states).all()) and bool(torch.isfinite(dz).all())
    for b in (0, B - 1):
        single = api.bwd_fwd(**batch_slice(inputs, b), output_dtype=BF16, config=config)
        big = (states[b:b + 1], qk_dot[b:b + 1], dmimo_o[b:b + 1], dmimo_z[b:b + 1], dz[b:b + 1])
        assert_same(big, single, f"batch element {b}")


# --- Triton compile caching -----------------------------------------------------------------------

def compiled_kernel_count():
    """Compiled variants held by every Triton JITFunction of the ops modules, all devices.

    Triton 3.6 keeps them in ``JITFunction.device_caches[device][0]``; older versions in ``.cache``.
    """
    total = 0
    for module in (chunk_output, chunk_state, stage0):
        for value in vars(module).values():
            if isinstance(value, triton.runtime.jit.JITFunction):
                if hasattr(value, "device_caches"):
                    total += sum(len(entry[0]) for entry in value.device_caches.values())
                else:
                    total += sum(len(cache) for cache in value.cache.values())
    return total


@requires_cuda
@pytest.mark.parametrize("impl", IMPLS)
def test_second_call_does_not_recompile(impl):
    shape = dict(B=2, S=100, H=4, G=1, N=32, P=32, R=2, chunk_size=16)
    api.bwd_fwd(**make_inputs(**shape, dtype=BF16, device="cuda", seed=1), impl=impl)
    torch.cuda.synchronize()
    count = compiled_kernel_count()
    assert count > 0, "found no compiled Triton kernel in the ops modules"
    for seed in (2, 3):  # new tensors (new addresses, new values), same shapes and dtypes
        api.bwd_fwd(**make_inputs(**shape, dtype=BF16, device="cuda", seed=seed), impl=impl)
    torch.cuda.synchronize()
    assert compiled_kernel_count() == count

