"""The two PyTorch references agree, the discretization is what SPEC section 2 says, and the
reference is well behaved (per-batch Phi gradients, spec gradient formulas, no input mutation)."""

import pytest
import torch
import torch.nn.functional as F

from mamba3_mimo.accuracy import OUTPUT_NAMES, normwise_error
from mamba3_mimo.inputs import build_discretization, make_inputs
from mamba3_mimo.reference import (
    _chunked_scan, _gated_output, _prepare, bwd_fwd_recurrent_reference, bwd_fwd_reference,
)

SMALL = dict(B=2, H=4, N=16, P=8)

# (S, C, G, R, z, d, rotary_dim_divisor): tails, S < C, whole chunks, C = 1 and odd C, GQA
# with G in {1, 2, H}, R in {1, 2, 3}, gate and skip on and off.
CONFIGS = [
    (33, 16, 1, 2, True, True, 4),
    (40, 16, 2, 3, False, True, 2),
    (33, 32, 4, 1, True, False, 2),
    (40, 32, 1, 3, True, True, 4),
    (5, 16, 2, 2, False, False, 4),
    (32, 16, 4, 2, True, True, 4),
    (7, 1, 1, 1, True, True, 2),
    (20, 6, 2, 3, True, False, 4),
]


def _float64_inputs(S, C, G, R, z, d, rotary_dim_divisor, seed=0):
    """Inputs upcast to float64, with da_cs, da_cs_rev, segsum rebuilt from dA in float64.

    The fp32 discretization carries rounding (segsum[t, s] is not exactly the sum of the
    per-token decays between s and t) that the token-by-token form cannot see; in float64 the
    two references must then agree to rounding.
    """
    inputs, dA = make_inputs(S=S, chunk_size=C, G=G, R=R, z=z, d=d, dtype=torch.float32,
                             rotary_dim_divisor=rotary_dim_divisor, seed=seed, return_dA=True,
                             **SMALL)
    inputs = {key: value.double() if torch.is_tensor(value) else value
              for key, value in inputs.items()}
    inputs["da_cs"], inputs["da_cs_rev"], inputs["segsum"] = build_discretization(dA.double(), C)
    return inputs


