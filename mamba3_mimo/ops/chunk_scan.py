"""Stage 2 of the production path: the fused chunk scan.

One program owns one (b, h), one segment of consecutive chunks and one tile of
P columns.  It starts from the state entering its segment (folded from the
stage-1 segment end states), then walks its chunks in order.  Per chunk it
rotates q and k, writes ``qk_dot`` (from the diagonal blocks of the folded score
matrix), writes the entering state, recomputes ``raw_y`` and turns it into the
Phi/Zeta/z gradients, and advances the state.  Every output is written once and
the state never leaves registers, so HBM traffic stays at the floor of the
problem plus the small segment fold.

The recurrence and every output but ``qk_dot`` are separable along P; the P
tiles of one (b, h) recompute the same score matrix, which the dispatcher
trades against parallelism.
"""

import torch
import triton
import triton.language as tl

from .chunk_state import chunk_meta, reduction_meta
from .triton_utils import (
    chunk_rows,
    intra_chunk_weights,
    load_chunk_cos_sin,
    load_rank_tile,
    load_rotated_rows,
    load_token_discretization,
    load_token_tile,
    gate_grads,
    state_increment,
    store_token_tile,
    sum_over_ranks,
    sum_over_tokens,
)


@triton.jit
def _fold_segment(state_lo, state_hi, i, seg, seg_state_ptr, da_cs_seq_ptr, bh, S, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
                  st_offs, st_mask, C: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
                  BLOCK_SEG_CHUNKS: tl.constexpr):
    """One step of s_{i+1} = exp(segment i's log decay) s_i + end_i, a no-op unless i < seg."""
    HALF: tl.constexpr = N // 2
    earlier_seg = i < seg
    seg_chunks = tl.arange(0, BLOCK_SEG_CHUNKS)
    chunk_ids = i * CHUNKS_PER_SEG + seg_chunks
    in_seg = (seg_chunks < CHUNKS_PER_SEG) & (chunk_ids < NCH) & earlier_seg
    chunk_ends = tl.minimum(chunk_ids * C + C - 1, S - 1)
    seg_log_decay = tl.sum(tl.load(da_cs_seq_ptr + chunk_ends, mask=in_seg, other=0.0), axis=0)
    decay = tl.where(earlier_seg, tl.exp(seg_log_decay), 1.0)
    end_state = seg_state_ptr + (bh * N_SEGMENTS + i) * N * P
    end_mask = st_mask & earlier_seg
    state_lo = state_lo * decay + tl.load(end_state + st_offs, mask=end_mask, other=0.0)
    state_hi = state_hi * decay + tl.load(end_state + HALF * P + st_offs, mask=end_mask, other=0.0)
    return state_lo, state_hi


