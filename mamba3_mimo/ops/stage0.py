"""stage0: the plain Triton baseline, kept for comparison (SPEC section 6).

Three passes in the order of the upstream kernel:
  1. rotary:  bias-add and rotate-half of q and k into fp32 scratch [B, H, S, R, N];
  2. qk_dot:  the same-token R x R products from that scratch (fp32 row sums);
  3. scan:    one program per (b, h) walks every chunk in series with the whole
              [N, P] state in registers, reading the caller's ``segsum``.
It is deliberately simple; the production path lives in chunk_state / chunk_output.
"""

import torch
import triton
import triton.language as tl

from .host_utils import cdiv, next_power_of_2
from .triton_utils import (
    accumulate_rank_grads,
    chunk_rows,
    load_rotated_gather,
    load_rows,
    load_token_discretization,
)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_bias_ptr, k_bias_ptr, q_rot_ptr, k_rot_ptr,
    S, H, G, HEADS_PER_GROUP,
    C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, RD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    g = h // HEADS_PER_GROUP
    HALF: tl.constexpr = N // 2
    row_t, row_r, row_valid = chunk_rows(BLOCK_ROWS, C, R)
    t_rows = c * C + row_t
    row_mask = row_valid & (t_rows < S)
    offs_half = tl.arange(0, BLOCK_HALF)
    half_mask = offs_half < HALF
    x_seq = b * S * R * G * N + g * N
    angle_base = (b * S * H + h) * RD
    out_offs = ((bh * S + t_rows) * R + row_r)[:, None] * N + offs_half[None, :]
    out_mask = row_mask[:, None] & half_mask[None, :]
    q_lo, q_hi = load_rotated_gather(q_ptr + x_seq, q_bias_ptr + h * R * N, cos_ptr + angle_base,
                                     sin_ptr + angle_base, t_rows, row_r, row_mask, R * G * N, G * N, H * RD,
                                     offs_half, half_mask, N, RD, tl.float32)
    tl.store(q_rot_ptr + out_offs, q_lo, mask=out_mask)
    tl.store(q_rot_ptr + out_offs + HALF, q_hi, mask=out_mask)
    k_lo, k_hi = load_rotated_gather(k_ptr + x_seq, k_bias_ptr + h * R * N, cos_ptr + angle_base,
                                     sin_ptr + angle_base, t_rows, row_r, row_mask, R * G * N, G * N, H * RD,
                                     offs_half, half_mask, N, RD, tl.float32)
    tl.store(k_rot_ptr + out_offs, k_lo, mask=out_mask)
    tl.store(k_rot_ptr + out_offs + HALF, k_hi, mask=out_mask)


