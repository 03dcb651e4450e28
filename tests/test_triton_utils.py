"""The shared Triton helpers (mamba3_mimo/ops/triton_utils.py), each against torch.

Small single-program kernels that exercise one helper at the tile shapes the
official grid compiles.  On the CPU they run in the interpreter; on a GPU they
separate a compiler problem in one construct (the causal weights, the gathered
rotation) from a bug in the composed kernels.
"""

import pytest
import torch
import triton
import triton.language as tl

from conftest import requires_cuda, seed_for
from mamba3_mimo.ops import triton_utils as tu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _weights_kernel(da_ptr, gamma_ptr, ts_ptr, out_ptr, S, t0,
                    C: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.arange(0, BLOCK_T * BLOCK_R)
    row_t = rows // BLOCK_R
    row_valid = (row_t < C) & (rows % BLOCK_R < R)
    t_abs = t0 + row_t
    row_mask = row_valid & (t_abs < S)
    da = tl.load(da_ptr + t_abs, mask=row_mask, other=0.0)
    gamma = tl.load(gamma_ptr + t_abs, mask=row_mask, other=0.0)
    ts = tl.load(ts_ptr + t_abs, mask=row_mask, other=0.0)
    w = tu.intra_chunk_weights(t_abs, t_abs, row_mask, row_mask, da, da, gamma, ts)
    rows = tl.arange(0, BLOCK_T * BLOCK_R)
    tl.store(out_ptr + rows[:, None] * (BLOCK_T * BLOCK_R) + rows[None, :], w)


@pytest.mark.parametrize("C,R,S", [(16, 4, 16), (8, 8, 8), (16, 3, 16), (16, 4, 11), (8, 2, 8)])
def test_intra_chunk_weights(C, R, S):
    block_r = triton.next_power_of_2(R)
    block_t = max(triton.next_power_of_2(C), 16 // block_r)
    gen = torch.Generator().manual_seed(seed_for(f"weights_{C}_{R}_{S}"))
    # Strong decay: within-chunk differences reach -50 per token, across the padding they would be positive.
    da = torch.cumsum(-50 * torch.rand(block_t, generator=gen), 0)
    gamma, ts = torch.rand(block_t, generator=gen), torch.rand(block_t, generator=gen)
    rows = block_t * block_r
    out = torch.full((rows, rows), float("nan"))
    args = [x.to(DEVICE) for x in (da, gamma, ts, out)]
    _weights_kernel[(1,)](*args, S, 0, C=C, R=R, BLOCK_T=block_t, BLOCK_R=block_r)
    t = torch.arange(rows) // block_r
    r = torch.arange(rows) % block_r
    valid = (t < C) & (r < R) & (t < S)
    both = valid[:, None] & valid[None, :]
    earlier = (t[:, None] > t[None, :]) & both
    same = (t[:, None] == t[None, :]) & both
    diff = torch.where(earlier, da[t][:, None] - da[t][None, :], torch.zeros(()))
    expected = torch.where(earlier, torch.exp(diff) * ts[t][None, :], torch.where(same, gamma[t][:, None], 0.0))
    torch.testing.assert_close(args[3].cpu(), expected, rtol=1e-5, atol=1e-30)


@triton.jit
def _rotate_gather_kernel(x_ptr, bias_ptr, cos_ptr, sin_ptr, t_ptr, r_ptr, lo_ptr, hi_ptr, ROWS_VALID,
                          R: tl.constexpr, N: tl.constexpr, RD: tl.constexpr, HALF_START: tl.constexpr,
                          BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr, TRANSPOSED: tl.constexpr):
    rows = tl.arange(0, BLOCK_ROWS)
    row_mask = rows < ROWS_VALID
    t_pos = tl.load(t_ptr + rows)
    ranks = tl.load(r_ptr + rows)
    offs_half = HALF_START + tl.arange(0, BLOCK_HALF)
    half_mask = offs_half < N // 2
    lo, hi = tu.load_rotated_gather(x_ptr, bias_ptr, cos_ptr, sin_ptr, t_pos, ranks, row_mask, R * N, N, RD,
                                    offs_half, half_mask, N, RD, tl.float32, TRANSPOSED=TRANSPOSED)
    if TRANSPOSED:  # [half, rows] tiles, stored back as [rows, half]
        out_offs = rows[None, :] * BLOCK_HALF + tl.arange(0, BLOCK_HALF)[:, None]
    else:
        out_offs = rows[:, None] * BLOCK_HALF + tl.arange(0, BLOCK_HALF)[None, :]
    tl.store(lo_ptr + out_offs, lo)
    tl.store(hi_ptr + out_offs, hi)


@pytest.mark.parametrize("R,N,divisor,half_start,block_half", [(4, 128, 4, 0, 32), (4, 128, 4, 32, 32),
                                                                (3, 48, 2, 16, 16), (1, 16, 4, 0, 16),
                                                                (8, 256, 2, 64, 64)])
@pytest.mark.parametrize("transposed", [False, True])
def test_load_rotated_gather(R, N, divisor, half_start, block_half, transposed):
    """Rows at arbitrary (token, rank) pairs, an N/2 tile that may start past 0, masked rows exactly 0."""
    S, rows, valid_rows = 20, 64, 50
    rd = N // divisor
    gen = torch.Generator().manual_seed(seed_for(f"gather_{R}_{N}_{half_start}"))
    x = torch.randn(S, R, N, generator=gen)         # [S, R, G=1, N] of one (b, g)
    bias = torch.randn(R, N, generator=gen)
    angles = 10 * torch.randn(S, rd, generator=gen)  # [S, H=1, RD]
    t_pos = torch.randint(0, S, (rows,), generator=gen, dtype=torch.int32)
    ranks = torch.randint(0, R, (rows,), generator=gen, dtype=torch.int32)
    lo = torch.full((rows, block_half), float("nan"))
    hi = torch.full((rows, block_half), float("nan"))
    args = [t.to(DEVICE) for t in (x, bias, torch.cos(angles), torch.sin(angles), t_pos, ranks, lo, hi)]
    _rotate_gather_kernel[(1,)](*args, valid_rows, R=R, N=N, RD=rd, HALF_START=half_start,
                                BLOCK_ROWS=rows, BLOCK_HALF=block_half, TRANSPOSED=transposed)
    xb = (x + bias).double()
    theta = torch.zeros(S, N // 2, dtype=torch.float64)
    theta[:, :rd] = angles.double()
    cos, sin = torch.cos(theta)[:, None, :], torch.sin(theta)[:, None, :]
    ref_lo = (xb[..., :N // 2] * cos - xb[..., N // 2:] * sin)[t_pos.long(), ranks.long()]
    ref_hi = (xb[..., :N // 2] * sin + xb[..., N // 2:] * cos)[t_pos.long(), ranks.long()]
    cols = slice(half_start, min(half_start + block_half, N // 2))
    width = cols.stop - cols.start
    got_lo, got_hi = args[6].cpu().double(), args[7].cpu().double()
    torch.testing.assert_close(got_lo[:valid_rows, :width], ref_lo[:valid_rows, cols], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_hi[:valid_rows, :width], ref_hi[:valid_rows, cols], rtol=1e-5, atol=1e-5)
    assert torch.all(got_lo[valid_rows:] == 0) and torch.all(got_hi[valid_rows:] == 0)
    assert torch.all(got_lo[:, width:] == 0) and torch.all(got_hi[:, width:] == 0)


@triton.jit
def _gate_grads_kernel(raw_ptr, dout_ptr, z_ptr, phi_ptr, zeta_ptr, dphi_ptr, dzeta_ptr, dz_ptr,
                       T: tl.constexpr, COLS: tl.constexpr, HAS_Z: tl.constexpr):
    tok = tl.arange(0, T)
    cols = tl.arange(0, COLS)
    tile = tok[:, None] * COLS + cols[None, :]
    dphi, dzeta, dz = tu.rank_gate_grads(tl.load(raw_ptr + tile), tl.load(dout_ptr + tile), tl.load(z_ptr + tile),
                                         tl.load(phi_ptr + cols), tl.load(zeta_ptr + cols), HAS_Z)
    tl.store(dphi_ptr + cols, dphi)
    tl.store(dzeta_ptr + cols, dzeta)
    tl.store(dz_ptr + tile, dz)


@pytest.mark.parametrize("has_z", [True, False])
def test_rank_gate_grads(has_z):
    """The gate gradients of one rank against autograd through out = Phi * silu(z * Zeta) * raw_y."""
    T, cols = 16, 32
    gen = torch.Generator().manual_seed(seed_for(f"gate_{has_z}"))
    raw, dout, z = (torch.randn(T, cols, generator=gen, dtype=torch.float64) for _ in range(3))
    phi, zeta = (torch.randn(cols, generator=gen, dtype=torch.float64) for _ in range(2))
    phi_g, zeta_g, z_g = (x.clone().requires_grad_() for x in (phi, zeta, z))
    gate = torch.nn.functional.silu(z_g * zeta_g) if has_z else torch.ones(())
    (phi_g * gate * raw * dout).sum().backward()
    outs = [torch.full((cols,), float("nan"), device=DEVICE), torch.full((cols,), float("nan"), device=DEVICE),
            torch.full((T, cols), float("nan"), device=DEVICE)]
    _gate_grads_kernel[(1,)](*(x.float().to(DEVICE) for x in (raw, dout, z, phi, zeta)), *outs, T=T, COLS=cols,
                             HAS_Z=has_z)
    dphi, dzeta, dz = (x.cpu().double() for x in outs)
    torch.testing.assert_close(dphi, phi_g.grad, rtol=1e-5, atol=1e-5)
    if has_z:
        # dz of this rank is dL/du * Zeta, the per-rank term the kernels sum over r.
        torch.testing.assert_close(dzeta, zeta_g.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dz, z_g.grad, rtol=1e-5, atol=1e-5)
    else:
        assert torch.all(dzeta == 0) and torch.all(dz == 0)


@triton.jit
def _select_sum_kernel(x_ptr, out_ptr, F: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                       SUM_DTYPE: tl.constexpr):
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    tok = tl.arange(0, M)
    selection = (tok[:, None] == (rows // F)[None, :]) & (rows < ROWS - 3)[None, :]  # the last 3 rows are padding
    x = tl.load(x_ptr + rows[:, None] * COLS + cols[None, :])
    tl.store(out_ptr + tok[:, None] * COLS + cols[None, :], tu.select_rows_sum(selection, x, SUM_DTYPE))


@pytest.mark.parametrize("sum_dtype", ["fp32", "split"])
def test_select_rows_sum(sum_dtype):
    """Token sums of F consecutive rows as a 0/1 product: exact in fp32, ~2^-16 relative when split in halves."""
    F, M, rows, cols = 2, 16, 32, 64
    gen = torch.Generator().manual_seed(seed_for(f"select_{sum_dtype}"))
    # Magnitudes over 2^10 so that one half-precision rounding would show.
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-5, 6, (rows, 1), generator=gen))
    out = torch.full((M, cols), float("nan"), device=DEVICE)
    split = tl.bfloat16 if DEVICE == "cuda" else tl.float16  # the interpreter miscomputes bf16 products
    _select_sum_kernel[(1,)](x.to(DEVICE), out, F=F, M=M, ROWS=rows, COLS=cols,
                             SUM_DTYPE=tl.float32 if sum_dtype == "fp32" else split)
    xd = x.double()
    xd[rows - 3:] = 0
    expected = xd.view(M, F, cols).sum(1)
    tol = 1e-6 if sum_dtype == "fp32" else 3e-5
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@triton.jit
def _sigmoid_kernel(u_ptr, sig_ptr, silu_ptr, dsilu_ptr, BLOCK: tl.constexpr, FAST_SIGMOID: tl.constexpr,
                    PRECISE_SIGMOID: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    u = tl.load(u_ptr + offs)
    if PRECISE_SIGMOID:
        tl.store(sig_ptr + offs, tu.precise_sigmoid(u))
    else:
        tl.store(sig_ptr + offs, tu.fast_sigmoid(u))
    silu, dsilu = tu.silu_and_grad(u, FAST_SIGMOID, PRECISE_SIGMOID)
    tl.store(silu_ptr + offs, silu)
    tl.store(dsilu_ptr + offs, dsilu)


def _gpu_sigmoid(precise):
    """(u rounded to fp32, float64 sigmoid of it, the kernel's sigmoid, silu, silu') over [-30, 30] and the ends."""
    block = 4096
    u = torch.cat([torch.linspace(-30, 30, block - 8, dtype=torch.float64),
                   torch.tensor([-1e4, -100, -88, -50, 50, 88, 100, 1e4], dtype=torch.float64)])
    outs = [torch.full((block,), float("nan"), device="cuda") for _ in range(3)]
    _sigmoid_kernel[(1,)](u.float().cuda(), *outs, BLOCK=block, FAST_SIGMOID=not precise, PRECISE_SIGMOID=precise)
    sig_out, silu, dsilu = (x.cpu().double() for x in outs)
    u32 = u.float().double()  # the kernel's input, rounded to fp32
    assert torch.isfinite(sig_out).all() and torch.isfinite(silu).all() and torch.isfinite(dsilu).all()
    return u32, torch.sigmoid(u32), sig_out, silu, dsilu


@requires_cuda
def test_fast_sigmoid():
    """The PTX sigmoid (GPU only) within a few fp32 ulp of float64 over the whole range, 0 / 1 at the ends."""
    u32, sig, fast, silu, dsilu = _gpu_sigmoid(precise=False)
    # ex2 (2^-22.5) and rcp (2^-23) relative error and roundings; the fp32 product u * log2(e) adds |u| ulp
    # of the exponent (as in tl.sigmoid, whose exp goes through the same ex2); below 2^-126 results flush to 0.
    bound = (8 * 2.0**-24 + u32.abs() * 2.0**-23) * sig + 1.2e-38
    assert ((fast - sig).abs() <= bound).all(), (fast - sig).abs().div(bound).max()
    assert ((silu - u32 * sig).abs() <= u32.abs() * bound + 1e-30).all()
    torch.testing.assert_close(dsilu, sig * (1 + u32 * (1 - sig)), atol=1e-6, rtol=1e-5)
    assert fast[u32 < -100].eq(0).all() and fast[u32 > 20].eq(1).all()


@requires_cuda
def test_precise_sigmoid_stays_within_a_few_ulp_where_the_fast_one_grows_with_u():
    """fp32 activations' sigmoid (libdevice expf, IEEE division) within a few fp32 ulp of float64 at any u, where
    ``fast_sigmoid``'s error grows with |u| (the approximate units' relative error, docs/optimization.md
    section 35); 0 / 1 at the ends."""
    u32, sig, precise, silu, dsilu = _gpu_sigmoid(precise=True)
    # expf's 2 ulp, the sum's and the division's half ulp each (an ulp up to 2^-23 relative); denormals may flush.
    bound = 8 * 2.0**-24 * sig + 1.2e-38
    assert ((precise - sig).abs() <= bound).all(), (precise - sig).abs().div(bound).max()
    torch.testing.assert_close(silu, u32 * sig, atol=1e-30, rtol=1e-6)
    torch.testing.assert_close(dsilu, sig * (1 + u32 * (1 - sig)), atol=1e-6, rtol=1e-5)
    assert precise[u32 < -104].eq(0).all() and precise[u32 > 20].eq(1).all()
    fast = _gpu_sigmoid(precise=False)[2]
    grows = (u32 > -30) & (u32 < -16)
    assert ((fast - sig).abs() / sig)[grows].max() > ((precise - sig).abs() / sig)[grows].max()


def test_sigmoid_units_follow_the_activations(monkeypatch):
    """The interpreter takes tl.sigmoid; compiled for the GPU, fp32 activations take libdevice's exp and an IEEE
    division, 16-bit ones the approximate units (host_utils.sigmoid_units)."""
    from mamba3_mimo.ops import host_utils

    x32, x16, xb16 = (torch.zeros(2, dtype=dt) for dt in (torch.float32, torch.float16, torch.bfloat16))
    neither = dict(FAST_SIGMOID=False, PRECISE_SIGMOID=False)
    assert [host_utils.sigmoid_units(x) for x in (x32, x16, xb16)] == [neither] * 3
    monkeypatch.setattr(host_utils, "compiled_for_gpu", lambda tensor: True)
    fast, precise = dict(neither, FAST_SIGMOID=True), dict(neither, PRECISE_SIGMOID=True)
    assert [host_utils.sigmoid_units(x) for x in (x32, x16, xb16)] == [precise, fast, fast]


@triton.jit
def _row_scaled_kernel(x_ptr, scaled_ptr, unscale_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    offs = rows[:, None] * COLS + tl.arange(0, COLS)[None, :]
    scaled, unscale = tu.fp16_row_scaled(tl.load(x_ptr + offs))
    tl.store(scaled_ptr + offs, scaled.to(tl.float16))
    tl.store(unscale_ptr + rows, unscale)


def test_fp16_row_scaled(request):
    """Each row's largest magnitude lands in [2^14, 2^15), the fp16 round trip is within 2^-11 relative for
    every element down to 2^-28 of its row's largest, and the factors are exact powers of two: rows of ordinary,
    huge (1e30), tiny (1e-25) and zero values, rows that span 2^40, negative maxima."""
    gen = torch.Generator().manual_seed(seed_for(request.node.nodeid))
    rows, cols = 16, 64
    x = torch.randn((rows, cols), generator=gen, dtype=torch.float64)
    x[1] *= 1e30
    x[2] *= 1e-25
    x[3] = 0.0
    x[4] *= 2.0 ** torch.linspace(-28, 12, cols, dtype=torch.float64)  # one row spanning 2^40
    x[5] = -x[5].abs()
    x[6, 7] = -65504.0 * 4  # a maximum past fp16's range
    x = x.float()
    scaled = torch.full((rows, cols), float("nan"), device=DEVICE, dtype=torch.float16)
    unscale = torch.full((rows,), float("nan"), device=DEVICE)
    _row_scaled_kernel[(1,)](x.to(DEVICE), scaled, unscale, ROWS=rows, COLS=cols)
    scaled, unscale = scaled.cpu().double(), unscale.cpu().double()
    assert torch.isfinite(scaled).all() and (unscale > 0).all()
    mantissa, _ = torch.frexp(unscale)
    assert (mantissa == 0.5).all(), unscale  # powers of two
    row_max = scaled.abs().amax(1)
    nonzero = x.abs().amax(1) > 0
    assert ((row_max[nonzero] >= 2**14) & (row_max[nonzero] < 2**15)).all(), row_max
    assert (scaled[3] == 0).all() and unscale[3] == 2.0**-114
    xd = x.double()
    decoded = scaled * unscale[:, None]
    normal = xd.abs() >= xd.abs().amax(1, keepdim=True) * 2.0**-28
    rel = ((decoded - xd).abs() / xd.abs())[normal & (xd != 0)]
    assert rel.max() <= 2.0**-11, rel.max()


def test_precise_exp_only_for_fp32_products_on_the_gpu(monkeypatch):
    """libdevice's exp (host_utils.precise_exp) where the products are fp32 and the kernels compiled for the GPU (the
    interpreter has no libdevice), and only with FP32_PRECISE_EXP, off by default until a GPU run tests it."""
    import os

    from mamba3_mimo.ops import host_utils

    assert host_utils.FP32_PRECISE_EXP is (os.environ.get("MAMBA3_MIMO_FP32_PRECISE_EXP") == "1")
    gpu, cpu = torch.empty(0, device="meta"), torch.empty(0)
    monkeypatch.setattr(host_utils, "compiled_for_gpu", lambda tensor: tensor.device.type != "cpu")
    monkeypatch.setattr(host_utils, "FP32_PRECISE_EXP", True)
    assert host_utils.precise_exp(tl.float32, gpu)
    assert not host_utils.precise_exp(tl.bfloat16, gpu) and not host_utils.precise_exp(tl.float16, gpu)
    assert not host_utils.precise_exp(tl.float32, cpu)
    monkeypatch.setattr(host_utils, "FP32_PRECISE_EXP", False)
    assert not host_utils.precise_exp(tl.float32, gpu)


@triton.jit
def _exp_kernel(x_ptr, y_ptr, PRECISE: tl.constexpr):
    offs = tl.arange(0, 1024)
    tl.store(y_ptr + offs, tu.exp_fp32(tl.load(x_ptr + offs), PRECISE))


@requires_cuda
def test_exp_fp32_precise_is_within_two_ulp_where_the_fast_one_grows_with_x():
    """The premise of host_utils.precise_exp: tl.exp is ex2.approx after an fp32 multiply by log2(e), whose relative
    error grows with |x| (the decays' exponents reach tens); libdevice's stays within 2 ulp (2.4e-7)."""
    x = torch.linspace(-80.0, 0.0, 1024, device="cuda")
    want = x.double().exp()
    errors = {}
    for precise in (False, True):
        y = torch.empty_like(x)
        compiled = _exp_kernel[(1,)](x, y, PRECISE=precise)
        errors[precise] = float(((y.double() - want).abs() / want).max())
        if not precise:
            assert "ex2.approx.f32" in compiled.asm["ptx"]
    assert errors[True] <= 2.4e-7 < errors[False], errors


def test_rotation_source_takes_tables_or_angles_with_their_dtype():
    """``host_utils.rotation_source``: the tables as they are, or fp32 angles with the 16-bit dtype of the tables they
    stand for (its tl dtype for ``table_cos_sin``); any mix of the two, an fp32 table_dtype or non-fp32 angles raise."""
    from mamba3_mimo.ops.host_utils import rotation_source

    x = torch.zeros(1)
    cos = torch.zeros(1, 4, 2, 8, dtype=torch.float16)
    angles = torch.zeros(1, 4, 2, 8)
    plain = rotation_source("k", x, cos, cos, None, None)
    assert plain["FROM_ANGLES"] is False and plain["cos_angles"] is cos and plain["RD"] == 8
    assert plain["table_dtype"] == torch.float16
    taken = rotation_source("k", x, None, None, angles, torch.bfloat16)
    assert taken["FROM_ANGLES"] is True and taken["TABLE_DTYPE"] == tl.bfloat16
    assert taken["table_dtype"] == torch.bfloat16
    assert taken["cos_angles"] is taken["sin_angles"] is angles and taken["FAST_TRIG"] is x.is_cuda
    for bad in [(cos, cos, angles, torch.float16), (None, None, angles, torch.float32), (cos, None, None, None),
                (None, None, angles.half(), torch.float16), (cos, cos, None, torch.float16)]:
        with pytest.raises(ValueError, match="^k: "):
            rotation_source("k", x, *bad)
