"""The shared Triton helpers (mamba3_mimo/ops/triton_utils.py), each against torch.

Small single-program kernels that exercise one helper at the tile shapes the
official grid compiles (BLOCK_T x BLOCK_R rows, 16..128 columns, 4 and 8
warps).  On the CPU they run in the interpreter; on a GPU they separate a
compiler problem in one construct (reshape-broadcast, reshape-sum, the folded
causal weights, rotate-half, the state-increment product) from a bug in the
composed kernels.
"""

import pytest
import torch
import triton
import triton.language as tl

from conftest import seed_for
from mamba3_mimo.ops import triton_utils as tu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (BLOCK_T, BLOCK_R, COLS): the row layouts of the official shapes and a few column widths.
ROW_LAYOUTS = [(16, 4, 64), (8, 4, 64), (8, 8, 64), (32, 2, 64), (64, 1, 64), (16, 4, 32), (8, 4, 16),
               (16, 4, 128), (4, 4, 32)]
WARPS = [4, 8] if DEVICE == "cuda" else [4]


@triton.jit
def _rank_token_kernel(tok_ptr, rank_ptr, rows_out_ptr, by_token_ptr, by_rank_ptr,
                       BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, COLS: tl.constexpr,
                       SUM_T: tl.constexpr, SUM_R: tl.constexpr, SUM_PRECISION: tl.constexpr):
    tok = tl.arange(0, BLOCK_T)
    ranks = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, COLS)
    rows = tl.arange(0, BLOCK_T * BLOCK_R)
    per_token = tl.load(tok_ptr + tok[:, None] * COLS + cols[None, :])
    per_rank = tl.load(rank_ptr + ranks[:, None] * COLS + cols[None, :])
    x = tu.broadcast_tokens_to_rows(per_token, BLOCK_T, BLOCK_R, COLS) * \
        tu.broadcast_ranks_to_rows(per_rank, BLOCK_T, BLOCK_R, COLS)
    tl.store(rows_out_ptr + rows[:, None] * COLS + cols[None, :], x)
    sum_t = tl.arange(0, SUM_T)
    sum_r = tl.arange(0, SUM_R)
    tl.store(by_token_ptr + sum_t[:, None] * COLS + cols[None, :], tu.sum_over_ranks(x, BLOCK_T, BLOCK_R, SUM_T, SUM_PRECISION))
    tl.store(by_rank_ptr + sum_r[:, None] * COLS + cols[None, :], tu.sum_over_tokens(x, BLOCK_T, BLOCK_R, SUM_R, SUM_PRECISION))


@pytest.mark.parametrize("precision,tol", [("tf32x3", 2e-6), ("tf32", 2e-3)])
@pytest.mark.parametrize("num_warps", WARPS)
@pytest.mark.parametrize("block_t,block_r,cols", ROW_LAYOUTS)
def test_rank_token_broadcasts_and_sums(block_t, block_r, cols, num_warps, precision, tol):
    gen = torch.Generator().manual_seed(seed_for(f"rank_token_{block_t}_{block_r}_{cols}_{num_warps}"))
    per_token = torch.randn(block_t, cols, generator=gen).to(DEVICE)
    per_rank = torch.randn(block_r, cols, generator=gen).to(DEVICE)
    rows = torch.full((block_t * block_r, cols), float("nan"), device=DEVICE)
    sum_t, sum_r = max(16, block_t), max(16, block_r)
    by_token = torch.full((sum_t, cols), float("nan"), device=DEVICE)
    by_rank = torch.full((sum_r, cols), float("nan"), device=DEVICE)
    _rank_token_kernel[(1,)](per_token, per_rank, rows, by_token, by_rank, BLOCK_T=block_t, BLOCK_R=block_r,
                             COLS=cols, SUM_T=sum_t, SUM_R=sum_r, SUM_PRECISION=precision, num_warps=num_warps)
    expected = (per_token[:, None, :] * per_rank[None, :, :])  # [T, R, COLS], row = t * BLOCK_R + r
    torch.testing.assert_close(rows, expected.reshape(-1, cols), rtol=0, atol=0)
    # The sums are selection products: tf32x3 is fp32-level (~2^-21), tf32 ~2^-11; zero past the real rows.
    torch.testing.assert_close(by_token[:block_t], expected.sum(1), rtol=tol, atol=10 * tol)
    torch.testing.assert_close(by_rank[:block_r], expected.sum(0), rtol=tol, atol=10 * tol)
    assert torch.all(by_token[block_t:] == 0) and torch.all(by_rank[block_r:] == 0)


