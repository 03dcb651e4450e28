"""Stage 3 of the production path: everything that needs q, dout or z, parallel over chunks.

One program owns one (b, h), a few consecutive chunks and one tile of P
columns; the states entering its chunks come from ``chunk_states``.  Per chunk
and per rank r of the query it rebuilds

    raw_y[t, r, :] = sum_(s, u) (q~[t, r] . k~[s, u]) W[t, s] psiv[s, u, :]    (intra-chunk)
                   + exp(da_cs[t]) q~[t, r] . state_in + D psiv[t, r, :]

with W the causal decay/trapezoid weights, writes ``qk_dot`` from the
same-token columns of the score row, and turns raw_y into the Phi / Zeta / z
gradients.  Looping over the query rank keeps every tile token-major, so the
rank sum of dz is a running sum and the token sums are plain reductions.
"""

import torch
import triton
import triton.language as tl

from . import host_utils
from .host_utils import cdiv, next_power_of_2
from .launch import launch
from .triton_utils import (
    accumulate_rank_grads,
    accumulate_rank_group_grads,
    chunk_rows,
    exp_fp32,
    intra_chunk_weights,
    load_entering_state,
    load_rotated_gather,
    load_rows,
    load_token_weights,
    select_rows_sum,
    span_decay_offsets,
    wait_for_previous_grid,
)