@triton.jit
def _chunk_scan_kernel(
    q_ptr, k_ptr, v_ptr, dout_ptr, z_ptr, angles_ptr,
    q_bias_ptr, k_bias_ptr, psi_ptr, phi_ptr, zeta_ptr, d_ptr,
    da_cs_ptr, da_rev_ptr, dt_ptr, trap_ptr,
    seg_state_ptr,
    states_ptr, qk_dot_ptr, dz_ptr, dphi_ptr, dzeta_ptr,
    S, H, G, HEADS_PER_GROUP, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
    C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr, RD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_SEG_CHUNKS: tl.constexpr, SUM_T: tl.constexpr, SUM_R: tl.constexpr, SUM_PRECISION: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
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
    sum_tok = tl.arange(0, SUM_T)  # rows of the rank-summed tiles

    # Per-head parameters are re-read every chunk (L1-resident) rather than held in
    # registers across the scan: register pressure, not bandwidth, limits this kernel.
    q_bias_head = q_bias_ptr + h * R * N
    k_bias_head = k_bias_ptr + h * R * N
    psi_head = psi_ptr + h * R * P
    phi_head = phi_ptr + h * R * P
    zeta_head = zeta_ptr + h * R * P
    if HAS_D:
        d_skip = tl.load(d_ptr + h).to(tl.float32)

    disc_base = bh * S
    qk_token_stride = R * G * N
    q_seq = q_ptr + b * S * qk_token_stride + g * N
    k_seq = k_ptr + b * S * qk_token_stride + g * N
    hp_seq = (b * S * H + h) * P  # [B, S, H, P] activations at (b, 0, h, 0)
    v_seq = v_ptr + hp_seq
    dout_seq = dout_ptr + hp_seq
    z_seq = z_ptr + hp_seq
    angles_seq = angles_ptr + (b * S * H + h) * RD
    states_seq = states_ptr + bh * NCH * N * P  # [B, H, nch, N, P] at (b, h, 0, 0, 0)
    qk_dot_seq = qk_dot_ptr + bh * S * R * R

    st_offs = offs_half[:, None] * P + offs_p[None, :]
    st_mask = half_mask[:, None] & p_mask[None, :]
    # State entering this segment, folded from the earlier segments' end states.  Every program
    # runs the same trip count (segments at or after ``seg`` are masked out).
    state_lo = tl.zeros((BLOCK_HALF, BLOCK_P), dtype=tl.float32)
    state_hi = tl.zeros((BLOCK_HALF, BLOCK_P), dtype=tl.float32)
    for i in range(0, N_SEGMENTS - 1):
        state_lo, state_hi = _fold_segment(state_lo, state_hi, i, seg, seg_state_ptr, da_cs_ptr + disc_base, bh,
                                           S, NCH, CHUNKS_PER_SEG, N_SEGMENTS, st_offs, st_mask, C, N, P,
                                           BLOCK_SEG_CHUNKS)

    dphi_acc = tl.zeros((SUM_R, BLOCK_P), dtype=tl.float32)
    dzeta_acc = tl.zeros((SUM_R, BLOCK_P), dtype=tl.float32)

    # A constant trip count: chunks past NCH (only in the last segment) are virtual padding,
    # fully masked, and leave every output untouched.  Index tiles are built from the
    # loop-variant positions ``t_abs`` so that none is hoisted out of the loop into registers.
    for i in range(0, CHUNKS_PER_SEG):
        c = seg * CHUNKS_PER_SEG + i
        t0 = c * C
        t_abs = t0 + row_t
        row_mask = row_valid & (t_abs < S)

        # q~, k~ of the chunk (shared angles: same token, same head).
        cos, sin = load_chunk_cos_sin(angles_seq, t0, S, H * RD, offs_half, BLOCK_T, BLOCK_R, BLOCK_HALF, C, RD)
        q_lo, q_hi = load_rotated_rows(q_seq, q_bias_head, t_abs, row_r, row_mask, qk_token_stride, G * N,
                                       offs_half, half_mask, cos, sin, N, R, BLOCK_T, BLOCK_R, BLOCK_HALF,
                                       DOT_DTYPE)
        k_lo, k_hi = load_rotated_rows(k_seq, k_bias_head, t_abs, row_r, row_mask, qk_token_stride, G * N,
                                       offs_half, half_mask, cos, sin, N, R, BLOCK_T, BLOCK_R, BLOCK_HALF,
                                       DOT_DTYPE)
        scores = tl.dot(q_lo, tl.trans(k_lo), input_precision=DOT_PRECISION)
        scores = tl.dot(q_hi, tl.trans(k_hi), scores, input_precision=DOT_PRECISION)

        if pid_p == 0:
            # Same-token blocks of the score matrix are qk_dot (rotation preserves the dot).
            qk_offs = (t_abs * R + row_r)[:, None] * R + row_r[None, :]
            qk_mask = (t_abs[:, None] == t_abs[None, :]) & row_mask[:, None] & row_mask[None, :]
            tl.store(qk_dot_seq + qk_offs, scores.to(qk_dot_ptr.dtype.element_ty), mask=qk_mask)

        da_cs, da_rev, gamma, trap_scale = load_token_discretization(
            da_cs_ptr + disc_base, da_rev_ptr + disc_base, dt_ptr + disc_base, trap_ptr + disc_base, t_abs, S)
        weights = intra_chunk_weights(t_abs, t_abs, row_mask, row_mask, da_cs, da_cs, gamma, trap_scale)

        v_rows = load_token_tile(v_seq, t0, S, tok, H * P, offs_p, p_mask, C, BLOCK_T, BLOCK_R, BLOCK_P)
        psiv = v_rows * load_rank_tile(psi_head, offs_p, p_mask, R, P, BLOCK_T, BLOCK_R, BLOCK_P)
        psiv_d = psiv.to(DOT_DTYPE)

        # raw_y = intra-chunk term + decayed q~ . state_in (+ D psiv)
        raw_y = tl.dot((scores * weights).to(DOT_DTYPE), psiv_d, input_precision=DOT_PRECISION)
        y_state = tl.dot(q_lo, state_lo.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        y_state = tl.dot(q_hi, state_hi.to(DOT_DTYPE), y_state, input_precision=DOT_PRECISION)
        raw_y += tl.exp(da_cs)[:, None] * y_state
        if HAS_D:
            raw_y += d_skip * psiv

        st_offs = (c * N + offs_half)[:, None] * P + offs_p[None, :]
        st_mask = half_mask[:, None] & p_mask[None, :] & (c < NCH)
        tl.store(states_seq + st_offs, state_lo.to(states_ptr.dtype.element_ty), mask=st_mask)
        tl.store(states_seq + HALF * P + st_offs, state_hi.to(states_ptr.dtype.element_ty), mask=st_mask)

        k_weight = tl.where(row_mask, tl.exp(da_rev) * trap_scale, 0.0)
        inc_lo, inc_hi = state_increment(k_lo, k_hi, psiv, k_weight, DOT_DTYPE, DOT_PRECISION)
        chunk_decay = tl.exp(tl.load(da_cs_ptr + disc_base + tl.minimum(t0 + C - 1, S - 1)))
        state_lo = state_lo * chunk_decay + inc_lo
        state_hi = state_hi * chunk_decay + inc_hi

        # Gradients of the output projection and the gate, reduced over the chunk's tokens
        # right away so the accumulators stay [BLOCK_R, BLOCK_P].
        dout_rows = load_token_tile(dout_seq, t0, S, tok, H * P, offs_p, p_mask, C, BLOCK_T, BLOCK_R, BLOCK_P)
        if HAS_Z:
            phi = load_rank_tile(phi_head, offs_p, p_mask, R, P, BLOCK_T, BLOCK_R, BLOCK_P)
            z_rows = load_token_tile(z_seq, t0, S, tok, H * P, offs_p, p_mask, C, BLOCK_T, BLOCK_R, BLOCK_P)
            zeta = load_rank_tile(zeta_head, offs_p, p_mask, R, P, BLOCK_T, BLOCK_R, BLOCK_P)
            dphi_rows, dzeta_rows, dz_rows = gate_grads(raw_y, dout_rows, phi, z_rows, zeta)
            dphi_acc += sum_over_tokens(dphi_rows, BLOCK_T, BLOCK_R, SUM_R, SUM_PRECISION)
            dzeta_acc += sum_over_tokens(dzeta_rows, BLOCK_T, BLOCK_R, SUM_R, SUM_PRECISION)
            dz_tok = sum_over_ranks(dz_rows, BLOCK_T, BLOCK_R, SUM_T, SUM_PRECISION)
            store_token_tile(dz_ptr + hp_seq, dz_tok, t0, S, sum_tok, H * P, offs_p, p_mask, C)
        else:
            dphi_acc += sum_over_tokens(raw_y * dout_rows, BLOCK_T, BLOCK_R, SUM_R, SUM_PRECISION)

    ranks = tl.arange(0, SUM_R)
    rp_offs = (bh * N_SEGMENTS + seg) * R * P + ranks[:, None] * P + offs_p[None, :]
    rp_mask = (ranks < R)[:, None] & p_mask[None, :]
    tl.store(dphi_ptr + rp_offs, dphi_acc, mask=rp_mask)
    if HAS_Z:
        tl.store(dzeta_ptr + rp_offs, dzeta_acc, mask=rp_mask)


def chunk_scan(*, q, k, v, dout, z, angles, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d,
               da_cs, da_cs_rev, dt, trap, seg_state, states, qk_dot, dz,
               chunk_size, n_segments, chunks_per_segment, block_p, dot_dtype, dot_precision,
               num_warps=4, num_stages=1):
    """Launch the fused scan; fills ``states``, ``qk_dot``, ``dz`` and returns the Phi/Zeta partials.

    Args (contiguous): q, k: [B, S, R, G, N]; v, dout, z: [B, S, H, P] (z may be None);
        angles: [B, S, H, RD]; q_bias, k_bias: [H, R, N] fp32; mimo_v, mimo_o, mimo_z: [H, R, P]
        fp32 (mimo_z may be None); d: [H] fp32 or None; da_cs, da_cs_rev, dt: [B, H, S] fp32;
        trap: [B, H, S]; seg_state: [B, H, n_segments, N, P] fp32 from ``segment_end_states``;
        states: [B, H, nch, N, P]; qk_dot: [B, H, S, R, R]; dz: [B, S, H, P] or None.
    Returns:
        dphi_partial, dzeta_partial: [B, H, n_segments, R, P] fp32 (dzeta None without Z);
        the caller sums over segments.
    """
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    RD = angles.shape[3]
    nch = triton.cdiv(S, chunk_size)
    has_z = z is not None
    dphi = torch.empty((B, H, n_segments, R, P), device=q.device, dtype=torch.float32)
    dzeta = torch.empty_like(dphi) if has_z else None
    meta = chunk_meta(chunk_size, R, N, block_p)
    grid = (triton.cdiv(P, block_p), n_segments, B * H)
    _chunk_scan_kernel[grid](
        q, k, v, dout, z if has_z else dout, angles,
        q_bias, k_bias, mimo_v, mimo_o, mimo_z if has_z else mimo_o, d if d is not None else q_bias,
        da_cs, da_cs_rev, dt, trap, seg_state,
        states, qk_dot, dz if has_z else states, dphi, dzeta if has_z else dphi,
        S, H, G, H // G, nch, chunks_per_segment, n_segments,
        C=chunk_size, R=R, N=N, P=P, RD=RD, **meta,
        BLOCK_SEG_CHUNKS=triton.next_power_of_2(chunks_per_segment), **reduction_meta(chunk_size, R, dot_dtype),
        HAS_Z=has_z, HAS_D=d is not None,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    return dphi, dzeta