@triton.jit
def _qk_dot_kernel(q_rot_ptr, k_rot_ptr, qk_dot_ptr, S,
                   C: tl.constexpr, R: tl.constexpr, N: tl.constexpr,
                   BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # For each key rank u, the chunk's (token, rank r) rows of q~ dotted with k~[t, u]: a plain
    # row sum in fp32.  (A 3-d broadcast-and-sum here drew write-after-write hazards from
    # racecheck; [rows, N] tiles of >= 256 elements are never replicated across threads.)
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    row_t, row_r, row_valid = chunk_rows(BLOCK_ROWS, C, R)
    t_rows = c * C + row_t
    row_mask = row_valid & (t_rows < S)
    offs_n = tl.arange(0, BLOCK_N)
    tile_mask = row_mask[:, None] & (offs_n < N)[None, :]
    token_rows = (bh * S + t_rows) * R
    q_rows = tl.load(q_rot_ptr + ((token_rows + row_r) * N)[:, None] + offs_n[None, :], mask=tile_mask, other=0.0)
    for u in range(0, R):
        k_rows = tl.load(k_rot_ptr + ((token_rows + u) * N)[:, None] + offs_n[None, :], mask=tile_mask, other=0.0)
        qk_u = tl.sum(q_rows * k_rows, axis=1)
        tl.store(qk_dot_ptr + (token_rows + row_r) * R + u, qk_u.to(qk_dot_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _serial_scan_kernel(
    q_rot_ptr, k_rot_ptr, v_ptr, dout_ptr, z_ptr,
    psi_ptr, phi_ptr, zeta_ptr, d_ptr,
    da_cs_ptr, da_rev_ptr, dt_ptr, trap_ptr, segsum_ptr,
    states_ptr, dz_ptr, dphi_ptr, dzeta_ptr,
    S, H, NCH,
    C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    # Key side: rows are the chunk's (token, rank) pairs; query side: one rank at a time.
    row_t, row_u, row_valid = chunk_rows(BLOCK_ROWS, C, R)
    tok = tl.arange(0, BLOCK_C)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = offs_p < P
    ranks = tl.arange(0, BLOCK_R)

    psi_rows = load_rows(psi_ptr + h * R * P, row_u * P, row_valid, offs_p, p_mask)
    d_skip = 0.0
    if HAS_D:
        d_skip = tl.load(d_ptr + h).to(tl.float32)
    disc_base = bh * S
    hp_seq = (b * S * H + h) * P
    rot_seq = bh * S * R * N
    state = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
    dphi_acc = tl.zeros((BLOCK_R, BLOCK_P), dtype=tl.float32)
    dzeta_acc = tl.zeros((BLOCK_R, BLOCK_P), dtype=tl.float32)
    st_offs = offs_n[:, None] * P + offs_p[None, :]
    st_mask = n_mask[:, None] & p_mask[None, :]
    for c in range(0, NCH):
        t_rows = c * C + row_t
        row_mask = row_valid & (t_rows < S)
        t_tok = c * C + tok
        tok_mask = (tok < C) & (t_tok < S)
        # k~^T of the chunk from the rotary scratch: [N, rows].
        k_t = tl.load(k_rot_ptr + rot_seq + (t_rows * R + row_u)[None, :] * N + offs_n[:, None],
                      mask=row_mask[None, :] & n_mask[:, None], other=0.0).to(DOT_DTYPE)
        _, da_rev, _, ts_rows = load_token_discretization(
            da_cs_ptr + disc_base, da_rev_ptr + disc_base, dt_ptr + disc_base, trap_ptr + disc_base, t_rows, S)
        da_tok, _, gamma_tok, _ = load_token_discretization(
            da_cs_ptr + disc_base, da_rev_ptr + disc_base, dt_ptr + disc_base, trap_ptr + disc_base, t_tok, S)
        # The caller's segsum [B, H, nch, C, C] gives the decay from an earlier token to a later one.
        both = tok_mask[:, None] & row_mask[None, :]
        earlier = (tok[:, None] > row_t[None, :]) & both
        same = (tok[:, None] == row_t[None, :]) & both
        segsum = tl.load(segsum_ptr + ((bh * NCH + c) * C + tok[:, None]) * C + row_t[None, :], mask=earlier,
                         other=0.0)
        weights = tl.where(earlier, tl.exp(segsum) * ts_rows[None, :], tl.where(same, gamma_tok[:, None], 0.0))
        psiv = load_rows(v_ptr + hp_seq, t_rows * (H * P), row_mask, offs_p, p_mask) * psi_rows

        tl.store(states_ptr + (bh * NCH + c) * N * P + st_offs, state.to(states_ptr.dtype.element_ty),
                 mask=st_mask)
        state_d = state.to(DOT_DTYPE)
        tok_offs = t_tok * (H * P)
        dout_tok = load_rows(dout_ptr + hp_seq, tok_offs, tok_mask, offs_p, p_mask)
        z_tok = load_rows(z_ptr + hp_seq, tok_offs, tok_mask & HAS_Z, offs_p, p_mask)
        v_tok = load_rows(v_ptr + hp_seq, tok_offs, tok_mask & HAS_D, offs_p, p_mask)
        dz_acc = tl.zeros((BLOCK_C, BLOCK_P), dtype=tl.float32)
        for r in range(0, R):
            q_r = tl.load(q_rot_ptr + rot_seq + (t_tok * R + r)[:, None] * N + offs_n[None, :],
                          mask=tok_mask[:, None] & n_mask[None, :], other=0.0).to(DOT_DTYPE)
            scores = tl.dot(q_r, k_t, input_precision=DOT_PRECISION)
            raw_y = tl.dot((scores * weights).to(DOT_DTYPE), psiv.to(DOT_DTYPE), input_precision=DOT_PRECISION)
            raw_y += tl.exp(da_tok)[:, None] * tl.dot(q_r, state_d, input_precision=DOT_PRECISION)
            dphi_acc, dzeta_acc, dz_acc = accumulate_rank_grads(
                raw_y, r, dphi_acc, dzeta_acc, dz_acc, dout_tok, z_tok, v_tok, d_skip, psi_ptr + h * R * P,
                phi_ptr + h * R * P, zeta_ptr + h * R * P, ranks, offs_p, p_mask, P, HAS_Z, HAS_D)
        if HAS_Z:
            tl.store(dz_ptr + hp_seq + t_tok.to(tl.int64)[:, None] * (H * P) + offs_p[None, :],
                     dz_acc.to(dz_ptr.dtype.element_ty), mask=tok_mask[:, None] & p_mask[None, :])

        k_weight = tl.where(row_mask, tl.exp(da_rev) * ts_rows, 0.0)
        chunk_decay = tl.exp(tl.load(da_cs_ptr + disc_base + tl.minimum(c * C + C - 1, S - 1)))
        state = state * chunk_decay + tl.dot(k_t, (psiv * k_weight[:, None]).to(DOT_DTYPE),
                                             input_precision=DOT_PRECISION)

    rp_offs = bh * R * P + ranks[:, None] * P + offs_p[None, :]
    rp_mask = (ranks < R)[:, None] & p_mask[None, :]
    tl.store(dphi_ptr + rp_offs, dphi_acc.to(dphi_ptr.dtype.element_ty), mask=rp_mask)
    if HAS_Z:
        tl.store(dzeta_ptr + rp_offs, dzeta_acc.to(dzeta_ptr.dtype.element_ty), mask=rp_mask)


def stage0_bwd_fwd(*, q, k, v, dout, z, angles, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d,
                   da_cs, da_cs_rev, dt, trap, segsum, states, qk_dot, dmimo_o, dmimo_z, dz,
                   chunk_size, dot_dtype, dot_precision):
    """The baseline: rotary pass, qk_dot pass, serial scan; fills every output tensor in place.

    Args (contiguous): q, k: [B, S, R, G, N]; v, dout, z: [B, S, H, P]; angles: [B, S, H, RD]
        fp32; q_bias, k_bias: [H, R, N] fp32; mimo_v, mimo_o, mimo_z: [H, R, P] fp32;
        d: [H] fp32; da_cs, da_cs_rev, dt: [B, H, S] fp32; trap: [B, H, S];
        segsum: [B, H, nch, C, C] fp32; outputs states [B, H, nch, N, P], qk_dot [B, H, S, R, R],
        dmimo_o, dmimo_z: [B, H, R, P], dz: [B, S, H, P] (dmimo_z, dz, z, mimo_z None without the
        gate, d None without the skip).
    """
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    RD = angles.shape[3]
    nch = cdiv(S, chunk_size)
    has_z = z is not None
    block_rows = max(16, next_power_of_2(chunk_size * R))
    q_rot = torch.empty((B, H, S, R, N), device=q.device, dtype=torch.float32)
    k_rot = torch.empty_like(q_rot)
    _rotary_kernel[(nch, B * H)](
        q, k, torch.cos(angles), torch.sin(angles), q_bias, k_bias, q_rot, k_rot, S, H, G, H // G,
        C=chunk_size, R=R, N=N, RD=RD, BLOCK_ROWS=block_rows,
        BLOCK_HALF=max(16, next_power_of_2(N // 2)),
    )
    _qk_dot_kernel[(nch, B * H)](
        q_rot, k_rot, qk_dot, S, C=chunk_size, R=R, N=N,
        BLOCK_ROWS=block_rows, BLOCK_N=max(16, next_power_of_2(N)),
    )
    _serial_scan_kernel[(B * H,)](
        q_rot, k_rot, v, dout, z if has_z else dout,
        mimo_v, mimo_o, mimo_z if has_z else mimo_o, d if d is not None else mimo_o,
        da_cs, da_cs_rev, dt, trap, segsum,
        states, dz if has_z else states, dmimo_o, dmimo_z if has_z else dmimo_o,
        S, H, nch,
        C=chunk_size, R=R, N=N, P=P,
        BLOCK_C=max(16, next_power_of_2(chunk_size)), BLOCK_ROWS=block_rows,
        BLOCK_R=next_power_of_2(R), BLOCK_N=max(16, next_power_of_2(N)),
        BLOCK_P=max(16, next_power_of_2(P)),
        HAS_Z=has_z, HAS_D=d is not None,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        # One stage: the chunk loop's loads are not multi-buffered.  The default (3) asked the
        # H200 for 285 KB of shared memory on a C=32, R=3 tail case.
        num_warps=8, num_stages=1,
    )