@triton.jit
def _chunk_output_kernel(
    q_ptr, k_ptr, v_ptr, dout_ptr, z_ptr, cos_ptr, sin_ptr,
    q_bias_ptr, k_bias_ptr, psi_ptr, phi_ptr, zeta_ptr, d_ptr,
    da_cs_ptr, da_rev_ptr, gamma_ptr, trap_scale_ptr, states_ptr, seg_entry_ptr, entry_decay_ptr,
    qk_dot_ptr, dz_ptr, dphi_ptr, dzeta_ptr,
    S, H, G, HEADS_PER_GROUP, NCH, CHUNKS_PER_PROGRAM, N_GROUPS, CHUNKS_PER_SEG, N_SEGMENTS,
    C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr, RD: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr, RANKS_PER_STEP: tl.constexpr, SPAN_CHUNKS: tl.constexpr,
    ADD_ENTRY: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_D: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SUM_DTYPE: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, PRECISE_SIGMOID: tl.constexpr, ROTATION_DTYPE: tl.constexpr,
    PRECISE_EXP: tl.constexpr = False,
    GDC: tl.constexpr = False,
):
    wait_for_previous_grid(GDC)
    HALF: tl.constexpr = N // 2
    F: tl.constexpr = RANKS_PER_STEP
    # A program's unit is a span of SPAN_CHUNKS chunks (L tokens) read as one chunk: the outputs do not
    # depend on where the chunks are cut, only ``states`` does, and it enters at the span start.
    L: tl.constexpr = C * SPAN_CHUNKS
    pid_p = tl.program_id(0)
    group = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    g = h // HEADS_PER_GROUP

    # Key side: rows are the span's (token, rank) pairs, row = t_local * R + u.
    row_t, row_u, row_valid = chunk_rows(BLOCK_ROWS, L, R)
    # Query side: F ranks per step, row = t_local * F + local rank (F = 1: rows are tokens).
    q_rows = tl.arange(0, BLOCK_Q)
    q_t = q_rows // F
    q_local = q_rows % F
    q_valid = q_rows < L * F
    tok = tl.arange(0, BLOCK_C)
    offs_half = tl.arange(0, BLOCK_HALF)
    half_mask = offs_half < HALF
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = offs_p < P
    ranks = tl.arange(0, BLOCK_R)

    disc_base = bh * S
    da_cs_seq = da_cs_ptr + disc_base
    qk_token_stride = R * G * N
    q_seq = q_ptr + b * S * qk_token_stride + g * N
    k_seq = k_ptr + b * S * qk_token_stride + g * N
    hp_seq = (b * S * H + h) * P  # [B, S, H, P] activations at (b, 0, h, 0)
    cos_seq = cos_ptr + (b * S * H + h) * RD
    sin_seq = sin_ptr + (b * S * H + h) * RD
    q_bias_head = q_bias_ptr + h * R * N
    k_bias_head = k_bias_ptr + h * R * N
    psi_head = psi_ptr + h * R * P
    psi_rows = load_rows(psi_head, row_u * P, row_valid, offs_p, p_mask)
    qk_dot_seq = qk_dot_ptr + bh * S * R * R
    d_skip = 0.0
    if HAS_D:
        d_skip = tl.load(d_ptr + h).to(tl.float32)

    dphi_acc = tl.zeros((BLOCK_R, BLOCK_P), dtype=tl.float32)
    dzeta_acc = tl.zeros((BLOCK_R, BLOCK_P), dtype=tl.float32)
    for j in range(0, CHUNKS_PER_PROGRAM):
        span = group * CHUNKS_PER_PROGRAM + j
        t0 = span * L
        first_chunk = span * SPAN_CHUNKS
        t_rows = t0 + row_t
        row_mask = row_valid & (t_rows < S)
        t_q = t0 + q_t
        q_tok_mask = q_valid & (t_q < S)  # false for every row of a span past S

        state_lo, state_hi = load_entering_state(
            states_ptr, seg_entry_ptr, entry_decay_ptr, bh, first_chunk, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
            offs_half, half_mask, offs_p, p_mask, N, P, SPAN_CHUNKS, ADD_ENTRY)
        state_lo = state_lo.to(DOT_DTYPE)
        state_hi = state_hi.to(DOT_DTYPE)

        # k~^T straight from memory, [N/2, rows] per half: the B operand of the score product.
        k_lo_t, k_hi_t = load_rotated_gather(k_seq, k_bias_head, cos_seq, sin_seq, t_rows, row_u, row_mask,
                                             qk_token_stride, G * N, H * RD, offs_half, half_mask, N, RD,
                                             DOT_DTYPE, TRANSPOSED=True, MATH_DTYPE=ROTATION_DTYPE)
        da_rows, _, _, ts_rows = load_token_weights(
            da_cs_seq, da_rev_ptr + disc_base, gamma_ptr + disc_base, trap_scale_ptr + disc_base, t_rows, S)
        da_q, _, gamma_q, _ = load_token_weights(
            da_cs_seq, da_rev_ptr + disc_base, gamma_ptr + disc_base, trap_scale_ptr + disc_base, t_q, S)
        if SPAN_CHUNKS > 1:
            da_rows += span_decay_offsets(da_cs_seq, t_rows, t0, S, C, SPAN_CHUNKS)[0]
            da_q += span_decay_offsets(da_cs_seq, t_q, t0, S, C, SPAN_CHUNKS)[0]
        weights = intra_chunk_weights(q_t, row_t, q_tok_mask, row_mask, da_q, da_rows, gamma_q, ts_rows, PRECISE_EXP)
        psiv = (load_rows(v_ptr + hp_seq, t_rows * (H * P), row_mask, offs_p, p_mask) * psi_rows).to(DOT_DTYPE)

        state_scale = exp_fp32(da_q, PRECISE_EXP)

        q_offs = t_q * (H * P)
        dout_q = load_rows(dout_ptr + hp_seq, q_offs, q_tok_mask, offs_p, p_mask)
        z_q = load_rows(z_ptr + hp_seq, q_offs, q_tok_mask & HAS_Z, offs_p, p_mask)
        dz_acc = tl.zeros((BLOCK_Q, BLOCK_P), dtype=tl.float32)
        v_q = load_rows(v_ptr + hp_seq, q_offs, q_tok_mask & HAS_D, offs_p, p_mask)

        for rank_group in range(0, (R + F - 1) // F):
            q_rank = rank_group * F + q_local
            if F == 1:
                q_mask = q_tok_mask
            else:
                q_mask = q_tok_mask & (q_rank < R)
            q_lo, q_hi = load_rotated_gather(q_seq, q_bias_head, cos_seq, sin_seq, t_q, q_rank, q_mask,
                                             qk_token_stride, G * N, H * RD, offs_half, half_mask, N, RD,
                                             DOT_DTYPE, MATH_DTYPE=ROTATION_DTYPE)
            scores = tl.dot(q_lo, k_lo_t, input_precision=DOT_PRECISION)
            scores = tl.dot(q_hi, k_hi_t, scores, input_precision=DOT_PRECISION)
            if pid_p == 0:
                # The same-token columns of the score row are qk_dot[t, r, :] (rotation preserves dots).
                qk_offs = (t_q * R + q_rank)[:, None] * R + row_u[None, :]
                qk_mask = (q_t[:, None] == row_t[None, :]) & q_mask[:, None] & row_mask[None, :]
                tl.store(qk_dot_seq + qk_offs, scores.to(qk_dot_ptr.dtype.element_ty), mask=qk_mask)

            raw_y = tl.dot((scores * weights).to(DOT_DTYPE), psiv, input_precision=DOT_PRECISION)
            y_state = tl.dot(q_lo, state_lo, input_precision=DOT_PRECISION)
            y_state = tl.dot(q_hi, state_hi, y_state, input_precision=DOT_PRECISION)
            raw_y += state_scale[:, None] * y_state
            if F == 1:
                dphi_acc, dzeta_acc, dz_acc = accumulate_rank_grads(
                    raw_y, rank_group, dphi_acc, dzeta_acc, dz_acc, dout_q, z_q, v_q, d_skip, psi_head,
                    phi_ptr + h * R * P, zeta_ptr + h * R * P, ranks, offs_p, p_mask, P, HAS_Z, HAS_D,
                    FAST_SIGMOID, PRECISE_SIGMOID)
            else:
                dphi_acc, dzeta_acc, dz_acc = accumulate_rank_group_grads(
                    raw_y, q_rank, q_local, rank_group, q_mask, dphi_acc, dzeta_acc, dz_acc, dout_q, z_q, v_q,
                    d_skip, psi_head, phi_ptr + h * R * P, zeta_ptr + h * R * P, ranks, offs_p, p_mask, F, P,
                    HAS_Z, HAS_D, FAST_SIGMOID, PRECISE_SIGMOID)

        if HAS_Z:
            t_tok = t0 + tok
            if F == 1:
                dz_tok = dz_acc
            else:  # token t sums its F query rows
                token_of_q = (tok[:, None] == q_t[None, :]) & q_valid[None, :]
                dz_tok = select_rows_sum(token_of_q, dz_acc, SUM_DTYPE)
            dz_offs = t_tok.to(tl.int64)[:, None] * (H * P) + offs_p[None, :]
            tl.store(dz_ptr + hp_seq + dz_offs, dz_tok.to(dz_ptr.dtype.element_ty),
                     mask=((tok < L) & (t_tok < S))[:, None] & p_mask[None, :])

    part_offs = (bh * N_GROUPS + group) * R * P + ranks[:, None] * P + offs_p[None, :]
    part_mask = (ranks < R)[:, None] & p_mask[None, :]
    tl.store(dphi_ptr + part_offs, dphi_acc, mask=part_mask)
    if HAS_Z:
        tl.store(dzeta_ptr + part_offs, dzeta_acc, mask=part_mask)


def output_meta(*, chunk_size, R, N, block_p, ranks_per_step=1, span_chunks=1):
    """Block sizes of the output kernel (every tl.dot dimension >= 16); a program's unit is span_chunks chunks."""
    span = chunk_size * span_chunks
    return dict(BLOCK_C=max(16, next_power_of_2(span)),
                BLOCK_Q=max(16, next_power_of_2(span * ranks_per_step)),
                BLOCK_ROWS=max(16, next_power_of_2(span * R)),
                BLOCK_R=next_power_of_2(R), BLOCK_HALF=max(16, next_power_of_2(N // 2)),
                BLOCK_P=block_p, RANKS_PER_STEP=ranks_per_step, SPAN_CHUNKS=span_chunks)


def sum_dtype(dot_dtype, device):
    """Operand dtype of the dz rank sum with several ranks per step: bf16 (split hi/lo) for half inputs.

    fp32 inputs sum exactly in fp32; the interpreter miscomputes bf16 products, so there half
    inputs split in fp16 (the same code path, narrower range).
    """
    # dot_dtype is fp32 or, for half inputs, fp16 on the CPU (api.dot_operands).
    return tl.bfloat16 if dot_dtype != tl.float32 and device.type == "cuda" else dot_dtype


def chunk_output(*, q, k, v, dout, z, cos_angles, sin_angles, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d,
                 da_cs, da_cs_rev, gamma, trap_scale, states, qk_dot, dz,
                 chunk_size, chunks_per_program, block_p, dot_dtype, dot_precision, num_warps=4,
                 ranks_per_step=1, span_chunks=1, seg_entry=None, entry_decay=None, chunks_per_segment=1,
                 rotation_math_dtype=tl.float32):
    """Fill ``qk_dot`` and ``dz`` and return the Phi/Zeta gradient partials.

    A program's unit is a span of ``span_chunks`` chunks treated as one chunk of span_chunks * C
    tokens (same outputs; it reads the state entering the span's first chunk), and it walks
    ``chunks_per_program`` spans.

    ``ranks_per_step`` query ranks share one query tile (rows = (token, rank) pairs), so a chunk takes
    ceil(R / ranks_per_step) serial steps; 1 is the per-rank loop.

    With ``seg_entry`` and ``entry_decay`` (from ``segment_entry_states``), ``states`` holds segment-local states on
    entry (``chunk_local_states``, segments of ``chunks_per_segment`` chunks) and the full states
    on return.  ``rotation_math_dtype``: the dtype of q's and k's bias add and rotation, tl.float32 or the products'
    half dtype (``host_utils.rotation_math_dtype``).

    Args (contiguous): q, k: [B, S, R, G, N]; v, dout, z: [B, S, H, P] (z may be None);
        cos_angles, sin_angles: [B, S, H, RD] fp32, fp16 or bf16; q_bias, k_bias: [H, R, N] fp32;
        mimo_v, mimo_o, mimo_z: [H, R, P] fp32 (mimo_z may be None); d: [H] fp32 or None;
        da_cs, da_cs_rev, gamma, trap_scale: [B, H, S] fp32 (``token_tables``);
        states: [B, H, nch, N, P] from ``chunk_states`` or ``chunk_local_states``;
        seg_entry: [B, H, n_segments, N, P] fp32 or None; entry_decay: [B, H, nch] fp32 (with seg_entry);
        qk_dot: [B, H, S, R, R]; dz: [B, S, H, P] or None.
    Returns:
        dphi_partial, dzeta_partial: [B, H, n_groups, R, P] fp32 with
        n_groups = cdiv(cdiv(nch, span_chunks), chunks_per_program) (dzeta None without Z); the caller
        sums dim 2.
    """
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    if (seg_entry is None) != (entry_decay is None):
        raise ValueError("chunk_output: seg_entry and entry_decay go together (segment_entry_states)")
    nch = cdiv(S, chunk_size)
    n_groups = cdiv(cdiv(nch, span_chunks), chunks_per_program)
    has_z = z is not None
    dphi = torch.empty((B, H, n_groups, R, P), device=q.device, dtype=torch.float32)
    dzeta = torch.empty_like(dphi) if has_z else None
    launch(_chunk_output_kernel, (cdiv(P, block_p), n_groups, B * H),
        q, k, v, dout, z if has_z else dout, cos_angles, sin_angles,
        q_bias, k_bias, mimo_v, mimo_o, mimo_z if has_z else mimo_o, d if d is not None else q_bias,
        da_cs, da_cs_rev, gamma, trap_scale, states, states if seg_entry is None else seg_entry,
        da_cs if entry_decay is None else entry_decay, qk_dot, dz if has_z else dout, dphi, dzeta if has_z else dphi,
        S, H, G, H // G, nch, chunks_per_program, n_groups, chunks_per_segment,
        1 if seg_entry is None else seg_entry.shape[2],
        C=chunk_size, R=R, N=N, P=P, RD=cos_angles.shape[3],
        **output_meta(chunk_size=chunk_size, R=R, N=N, block_p=block_p, ranks_per_step=ranks_per_step,
                      span_chunks=span_chunks),
        ADD_ENTRY=seg_entry is not None,
        HAS_Z=has_z, HAS_D=d is not None, DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        SUM_DTYPE=sum_dtype(dot_dtype, q.device), **host_utils.sigmoid_units(q),
        ROTATION_DTYPE=rotation_math_dtype, PRECISE_EXP=host_utils.precise_exp(dot_dtype, q), num_warps=num_warps,
        num_stages=1,
    )
    return dphi, dzeta

