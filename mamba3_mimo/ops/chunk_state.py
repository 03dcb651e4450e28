"""Stage 1 of the production path: each sequence segment's own end state.

The production scan splits every (b, h) sequence into ``n_segments`` runs of
chunks so that segments can be scanned in parallel.  A segment needs the state
entering it; that is the decayed sum of the earlier segments' end states
computed here from a zero start.  This pass reads only k, v and the
discretization (not q, dout or z) and does one matrix product per chunk, the
state update.
"""

import torch
import triton
import triton.language as tl

from .triton_utils import (
    chunk_rows,
    load_chunk_cos_sin,
    load_rank_tile,
    load_rotated_rows,
    load_token_discretization,
    load_token_tile,
    state_increment,
)


@triton.jit
def _segment_end_state_kernel(
    k_ptr, v_ptr, angles_ptr, k_bias_ptr, psi_ptr,
    da_cs_ptr, da_rev_ptr, dt_ptr, trap_ptr,
    seg_state_ptr,
    S, H, G, HEADS_PER_GROUP, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
    C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr, RD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_p = tl.program_id(0)
    seg = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    g = h // HEADS_PER_GROUP
    HALF: tl.constexpr = N // 2

    row_t, row_r, row_valid = chunk_rows(BLOCK_T, BLOCK_R, C, R)
    offs_half = tl.arange(0, BLOCK_HALF)
    half_mask = offs_half < HALF
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = offs_p < P
    tok = tl.arange(0, BLOCK_T)

    k_bias_head = k_bias_ptr + h * R * N
    psi_head = psi_ptr + h * R * P

    disc_base = bh * S
    qk_token_stride = R * G * N
    k_seq = k_ptr + b * S * qk_token_stride + g * N
    v_seq = v_ptr + (b * S * H + h) * P
    angles_seq = angles_ptr + (b * S * H + h) * RD

    state_lo = tl.zeros((BLOCK_HALF, BLOCK_P), dtype=tl.float32)
    state_hi = tl.zeros((BLOCK_HALF, BLOCK_P), dtype=tl.float32)
    # Only full segments come here (all but the last), so every program runs CHUNKS_PER_SEG chunks.
    for i in range(0, CHUNKS_PER_SEG):
        c = seg * CHUNKS_PER_SEG + i
        t0 = c * C
        t_abs = t0 + row_t
        row_mask = row_valid & (t_abs < S)

        cos, sin = load_chunk_cos_sin(angles_seq, t0, S, H * RD, offs_half, BLOCK_T, BLOCK_R, BLOCK_HALF, C, RD)
        k_lo, k_hi = load_rotated_rows(k_seq, k_bias_head, t_abs, row_r, row_mask, qk_token_stride, G * N,
                                       offs_half, half_mask, cos, sin, N, R, BLOCK_T, BLOCK_R, BLOCK_HALF,
                                       DOT_DTYPE)
        _, da_rev, _, trap_scale = load_token_discretization(
            da_cs_ptr + disc_base, da_rev_ptr + disc_base, dt_ptr + disc_base, trap_ptr + disc_base, t_abs, S)
        v_rows = load_token_tile(v_seq, t0, S, tok, H * P, offs_p, p_mask, C, BLOCK_T, BLOCK_R, BLOCK_P)
        psiv = v_rows * load_rank_tile(psi_head, offs_p, p_mask, R, P, BLOCK_T, BLOCK_R, BLOCK_P)
        k_weight = tl.where(row_mask, tl.exp(da_rev) * trap_scale, 0.0)
        inc_lo, inc_hi = state_increment(k_lo, k_hi, psiv, k_weight, DOT_DTYPE, DOT_PRECISION)

        chunk_decay = tl.exp(tl.load(da_cs_ptr + disc_base + tl.minimum(t0 + C - 1, S - 1)))
        state_lo = state_lo * chunk_decay + inc_lo
        state_hi = state_hi * chunk_decay + inc_hi

    out = seg_state_ptr + (bh * N_SEGMENTS + seg) * N * P
    st_offs = offs_half[:, None] * P + offs_p[None, :]
    st_mask = half_mask[:, None] & p_mask[None, :]
    tl.store(out + st_offs, state_lo, mask=st_mask)
    tl.store(out + HALF * P + st_offs, state_hi, mask=st_mask)


def segment_end_states(*, k, v, angles, k_bias, mimo_v, da_cs, da_cs_rev, dt, trap,
                       chunk_size, n_segments, chunks_per_segment, block_p, dot_dtype, dot_precision,
                       num_warps=4, num_stages=1):
    """End state of every segment but the last, each scanned from a zero state.

    Args (contiguous; see ``mamba3_mimo.api`` for validation):
        k: [B, S, R, G, N]; v: [B, S, H, P]; angles: [B, S, H, RD];
        k_bias: [H, R, N] fp32; mimo_v: [H, R, P] fp32;
        da_cs, da_cs_rev, dt: [B, H, S] fp32; trap: [B, H, S].
    Returns:
        seg_state: [B, H, n_segments, N, P] fp32; entry ``n_segments - 1`` is unused.
    """
    B, S, R, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    RD = angles.shape[3]
    nch = triton.cdiv(S, chunk_size)
    seg_state = torch.empty((B, H, n_segments, N, P), device=k.device, dtype=torch.float32)
    if n_segments == 1:
        return seg_state
    meta = chunk_meta(chunk_size, R, N, block_p)
    grid = (triton.cdiv(P, block_p), n_segments - 1, B * H)
    _segment_end_state_kernel[grid](
        k, v, angles, k_bias, mimo_v, da_cs, da_cs_rev, dt, trap, seg_state,
        S, H, G, H // G, nch, chunks_per_segment, n_segments,
        C=chunk_size, R=R, N=N, P=P, RD=RD, **meta,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    return seg_state


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