@pytest.mark.parametrize("S,C,G,R,z,d,rotary_dim_divisor", CONFIGS)
def test_chunked_matches_token_by_token(S, C, G, R, z, d, rotary_dim_divisor):
    inputs = _float64_inputs(S, C, G, R, z, d, rotary_dim_divisor)
    chunked = bwd_fwd_reference(**inputs)
    recurrent = bwd_fwd_recurrent_reference(**inputs)
    B, H, N, P = SMALL["B"], SMALL["H"], SMALL["N"], SMALL["P"]
    nch = -(-S // C)
    shapes = [(B, H, nch, N, P), (B, H, S, R, R), (B, H, R, P), (B, H, R, P), (B, S, H, P)]
    for name, a, b, shape in zip(OUTPUT_NAMES, chunked, recurrent, shapes):
        if name in ("dmimo_z", "dz") and not z:
            assert a is None and b is None, name
            continue
        assert a.dtype == b.dtype == torch.float64, name
        assert tuple(a.shape) == tuple(b.shape) == shape, name
        assert normwise_error(a, b) <= 1e-10, (name, normwise_error(a, b))
    # Only the first state is zero by construction; the others must carry information.
    if nch > 1:
        assert chunked[0][:, :, 1:].abs().amax() > 0


def test_fp32_discretization_stays_close():
    """With the fp32 discretization as given, the references still agree to fp32 rounding."""
    inputs = make_inputs(S=40, chunk_size=16, dtype=torch.float32, **SMALL)
    for a, b in zip(bwd_fwd_reference(**inputs), bwd_fwd_recurrent_reference(**inputs)):
        assert normwise_error(a, b) <= 1e-6


def _naive_discretization(dA, C):
    """Loop form of SPEC section 2, accumulating left to right in dA's dtype."""
    B, H, S = dA.shape
    nch = -(-S // C)
    da_cs = torch.zeros_like(dA)
    da_cs_rev = torch.zeros_like(dA)
    segsum = torch.zeros(B, H, nch, C, C, dtype=dA.dtype)
    for b in range(B):
        for h in range(H):
            for c in range(nch):
                positions = range(c * C, min((c + 1) * C, S))
                running = torch.zeros((), dtype=dA.dtype)
                for t in positions:
                    running = running + dA[b, h, t]
                    da_cs[b, h, t] = running
                for t in positions:
                    da_cs_rev[b, h, t] = da_cs[b, h, positions[-1]] - da_cs[b, h, t]
                for i in positions:
                    for j in positions:
                        if i > j:
                            segsum[b, h, c, i - c * C, j - c * C] = da_cs[b, h, i] - da_cs[b, h, j]
    return da_cs, da_cs_rev, segsum


@pytest.mark.parametrize("S,C", [(21, 8), (16, 8), (5, 8), (9, 1), (10, 3)])
def test_build_discretization_matches_loop(S, C):
    _, dA = make_inputs(B=1, H=2, S=S, chunk_size=C, N=16, P=8, return_dA=True, seed=3)
    got = build_discretization(dA, C)
    want = _naive_discretization(dA, C)
    for name, g, w in zip(("da_cs", "da_cs_rev", "segsum"), got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape, name
        assert torch.equal(g, w), name  # bit for bit


def test_segsum_zero_where_it_must_be():
    S, C = 21, 8  # the last chunk holds 5 valid positions
    _, dA = make_inputs(B=1, H=2, S=S, chunk_size=C, N=16, P=8, return_dA=True)
    da_cs, da_cs_rev, segsum = build_discretization(dA, C)
    i = torch.arange(C)[:, None]
    j = torch.arange(C)[None, :]
    assert (segsum[..., i <= j] == 0).all()  # diagonal and above
    assert (segsum[:, :, -1, 5:, :] == 0).all() and (segsum[:, :, -1, :, 5:] == 0).all()
    assert (segsum[..., i > j][:, :, :2] != 0).all()  # dA < 0 strictly: nonzero elsewhere
    # The last position of every chunk, the final partial one included, has nothing after it.
    assert (da_cs_rev[..., [7, 15, 20]] == 0).all()
    # Chunk starts restart the cumsum.
    assert torch.equal(da_cs[..., [0, 8, 16]], dA[..., [0, 8, 16]])


def test_dmimo_o_sums_to_shared_phi_gradient():
    """Per-batch dmimo_o summed over B is the gradient of <dout, out> w.r.t. the shared Phi."""
    inputs = make_inputs(S=24, chunk_size=8, dtype=torch.float32, **SMALL)
    states, qk_dot, dmimo_o, dmimo_z, dz = bwd_fwd_reference(**inputs)
    prepared = _prepare(*(inputs[key] for key in (
        "dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "angles", "da_cs",
        "da_cs_rev", "dt", "trap", "segsum", "mimo_z", "d", "z", "chunk_size",
        "rotary_dim_divisor")), torch.float64)
    raw_y = _chunked_scan(prepared)[2]
    phi = prepared.phi.clone().requires_grad_(True)
    zeta = prepared.zeta.clone().requires_grad_(True)
    loss = (_gated_output(raw_y, phi, zeta, prepared.z) * prepared.dout).sum()
    dphi, dzeta = torch.autograd.grad(loss, (phi, zeta))
    assert normwise_error(dmimo_o.sum(0), dphi) <= 1e-12
    assert normwise_error(dmimo_z.sum(0), dzeta) <= 1e-12
    # The batch elements do differ, so the per-batch split is not trivially a copy.
    assert normwise_error(dmimo_o[0], dmimo_o[1]) > 1e-3


def test_autograd_matches_spec_gradient_formulas():
    """The closed-form gradients of SPEC section 3 (allowed here, not in the reference)."""
    inputs = make_inputs(S=24, chunk_size=8, dtype=torch.float32, **SMALL)
    _, _, dmimo_o, dmimo_z, dz = bwd_fwd_reference(**inputs)
    prepared = _prepare(*(inputs[key] for key in (
        "dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "angles", "da_cs",
        "da_cs_rev", "dt", "trap", "segsum", "mimo_z", "d", "z", "chunk_size",
        "rotary_dim_divisor")), torch.float64)
    raw_y = _chunked_scan(prepared)[2]  # [B, H, S, R, P]
    z = prepared.z.permute(0, 2, 1, 3)[:, :, :, None]  # [B, H, S, 1, P]
    dout = prepared.dout.permute(0, 2, 1, 3)[:, :, :, None]
    u = z * prepared.zeta[None, :, None]
    sig = torch.sigmoid(u)
    dL_du = dout * prepared.phi[None, :, None] * raw_y * sig * (1 + u * (1 - sig))
    assert normwise_error(dmimo_o, (F.silu(u) * raw_y * dout).sum(2)) <= 1e-12
    assert normwise_error(dmimo_z, (dL_du * z).sum(2)) <= 1e-12
    want_dz = (dL_du * prepared.zeta[None, :, None]).sum(3).permute(0, 2, 1, 3)
    assert normwise_error(dz, want_dz) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reference", [bwd_fwd_reference, bwd_fwd_recurrent_reference])
def test_reference_does_not_modify_inputs(reference, dtype):
    inputs = make_inputs(S=20, chunk_size=8, dtype=dtype, **SMALL)
    if dtype == torch.float64:  # casts are then no-ops: the inputs themselves flow through
        inputs = {key: value.double() if torch.is_tensor(value) else value
                  for key, value in inputs.items()}
    saved = {key: value.clone() for key, value in inputs.items() if torch.is_tensor(value)}
    reference(**inputs, compute_dtype=dtype)
    for key, value in saved.items():
        assert torch.equal(inputs[key], value), key
        assert not inputs[key].requires_grad, key


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_runs_in_lower_precision(compute_dtype):
    """The bench: every output in compute_dtype, finite, and near the golden."""
    inputs = make_inputs(S=40, chunk_size=16, dtype=torch.bfloat16, **SMALL)
    golden = bwd_fwd_reference(**inputs)
    bench = bwd_fwd_reference(**inputs, compute_dtype=compute_dtype)
    limit = {torch.float32: 1e-6, torch.float16: 5e-3, torch.bfloat16: 3e-2}[compute_dtype]
    for name, x, g in zip(OUTPUT_NAMES, bench, golden):
        assert x.dtype == compute_dtype, name
        assert torch.isfinite(x).all(), name
        assert normwise_error(x, g) <= limit, (name, normwise_error(x, g))


def test_non_contiguous_inputs():
    inputs = make_inputs(S=20, chunk_size=8, dtype=torch.float32, **SMALL)
    want = bwd_fwd_reference(**inputs)
    strided = {key: value.transpose(0, -1).contiguous().transpose(0, -1)
               if torch.is_tensor(value) and value.dim() > 1 else value
               for key, value in inputs.items()}
    assert not strided["q"].is_contiguous()
    for a, b in zip(bwd_fwd_reference(**strided), want):
        assert normwise_error(a, b) <= 1e-13  # einsum may sum in another order


def test_make_inputs_contract():
    inputs, dA = make_inputs(B=2, S=20, H=4, G=2, N=16, P=8, R=3, chunk_size=8, z=True, d=True,
                             dtype=torch.bfloat16, return_dA=True)
    shapes = dict(dout=(2, 20, 4, 8), q=(2, 20, 3, 2, 16), k=(2, 20, 3, 2, 16), v=(2, 20, 4, 8),
                  q_bias=(4, 3, 16), k_bias=(4, 3, 16), mimo_v=(4, 3, 8), mimo_o=(4, 3, 8),
                  angles=(2, 20, 4, 4), da_cs=(2, 4, 20), da_cs_rev=(2, 4, 20), dt=(2, 4, 20),
                  trap=(2, 4, 20), segsum=(2, 4, 3, 8, 8), mimo_z=(4, 3, 8), d=(4,),
                  z=(2, 20, 4, 8))
    assert set(inputs) == set(shapes) | {"chunk_size", "rotary_dim_divisor"}
    activations = {"dout", "q", "k", "v", "z", "trap"}
    for key, shape in shapes.items():
        assert tuple(inputs[key].shape) == shape, key
        assert inputs[key].dtype == (torch.bfloat16 if key in activations else torch.float32), key
    assert (dA < 0).all() and torch.equal(build_discretization(dA, 8)[2], inputs["segsum"])
    # The gate switch leaves every other tensor unchanged.
    plain = make_inputs(B=2, S=20, H=4, G=2, N=16, P=8, R=3, chunk_size=8, z=False, d=False,
                        dtype=torch.bfloat16)
    assert plain["z"] is None and plain["mimo_z"] is None and plain["d"] is None
    for key in shapes.keys() - {"z", "mimo_z", "d"}:
        assert torch.equal(plain[key], inputs[key]), key