@triton.jit
def _weights_kernel(da_ptr, gamma_ptr, ts_ptr, out_ptr, S, t0,
                    C: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    row_t, row_r, row_valid = tu.chunk_rows(BLOCK_T, BLOCK_R, C, R)
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
def _rotate_kernel(x_ptr, bias_ptr, angles_ptr, lo_ptr, hi_ptr, S,
                   C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, RD: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr):
    row_t, row_r, row_valid = tu.chunk_rows(BLOCK_T, BLOCK_R, C, R)
    offs_half = tl.arange(0, BLOCK_HALF)
    half_mask = offs_half < N // 2
    row_mask = row_valid & (row_t < S)
    cos, sin = tu.load_chunk_cos_sin(angles_ptr, 0, S, RD, offs_half, BLOCK_T, BLOCK_R, BLOCK_HALF, C, RD)
    lo, hi = tu.load_rotated_rows(x_ptr, bias_ptr, row_t, row_r, row_mask, R * N, N, offs_half, half_mask,
                                  cos, sin, N, R, BLOCK_T, BLOCK_R, BLOCK_HALF, tl.float32)
    rows = tl.arange(0, BLOCK_T * BLOCK_R)
    out_offs = rows[:, None] * BLOCK_HALF + offs_half[None, :]
    tl.store(lo_ptr + out_offs, lo)
    tl.store(hi_ptr + out_offs, hi)


@pytest.mark.parametrize("C,R,N,divisor,S", [(16, 4, 128, 4, 16), (8, 4, 16, 4, 8), (8, 8, 256, 4, 8),
                                             (16, 3, 48, 2, 13), (64, 1, 64, 4, 64)])
def test_load_rotated_rows(C, R, N, divisor, S):
    block_r = triton.next_power_of_2(R)
    block_t = max(triton.next_power_of_2(C), 16 // block_r)
    block_half = max(16, triton.next_power_of_2(N // 2))
    rd = N // divisor
    gen = torch.Generator().manual_seed(seed_for(f"rotate_{C}_{R}_{N}_{S}"))
    x = torch.randn(S, R, N, generator=gen)         # [S, R, G=1, N] of one (b, g)
    bias = torch.randn(R, N, generator=gen)
    angles = 10 * torch.randn(S, rd, generator=gen)  # [S, H=1, RD]
    rows = block_t * block_r
    lo = torch.full((rows, block_half), float("nan"))
    hi = torch.full((rows, block_half), float("nan"))
    args = [t.to(DEVICE) for t in (x, bias, angles, lo, hi)]
    _rotate_kernel[(1,)](*args, S, C=C, R=R, N=N, RD=rd, BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_HALF=block_half)
    xb = (x + bias).double()
    theta = torch.zeros(S, N // 2, dtype=torch.float64)
    theta[:, :rd] = angles.double()
    cos, sin = torch.cos(theta)[:, None, :], torch.sin(theta)[:, None, :]
    ref_lo = xb[..., :N // 2] * cos - xb[..., N // 2:] * sin
    ref_hi = xb[..., :N // 2] * sin + xb[..., N // 2:] * cos
    t = torch.arange(rows) // block_r
    r = torch.arange(rows) % block_r
    valid = (t < min(C, S)) & (r < R)
    got_lo = args[3].cpu()[valid][:, :N // 2].double()
    got_hi = args[4].cpu()[valid][:, :N // 2].double()
    torch.testing.assert_close(got_lo, ref_lo[t[valid], r[valid]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_hi, ref_hi[t[valid], r[valid]], rtol=1e-5, atol=1e-5)
    # Padding ranks are exact zeros; positions past S only need to be finite (their weights are 0).
    pad_rank = r >= R
    assert torch.all(args[3].cpu()[pad_rank] == 0) and torch.all(args[4].cpu()[pad_rank] == 0)
    assert torch.isfinite(args[3].cpu()).all() and torch.isfinite(args[4].cpu()).all()


@triton.jit
def _increment_kernel(k_ptr, psiv_ptr, w_ptr, lo_ptr, hi_ptr, ROWS: tl.constexpr, HALF: tl.constexpr,
                      P: tl.constexpr, DOT_DTYPE: tl.constexpr):
    rows = tl.arange(0, ROWS)
    half = tl.arange(0, HALF)
    cols = tl.arange(0, P)
    k_lo = tl.load(k_ptr + rows[:, None] * (2 * HALF) + half[None, :]).to(DOT_DTYPE)
    k_hi = tl.load(k_ptr + rows[:, None] * (2 * HALF) + HALF + half[None, :]).to(DOT_DTYPE)
    psiv = tl.load(psiv_ptr + rows[:, None] * P + cols[None, :])
    weight = tl.load(w_ptr + rows)
    inc_lo, inc_hi = tu.state_increment(k_lo, k_hi, psiv, weight, DOT_DTYPE, "ieee")
    tl.store(lo_ptr + half[:, None] * P + cols[None, :], inc_lo)
    tl.store(hi_ptr + half[:, None] * P + cols[None, :], inc_hi)


@pytest.mark.parametrize("rows,half,p", [(64, 64, 64), (64, 128, 32), (32, 16, 64), (64, 32, 128)])
def test_state_increment(rows, half, p):
    """k~^T (w * psiv) in fp32 exactly, and in bf16 operands on the GPU within bf16 rounding."""
    gen = torch.Generator().manual_seed(seed_for(f"increment_{rows}_{half}_{p}"))
    k = torch.randn(rows, 2 * half, generator=gen)
    psiv = torch.randn(rows, p, generator=gen)
    weight = torch.rand(rows, generator=gen)
    expected = k.double().T @ (weight.double()[:, None] * psiv.double())
    dtypes = [(tl.float32, 1e-5)] + ([(tl.bfloat16, 3e-2)] if DEVICE == "cuda" else [])
    for dot_dtype, tol in dtypes:
        lo = torch.full((half, p), float("nan"), device=DEVICE)
        hi = torch.full((half, p), float("nan"), device=DEVICE)
        _increment_kernel[(1,)](k.to(DEVICE), psiv.to(DEVICE), weight.to(DEVICE), lo, hi, ROWS=rows, HALF=half,
                                P=p, DOT_DTYPE=dot_dtype)
        got = torch.cat([lo, hi]).cpu().double()
        err = ((got - expected).norm() / expected.norm()).item()
        assert err <= tol, (dot_dtype, err)


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
