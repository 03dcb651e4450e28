"""stage0: the plain Triton baseline, kept for comparison (SPEC section 6).

Three passes in the order of the upstream kernel:
  1. rotary:  bias-add and rotate-half of q and k into fp32 scratch [B, H, S, R, N];
  2. qk_dot:  the same-token R x R products from that scratch;
  3. scan:    one program per (b, h) walks every chunk in series with the whole
              [N, P] state in registers, reading the caller's ``segsum``.
It is deliberately simple; the production path lives in chunk_state / chunk_output.
"""

import torch
import triton
import triton.language as tl

from .triton_utils import (
    chunk_rows,
    gate_grads,
    load_chunk_cos_sin,
    load_rank_tile,
    load_rotated_rows,
    load_token_discretization,
    load_token_tile,
    store_token_tile,
    sum_over_ranks,
    sum_over_tokens,
)


def chunk_meta(chunk_size, R, N, block_p):
    """Block sizes of the folded chunk tile: rows = BLOCK_T * BLOCK_R >= 16 (tl.dot's minimum)."""
    block_r = triton.next_power_of_2(R)
    block_t = max(triton.next_power_of_2(chunk_size), max(1, 16 // block_r))
    return dict(BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_HALF=max(16, triton.next_power_of_2(N // 2)),
                BLOCK_P=block_p)


def reduction_meta(chunk_size, R, dot_dtype):
    """Row counts (selection products need M >= 16) and precision of the rank / token sums."""
    meta = chunk_meta(chunk_size, R, 2, 16)
    precision = "tf32x3" if dot_dtype == tl.float32 else "tf32"
    return dict(SUM_T=max(16, meta["BLOCK_T"]), SUM_R=max(16, meta["BLOCK_R"]), SUM_PRECISION=precision)


# Warps of the serial scan (module-level so benchmarks/diagnose_case.py can try others).
SERIAL_SCAN_WARPS = 8


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, angles_ptr, q_bias_ptr, k_bias_ptr, q_rot_ptr, k_rot_ptr,
    S, H, G, HEADS_PER_GROUP,
    C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, RD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    g = h // HEADS_PER_GROUP
    HALF: tl.constexpr = N // 2
    row_t, row_r, row_valid = chunk_rows(BLOCK_T, BLOCK_R, C, R)
    offs_half = tl.arange(0, BLOCK_HALF)
    half_mask = offs_half < HALF
    t0 = c * C
    t_abs = t0 + row_t
    row_mask = row_valid & (t_abs < S)
    token_stride = R * G * N
    x_seq = b * S * token_stride + g * N
    cos, sin = load_chunk_cos_sin(angles_ptr + (b * S * H + h) * RD, t0, S, H * RD, offs_half,
                                  BLOCK_T, BLOCK_R, BLOCK_HALF, C, RD)
    out_offs = (bh * S + t_abs)[:, None] * R * N + row_r[:, None] * N + offs_half[None, :]
    out_mask = row_mask[:, None] & half_mask[None, :]
    q_lo, q_hi = load_rotated_rows(q_ptr + x_seq, q_bias_ptr + h * R * N, t_abs, row_r, row_mask, token_stride,
                                   G * N, offs_half, half_mask, cos, sin, N, R, BLOCK_T, BLOCK_R, BLOCK_HALF,
                                   tl.float32)
    tl.store(q_rot_ptr + out_offs, q_lo, mask=out_mask)
    tl.store(q_rot_ptr + out_offs + HALF, q_hi, mask=out_mask)
    k_lo, k_hi = load_rotated_rows(k_ptr + x_seq, k_bias_ptr + h * R * N, t_abs, row_r, row_mask, token_stride,
                                   G * N, offs_half, half_mask, cos, sin, N, R, BLOCK_T, BLOCK_R, BLOCK_HALF,
                                   tl.float32)
    tl.store(k_rot_ptr + out_offs, k_lo, mask=out_mask)
    tl.store(k_rot_ptr + out_offs + HALF, k_hi, mask=out_mask)


@triton.jit
def _qk_dot_kernel(q_rot_ptr, k_rot_ptr, qk_dot_ptr, S,
                   C: tl.constexpr, R: tl.constexpr, N: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    tile_mask = (ranks < R)[:, None] & (offs_n < N)[None, :]
    for tok in range(0, C):
        t = c * C + tok
        if t < S:
            base = (bh * S + t) * R * N
            q_t = tl.load(q_rot_ptr + base + ranks[:, None] * N + offs_n[None, :], mask=tile_mask, other=0.0)
            k_t = tl.load(k_rot_ptr + base + ranks[:, None] * N + offs_n[None, :], mask=tile_mask, other=0.0)
            qk = tl.sum(q_t[:, None, :] * k_t[None, :, :], axis=2)
            out = qk_dot_ptr + (bh * S + t) * R * R + ranks[:, None] * R + ranks[None, :]
            pair_mask = (ranks < R)[:, None] & (ranks < R)[None, :]
            tl.store(out, qk.to(qk_dot_ptr.dtype.element_ty), mask=pair_mask)


@triton.jit
def _serial_scan_kernel(
    q_rot_ptr, k_rot_ptr, v_ptr, dout_ptr, z_ptr,
    psi_ptr, phi_ptr, zeta_ptr, d_ptr,
    da_cs_ptr, da_rev_ptr, dt_ptr, trap_ptr, segsum_ptr,
    states_ptr, dz_ptr, dphi_ptr, dzeta_ptr,
    S, H, NCH,
    C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    SUM_T: tl.constexpr, SUM_R: tl.constexpr, SUM_PRECISION: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    BLOCK_ROWS: tl.constexpr = BLOCK_T * BLOCK_R
    row_t, row_r, row_valid = chunk_rows(BLOCK_T, BLOCK_R, C, R)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = offs_p < P
    tok = tl.arange(0, BLOCK_T)

    psi = load_rank_tile(psi_ptr + h * R * P, offs_p, p_mask, R, P, BLOCK_T, BLOCK_R, BLOCK_P)
    phi = load_rank_tile(phi_ptr + h * R * P, offs_p, p_mask, R, P, BLOCK_T, BLOCK_R, BLOCK_P)
    if HAS_Z:
        zeta = load_rank_tile(zeta_ptr + h * R * P, offs_p, p_mask, R, P, BLOCK_T, BLOCK_R, BLOCK_P)
    if HAS_D:
        d_skip = tl.load(d_ptr + h).to(tl.float32)

    disc_base = bh * S
    hp_seq = (b * S * H + h) * P
    state = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
    dphi_acc = tl.zeros((BLOCK_ROWS, BLOCK_P), dtype=tl.float32)
    dzeta_acc = tl.zeros((BLOCK_ROWS, BLOCK_P), dtype=tl.float32)
    st_offs = offs_n[:, None] * P + offs_p[None, :]
    st_mask = n_mask[:, None] & p_mask[None, :]
    for c in range(0, NCH):
        t0 = c * C
        t0_64 = t0.to(tl.int64)
        t_abs = t0 + row_t
        row_mask = row_valid & (t_abs < S)
        rot_offs = (bh * S + t0_64) * R * N + (row_t * R + row_r)[:, None] * N + offs_n[None, :]
        rot_mask = row_mask[:, None] & n_mask[None, :]
        q_rows = tl.load(q_rot_ptr + rot_offs, mask=rot_mask, other=0.0)
        k_rows = tl.load(k_rot_ptr + rot_offs, mask=rot_mask, other=0.0)
        q_rows_d = q_rows.to(DOT_DTYPE)
        scores = tl.dot(q_rows_d, tl.trans(k_rows.to(DOT_DTYPE)), input_precision=DOT_PRECISION)

        da_cs, da_rev, gamma, trap_scale = load_token_discretization(
            da_cs_ptr + disc_base, da_rev_ptr + disc_base, dt_ptr + disc_base, trap_ptr + disc_base, t_abs, S)
        both = row_mask[:, None] & row_mask[None, :]
        earlier = (row_t[:, None] > row_t[None, :]) & both
        seg_offs = ((bh * NCH + c) * C + row_t[:, None]) * C + row_t[None, :]
        segsum = tl.load(segsum_ptr + seg_offs, mask=earlier, other=0.0)
        weights = tl.where(earlier, tl.exp(segsum) * trap_scale[None, :],
                           tl.where((row_t[:, None] == row_t[None, :]) & both, gamma[:, None], 0.0))

        v_rows = load_token_tile(v_ptr + hp_seq, t0, S, tok, H * P, offs_p, p_mask, C, BLOCK_T, BLOCK_R, BLOCK_P)
        psiv = v_rows * psi
        psiv_d = psiv.to(DOT_DTYPE)
        raw_y = tl.dot((scores * weights).to(DOT_DTYPE), psiv_d, input_precision=DOT_PRECISION)
        y_state = tl.dot(q_rows_d, state.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        raw_y += tl.exp(da_cs)[:, None] * y_state
        if HAS_D:
            raw_y += d_skip * psiv

        tl.store(states_ptr + (bh * NCH + c) * N * P + st_offs, state.to(states_ptr.dtype.element_ty),
                 mask=st_mask)
        k_weight = tl.where(row_mask, tl.exp(da_rev) * trap_scale, 0.0)
        k_w = (k_rows * k_weight[:, None]).to(DOT_DTYPE)
        chunk_decay = tl.exp(tl.load(da_cs_ptr + disc_base + tl.minimum(t0 + C - 1, S - 1)))
        state = state * chunk_decay + tl.dot(tl.trans(k_w), psiv_d, input_precision=DOT_PRECISION)

        dout_rows = load_token_tile(dout_ptr + hp_seq, t0, S, tok, H * P, offs_p, p_mask, C, BLOCK_T, BLOCK_R, BLOCK_P)
        if HAS_Z:
            z_rows = load_token_tile(z_ptr + hp_seq, t0, S, tok, H * P, offs_p, p_mask, C, BLOCK_T, BLOCK_R, BLOCK_P)
            dphi_inc, dzeta_inc, dz_rows = gate_grads(raw_y, dout_rows, phi, z_rows, zeta)
            dphi_acc += dphi_inc
            dzeta_acc += dzeta_inc
            dz_tok = sum_over_ranks(dz_rows, BLOCK_T, BLOCK_R, SUM_T, SUM_PRECISION)
            store_token_tile(dz_ptr + hp_seq, dz_tok, t0, S, tl.arange(0, SUM_T), H * P, offs_p, p_mask, C)
        else:
            dphi_acc += raw_y * dout_rows

    ranks = tl.arange(0, SUM_R)
    rp_offs = bh * R * P + ranks[:, None] * P + offs_p[None, :]
    rp_mask = (ranks < R)[:, None] & p_mask[None, :]
    tl.store(dphi_ptr + rp_offs, sum_over_tokens(dphi_acc, BLOCK_T, BLOCK_R, SUM_R, SUM_PRECISION).to(
        dphi_ptr.dtype.element_ty), mask=rp_mask)
    if HAS_Z:
        tl.store(dzeta_ptr + rp_offs, sum_over_tokens(dzeta_acc, BLOCK_T, BLOCK_R, SUM_R, SUM_PRECISION).to(
            dzeta_ptr.dtype.element_ty), mask=rp_mask)


def stage0_bwd_fwd(*, q, k, v, dout, z, angles, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d,
                   da_cs, da_cs_rev, dt, trap, segsum, states, qk_dot, dmimo_o, dmimo_z, dz,
                   chunk_size, dot_dtype, dot_precision):
    """The baseline: rotary pass, qk_dot pass, serial scan; fills every output tensor in place.

    Args (contiguous): as ``chunk_scan``, plus segsum: [B, H, nch, C, C] fp32 and the outputs
    dmimo_o, dmimo_z: [B, H, R, P] (dmimo_z, dz, z, mimo_z None without the gate).
    """
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    RD = angles.shape[3]
    nch = triton.cdiv(S, chunk_size)
    has_z = z is not None
    meta = chunk_meta(chunk_size, R, N, triton.next_power_of_2(P))
    q_rot = torch.empty((B, H, S, R, N), device=q.device, dtype=torch.float32)
    k_rot = torch.empty_like(q_rot)
    _rotary_kernel[(nch, B * H)](
        q, k, angles, q_bias, k_bias, q_rot, k_rot, S, H, G, H // G,
        C=chunk_size, R=R, N=N, RD=RD,
        BLOCK_T=meta["BLOCK_T"], BLOCK_R=meta["BLOCK_R"], BLOCK_HALF=meta["BLOCK_HALF"],
    )
    _qk_dot_kernel[(nch, B * H)](
        q_rot, k_rot, qk_dot, S, C=chunk_size, R=R, N=N,
        BLOCK_R=meta["BLOCK_R"], BLOCK_N=triton.next_power_of_2(N),
    )
    _serial_scan_kernel[(B * H,)](
        q_rot, k_rot, v, dout, z if has_z else dout,
        mimo_v, mimo_o, mimo_z if has_z else mimo_o, d if d is not None else mimo_o,
        da_cs, da_cs_rev, dt, trap, segsum,
        states, dz if has_z else states, dmimo_o, dmimo_z if has_z else dmimo_o,
        S, H, nch,
        C=chunk_size, R=R, N=N, P=P,
        BLOCK_T=meta["BLOCK_T"], BLOCK_R=meta["BLOCK_R"],
        BLOCK_N=max(16, triton.next_power_of_2(N)), BLOCK_P=max(16, triton.next_power_of_2(P)),
        **reduction_meta(chunk_size, R, dot_dtype),
        HAS_Z=has_z, HAS_D=d is not None,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        # One stage: the chunk loop's loads are not multi-buffered.  The default (3) asked the
        # H200 for 285 KB of shared memory on a C=32, R=3 tail case.
        num_warps=SERIAL_SCAN_WARPS, num_stages=1,
    )
