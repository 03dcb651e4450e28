"""Stage 3 of the split output path: the pre-gate output ``raw_y`` of every chunk, all ranks at once.

One program owns one (b, h), one span of chunks and one tile of P columns.  The span's
(token, rank) pairs are the rows of every tile, ``row = t_local * BLOCK_R + r`` (BLOCK_R =
next_pow2(R); padding ranks are masked), on the query side and on the key side alike, so the whole
chunk is three wide products instead of a loop over query ranks:

    scores = q~ k~^T                                    [rows, rows]; same-token blocks are qk_dot
    raw_y  = (scores * W) psiv + exp(da_cs) (q~ state_in) + D psiv          [rows, P tile]

with W the causal decay / trapezoid weights of SPEC section 3.  q~ and k~ rows share their token's
cos / sin tiles.  ``raw_y`` goes to a scratch tensor [B, H, S, R, P] that ``gate_grads`` reads: the
gate's per-token loads, rank sums and token sums stay out of this kernel, which keeps it to the
products and their operands (the fused ``chunk_output`` keeps them in and loops over the ranks).
"""

import torch
import triton
import triton.language as tl

from . import host_utils
from .host_utils import cdiv, next_power_of_2
from .launch import launch
from .triton_utils import (
    bias_add_in_half,
    exp_fp32,
    fp16_row_scaled,
    intra_chunk_weights,
    load_entering_state,
    load_rows,
    load_token_weights,
    rotate_half,
    silu_and_grad,
    span_decay_offsets,
    store_entering_state,
    table_cos_sin,
    wait_for_previous_grid,
)


@triton.jit
def _rotated_tiles(x_ptr, bias_ptr, x_offs, bias_offs, mask3, bias_mask, cos, sin, HALF: tl.constexpr,
                   MATH_DTYPE: tl.constexpr):
    """Biased, rotated q or k as [tokens, ranks, half] halves in MATH_DTYPE (x at ``x_offs``, its low half; the
    bias [ranks, half] at ``bias_offs``).  Padding rows are zeroed (not needed for the result, but it took
    registers 255 -> 191 on N128_P64_R1_C64)."""
    # Each branch has its own loads: the fp32 one keeps the order (load, convert, add) of the GPU-tested code, whose
    # PTX a shared load ahead of the branch changed.
    if MATH_DTYPE == tl.float32:
        x_lo = tl.load(x_ptr + x_offs, mask=mask3, other=0.0).to(tl.float32) + \
            tl.load(bias_ptr + bias_offs, mask=bias_mask, other=0.0)[None, :, :]
        x_hi = tl.load(x_ptr + x_offs + HALF, mask=mask3, other=0.0).to(tl.float32) + \
            tl.load(bias_ptr + bias_offs + HALF, mask=bias_mask, other=0.0)[None, :, :]
        x_lo = tl.where(mask3, x_lo, 0.0)
        x_hi = tl.where(mask3, x_hi, 0.0)
    else:
        # The bias is not masked by token: padding rows take it, and the mask factor zeroes them.
        x_lo, x_hi = bias_add_in_half(
            tl.load(x_ptr + x_offs, mask=mask3, other=0.0), tl.load(x_ptr + x_offs + HALF, mask=mask3, other=0.0),
            tl.load(bias_ptr + bias_offs, mask=bias_mask, other=0.0)[None, :, :],
            tl.load(bias_ptr + bias_offs + HALF, mask=bias_mask, other=0.0)[None, :, :], mask3, MATH_DTYPE)
    return rotate_half(x_lo, x_hi, cos, sin)


@triton.jit
def _store_qk_dot(qk_dot_ptr, scores, bh, S, R, t_rows, row_t, row_r, row_mask):
    """qk_dot [B, H, S, R, R] of a span's rows: the same-token blocks of its score matrix (the rotation preserves
    those dots)."""
    qk_offs = (t_rows * R + row_r)[:, None] * R + row_r[None, :]
    qk_mask = (row_t[:, None] == row_t[None, :]) & row_mask[:, None] & row_mask[None, :]
    tl.store(qk_dot_ptr + bh * S * R * R + qk_offs, scores.to(qk_dot_ptr.dtype.element_ty), mask=qk_mask)


@triton.jit
def _weighed_scores(scores, weights, TOKEN_WEIGHTS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
    """The mixing matrix scores * W [rows, rows]: ``weights`` a weight a score [rows, rows], or with TOKEN_WEIGHTS a
    weight a (row, column token) [rows, tokens], broadcast over the column ranks of the scores viewed as [rows,
    tokens, ranks]."""
    ROWS: tl.constexpr = BLOCK_L * BLOCK_R
    if TOKEN_WEIGHTS:
        mixing = tl.reshape(tl.reshape(scores, (ROWS, BLOCK_L, BLOCK_R)) * weights[:, :, None], (ROWS, ROWS))
    else:
        mixing = scores * weights
    return mixing


@triton.jit
def _span_raw_y(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_bias_ptr, k_bias_ptr, psi_ptr, d_ptr,
    da_cs_ptr, da_rev_ptr, gamma_ptr, trap_scale_ptr, states_ptr, seg_entry_ptr, entry_decay_ptr, qk_dot_ptr,
    S, H, G, HEADS_PER_GROUP, NCH, CHUNKS_PER_SEG, N_SEGMENTS, pid_p, span, bh,
    C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr, RD: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr,
    SPAN_CHUNKS: tl.constexpr, ADD_ENTRY: tl.constexpr, HAS_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_CAST_EARLY: tl.constexpr, Y_STATE_EARLY: tl.constexpr,
    ROTATION_DTYPE: tl.constexpr, PRECISE_EXP: tl.constexpr, GDC: tl.constexpr, DEFER_STATE_STORE: tl.constexpr,
    DEFER_QK_DOT: tl.constexpr, FROM_ANGLES: tl.constexpr, TABLE_DTYPE: tl.constexpr, FAST_TRIG: tl.constexpr,
    TOKEN_WEIGHTS: tl.constexpr = False, EARLY_MIXING: tl.constexpr = False,
):
    """raw_y [ROWS, BLOCK_P] fp32 of one span and P tile, rows (token, rank); P tile 0 also stores qk_dot.

    Returns raw_y and its rows' tokens (t_rows), ranks (row_r) and mask, the tile's columns and their mask.
    Q_CAST_EARLY narrows q~ to the dot dtype before k is loaded, Y_STATE_EARLY forms q~ @ state right after the
    scores: the same arithmetic in another order, for fewer live registers (ScanConfig.out_q_cast_early,
    out_y_state_early).  ROTATION_DTYPE: the dtype of q's and k's bias add and rotation (``rotation_math_dtype``).
    GDC (programmatic dependent launch): the rotation tables are asked for before the wait for the previous kernel,
    the states after it.  DEFER_STATE_STORE writes the span's full entering state (with ADD_ENTRY) after q~ @ state,
    not right after its loads, and DEFER_QK_DOT qk_dot after the products, not right after the scores: a store keeps
    every later load from being issued until its data has arrived (the compiler does not move a load above a store
    that may alias it; ScanConfig.out_defer_state_store, out_defer_qk_dot).  FROM_ANGLES: ``cos_ptr`` holds the
    fp32 angles, whose cos / sin are the tables' TABLE_DTYPE values computed here (``table_cos_sin``).
    """
    HALF: tl.constexpr = N // 2
    # A span of SPAN_CHUNKS chunks (L tokens) is read as one chunk: raw_y does not depend on where
    # chunks are cut; the state read is the one entering the span.
    L: tl.constexpr = C * SPAN_CHUNKS
    b = bh // H
    h = bh % H
    g = h // HEADS_PER_GROUP

    # Rows are (token, rank) pairs of the span, row = t_local * BLOCK_R + r: tiles are built as
    # [BLOCK_L, BLOCK_R, cols] (per-token and per-rank factors load once and broadcast) and reshaped.
    ROWS: tl.constexpr = BLOCK_L * BLOCK_R
    tok = tl.arange(0, BLOCK_L)
    rank = tl.arange(0, BLOCK_R)
    offs_half = tl.arange(0, BLOCK_HALF)
    half_mask = offs_half < HALF
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = offs_p < P
    t0 = span * L
    first_chunk = span * SPAN_CHUNKS
    t_tok = t0 + tok
    tok_mask = (tok < L) & (t_tok < S)
    rank_mask = rank < R
    rows = tl.arange(0, ROWS)
    row_t = rows // BLOCK_R
    row_r = rows % BLOCK_R
    t_rows = t0 + row_t
    row_mask = (row_t < L) & (t_rows < S) & (row_r < R)

    disc_base = bh * S
    da_cs_seq = da_cs_ptr + disc_base
    qk_token_stride = R * G * N
    qk_seq_offs = b * S * qk_token_stride + g * N
    hp_seq = (b * S * H + h) * P  # [B, S, H, P] activations at (b, 0, h, 0)
    angle_seq = (b * S * H + h) * RD

    if not GDC:
        state_lo, state_hi = load_entering_state(
            states_ptr, seg_entry_ptr, entry_decay_ptr, bh, first_chunk, NCH, CHUNKS_PER_SEG, N_SEGMENTS, offs_half,
            half_mask, offs_p, p_mask, N, P, SPAN_CHUNKS, ADD_ENTRY, DEFER_STATE_STORE and ADD_ENTRY)

    # q~ and k~: both rotate by their token's angles, each row adds its rank's bias; in ROTATION_DTYPE (fp32, or the
    # products' half dtype: two elements a register).
    angle_offs = t_tok[:, None] * (H * RD) + offs_half[None, :]
    rotated = tok_mask[:, None] & (offs_half < RD)[None, :]
    if FROM_ANGLES:
        cos, sin = table_cos_sin(tl.load(cos_ptr + angle_seq + angle_offs, mask=rotated, other=0.0), TABLE_DTYPE,
                                 FAST_TRIG)
        cos = tl.where(rotated, cos, 1.0).to(ROTATION_DTYPE)[:, None, :]
        sin = tl.where(rotated, sin, 0.0).to(ROTATION_DTYPE)[:, None, :]
    else:
        cos = tl.load(cos_ptr + angle_seq + angle_offs, mask=rotated, other=1.0).to(ROTATION_DTYPE)[:, None, :]
        sin = tl.load(sin_ptr + angle_seq + angle_offs, mask=rotated, other=0.0).to(ROTATION_DTYPE)[:, None, :]
    if GDC:
        # The cos / sin tables are token_tables', written two or more launches back (done before this program could
        # start: each kernel lets the next one start only after its own wait), so their loads are issued before the
        # wait.  The states, and with local states the segment entries that the launch just before writes, come after
        # it.  Later placements (after q~, after the scores) spill 100-240 B more at N = 128 under the 128 cap.
        wait_for_previous_grid(GDC)
        state_lo, state_hi = load_entering_state(
            states_ptr, seg_entry_ptr, entry_decay_ptr, bh, first_chunk, NCH, CHUNKS_PER_SEG, N_SEGMENTS, offs_half,
            half_mask, offs_p, p_mask, N, P, SPAN_CHUNKS, ADD_ENTRY, DEFER_STATE_STORE and ADD_ENTRY)
    mask3 = tok_mask[:, None, None] & rank_mask[None, :, None] & half_mask[None, None, :]
    x_offs = qk_seq_offs + (t_tok[:, None, None] * qk_token_stride + rank[None, :, None] * (G * N)
                            + offs_half[None, None, :])
    bias_offs = h * R * N + rank[:, None] * N + offs_half[None, :]
    bias_mask = rank_mask[:, None] & half_mask[None, :]
    q_lo, q_hi = _rotated_tiles(q_ptr, q_bias_ptr, x_offs, bias_offs, mask3, bias_mask, cos, sin, HALF,
                                ROTATION_DTYPE)
    if Q_CAST_EARLY:
        # q~'s fp32 [tokens, ranks, half] tiles die here, not after k's loads and rotation; the reshape has to come
        # with the cast (N128_P64_R4_C16: 180 -> 139 registers uncapped; the cast alone moved nothing).
        q_lo = tl.reshape(q_lo.to(DOT_DTYPE), (ROWS, BLOCK_HALF))
        q_hi = tl.reshape(q_hi.to(DOT_DTYPE), (ROWS, BLOCK_HALF))
    k_lo, k_hi = _rotated_tiles(k_ptr, k_bias_ptr, x_offs, bias_offs, mask3, bias_mask, cos, sin, HALF,
                                ROTATION_DTYPE)
    if not Q_CAST_EARLY:
        q_lo = tl.reshape(q_lo.to(DOT_DTYPE), (ROWS, BLOCK_HALF))
        q_hi = tl.reshape(q_hi.to(DOT_DTYPE), (ROWS, BLOCK_HALF))
    k_lo = tl.reshape(k_lo.to(DOT_DTYPE), (ROWS, BLOCK_HALF))
    k_hi = tl.reshape(k_hi.to(DOT_DTYPE), (ROWS, BLOCK_HALF))
    scores = tl.dot(q_lo, tl.trans(k_lo), input_precision=DOT_PRECISION)
    scores = tl.dot(q_hi, tl.trans(k_hi), scores, input_precision=DOT_PRECISION)
    if Y_STATE_EARLY:
        # q~'s operands die before the causal weights; the [rows, cols] accumulator lives instead.
        y_state = tl.dot(q_lo, state_lo.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        y_state = tl.dot(q_hi, state_hi.to(DOT_DTYPE), y_state, input_precision=DOT_PRECISION)
        if DEFER_STATE_STORE and ADD_ENTRY:
            store_entering_state(states_ptr, state_lo, state_hi, bh, first_chunk, NCH, CHUNKS_PER_SEG, offs_half,
                                 half_mask, offs_p, p_mask, N, P)
    if pid_p == 0 and not DEFER_QK_DOT:
        _store_qk_dot(qk_dot_ptr, scores, bh, S, R, t_rows, row_t, row_r, row_mask)

    da_rows, _, gamma_rows, ts_rows = load_token_weights(
        da_cs_seq, da_rev_ptr + disc_base, gamma_ptr + disc_base, trap_scale_ptr + disc_base, t_rows, S)
    if SPAN_CHUNKS > 1:
        da_rows += span_decay_offsets(da_cs_seq, t_rows, t0, S, C, SPAN_CHUNKS)[0]
    if TOKEN_WEIGHTS:
        # A weight depends on the row's token and the column's token only: the [rows, rows] tile holds R x R
        # copies of one [tokens, tokens] block.  Weigh the scores viewed as [rows, column tokens, column ranks]
        # with [rows, column tokens] weights: the masks, selects and differences once a token, not once a score
        # (the compiler already merges a thread's equal exps; section 59).
        col_da, _, _, col_ts = load_token_weights(
            da_cs_seq, da_rev_ptr + disc_base, gamma_ptr + disc_base, trap_scale_ptr + disc_base, t_tok, S)
        if SPAN_CHUNKS > 1:
            col_da += span_decay_offsets(da_cs_seq, t_tok, t0, S, C, SPAN_CHUNKS)[0]
        weights = intra_chunk_weights(row_t, tok, row_mask, tok_mask, da_rows, col_da, gamma_rows, col_ts,
                                      PRECISE_EXP)  # [rows, tokens]
    else:
        weights = intra_chunk_weights(row_t, row_t, row_mask, row_mask, da_rows, da_rows, gamma_rows, ts_rows,
                                      PRECISE_EXP)
    if EARLY_MIXING:
        # The scores weighed before v and Psi are loaded: the schedule that spills less at R1_C64 without Z.
        mixing = _weighed_scores(scores, weights, TOKEN_WEIGHTS, BLOCK_L, BLOCK_R)
    v_tok = load_rows(v_ptr + hp_seq, t_tok * (H * P), tok_mask, offs_p, p_mask)
    psi = load_rows(psi_ptr + h * R * P, rank * P, rank_mask, offs_p, p_mask)
    psiv = tl.reshape(v_tok[:, None, :] * psi[None, :, :], (ROWS, BLOCK_P))

    if not EARLY_MIXING:
        mixing = _weighed_scores(scores, weights, TOKEN_WEIGHTS, BLOCK_L, BLOCK_R)
    raw_y = tl.dot(mixing.to(DOT_DTYPE), psiv.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    if pid_p == 0 and DEFER_QK_DOT:
        _store_qk_dot(qk_dot_ptr, scores, bh, S, R, t_rows, row_t, row_r, row_mask)
    if not Y_STATE_EARLY:
        y_state = tl.dot(q_lo, state_lo.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        y_state = tl.dot(q_hi, state_hi.to(DOT_DTYPE), y_state, input_precision=DOT_PRECISION)
        if DEFER_STATE_STORE and ADD_ENTRY:
            store_entering_state(states_ptr, state_lo, state_hi, bh, first_chunk, NCH, CHUNKS_PER_SEG, offs_half,
                                 half_mask, offs_p, p_mask, N, P)
    raw_y += exp_fp32(da_rows, PRECISE_EXP)[:, None] * y_state
    if HAS_D:
        # The D skip in fp32, from v and Psi read again (volatile: not merged with the loads above, whose fp32
        # psiv would stay live across the products).  Folded into the mixing matrix's diagonal it was rounded
        # to the operand dtype with psiv, and where D psiv is most of raw_y that made dPhi's error 2-5x the
        # fused stage's (the GPU pairwise grid's dual benchmark failed on some seeds).
        v_again = load_rows(v_ptr + hp_seq, t_tok * (H * P), tok_mask, offs_p, p_mask, VOLATILE=True)
        psi_again = load_rows(psi_ptr + h * R * P, rank * P, rank_mask, offs_p, p_mask, VOLATILE=True)
        raw_y += tl.load(d_ptr + h).to(tl.float32) * tl.reshape(v_again[:, None, :] * psi_again[None, :, :],
                                                                (ROWS, BLOCK_P))
    return raw_y, t_rows, row_r, row_mask, offs_p, p_mask


@triton.jit
def _chunk_scan_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_bias_ptr, k_bias_ptr, psi_ptr, d_ptr,
    da_cs_ptr, da_rev_ptr, gamma_ptr, trap_scale_ptr, states_ptr, seg_entry_ptr, entry_decay_ptr, qk_dot_ptr,
    raw_y_ptr, raw_y_scale_ptr, S, H, G, HEADS_PER_GROUP, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
    C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr, RD: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr,
    SPAN_CHUNKS: tl.constexpr, ADD_ENTRY: tl.constexpr, HAS_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPANS_PER_PROGRAM: tl.constexpr,
    Q_CAST_EARLY: tl.constexpr, Y_STATE_EARLY: tl.constexpr, ROTATION_DTYPE: tl.constexpr,
    SCALED_RAW_Y: tl.constexpr, PRECISE_EXP: tl.constexpr = False, DEFER_STATE_STORE: tl.constexpr = False,
    DEFER_QK_DOT: tl.constexpr = False,
    GDC: tl.constexpr = False, FROM_ANGLES: tl.constexpr = False, TABLE_DTYPE: tl.constexpr = tl.float32,
    FAST_TRIG: tl.constexpr = False, TOKEN_WEIGHTS: tl.constexpr = False, EARLY_MIXING: tl.constexpr = False,
):
    pid_p = tl.program_id(0)
    first_span = tl.program_id(1) * SPANS_PER_PROGRAM
    bh = tl.program_id(2).to(tl.int64)
    # A program takes SPANS_PER_PROGRAM spans one after the other (unrolled: the next span's loads can
    # overlap this one's products); spans past the sequence are fully masked.
    for step in tl.static_range(SPANS_PER_PROGRAM):
        raw_y, t_rows, row_r, row_mask, offs_p, p_mask = _span_raw_y(
            q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_bias_ptr, k_bias_ptr, psi_ptr, d_ptr,
            da_cs_ptr, da_rev_ptr, gamma_ptr, trap_scale_ptr, states_ptr, seg_entry_ptr, entry_decay_ptr, qk_dot_ptr,
            S, H, G, HEADS_PER_GROUP, NCH, CHUNKS_PER_SEG, N_SEGMENTS, pid_p, first_span + step, bh,
            C, R, N, P, RD, BLOCK_L, BLOCK_R, BLOCK_HALF, BLOCK_P, SPAN_CHUNKS, ADD_ENTRY, HAS_D,
            DOT_DTYPE, DOT_PRECISION, Q_CAST_EARLY, Y_STATE_EARLY, ROTATION_DTYPE, PRECISE_EXP, GDC,
            DEFER_STATE_STORE, DEFER_QK_DOT, FROM_ANGLES, TABLE_DTYPE, FAST_TRIG, TOKEN_WEIGHTS, EARLY_MIXING)
        # raw_y [B, H, S, R, P]: row (t, r) of the span is row t * R + r of the (b, h) sequence.
        seq_rows = bh * S * R + t_rows * R + row_r
        if SCALED_RAW_Y:
            # fp16 with a power of two per row and P tile (raw_y_scale [B, H, S, R, P tiles] holds its inverse):
            # half the bytes of fp32 each way, at 2^-12 relative where bf16 (2^-9) failed dz's dual benchmark.
            raw_y, row_unscale = fp16_row_scaled(raw_y)
        y_offs = seq_rows[:, None] * P + offs_p[None, :]
        tl.store(raw_y_ptr + y_offs, raw_y.to(raw_y_ptr.dtype.element_ty), mask=row_mask[:, None] & p_mask[None, :])
        if SCALED_RAW_Y:
            tl.store(raw_y_scale_ptr + seq_rows * tl.num_programs(0) + pid_p, row_unscale, mask=row_mask)



@triton.jit
def _chunk_scan_gate_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_bias_ptr, k_bias_ptr, psi_ptr, d_ptr,
    da_cs_ptr, da_rev_ptr, gamma_ptr, trap_scale_ptr, states_ptr, seg_entry_ptr, entry_decay_ptr, qk_dot_ptr,
    dout_ptr, z_ptr, phi_ptr, zeta_ptr, dz_ptr, dphi_ptr, dzeta_ptr,
    S, H, G, HEADS_PER_GROUP, NCH, CHUNKS_PER_SEG, N_SEGMENTS, N_SPANS,
    C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr, RD: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr,
    SPAN_CHUNKS: tl.constexpr, ADD_ENTRY: tl.constexpr, HAS_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPANS_PER_PROGRAM: tl.constexpr,
    Q_CAST_EARLY: tl.constexpr, Y_STATE_EARLY: tl.constexpr, ROTATION_DTYPE: tl.constexpr,
    HAS_Z: tl.constexpr, FAST_SIGMOID: tl.constexpr, PRECISE_SIGMOID: tl.constexpr, D_AT_GATE: tl.constexpr,
    PRECISE_EXP: tl.constexpr = False, DEFER_STATE_STORE: tl.constexpr = False,
    DEFER_QK_DOT: tl.constexpr = False,
    GDC: tl.constexpr = False, FROM_ANGLES: tl.constexpr = False, TABLE_DTYPE: tl.constexpr = tl.float32,
    FAST_TRIG: tl.constexpr = False, TOKEN_WEIGHTS: tl.constexpr = False, EARLY_MIXING: tl.constexpr = False,
):
    """_chunk_scan_kernel with the gate applied to raw_y in registers instead of storing it: dz of the span's
    tokens and the span's partial sums of dPhi / dZeta ([R, P tile] each, summed later by sum_group_partials).

    D_AT_GATE (with HAS_D): the D skip joins the gate's fp32 [tokens, ranks, cols] math from v and Psi, instead of
    _span_raw_y's volatile reload after its products."""
    pid_p = tl.program_id(0)
    first_span = tl.program_id(1) * SPANS_PER_PROGRAM
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    L: tl.constexpr = C * SPAN_CHUNKS
    tok = tl.arange(0, BLOCK_L)
    rank = tl.arange(0, BLOCK_R)
    rank_mask = rank < R
    hp_seq = (b * S * H + h) * P  # [B, S, H, P] activations at (b, 0, h, 0)
    for step in tl.static_range(SPANS_PER_PROGRAM):
        span = first_span + step
        raw_y, _, _, _, offs_p, p_mask = _span_raw_y(
            q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_bias_ptr, k_bias_ptr, psi_ptr, d_ptr,
            da_cs_ptr, da_rev_ptr, gamma_ptr, trap_scale_ptr, states_ptr, seg_entry_ptr, entry_decay_ptr, qk_dot_ptr,
            S, H, G, HEADS_PER_GROUP, NCH, CHUNKS_PER_SEG, N_SEGMENTS, pid_p, span, bh,
            C, R, N, P, RD, BLOCK_L, BLOCK_R, BLOCK_HALF, BLOCK_P, SPAN_CHUNKS, ADD_ENTRY, HAS_D and not D_AT_GATE,
            DOT_DTYPE, DOT_PRECISION, Q_CAST_EARLY, Y_STATE_EARLY, ROTATION_DTYPE, PRECISE_EXP, GDC,
            DEFER_STATE_STORE, DEFER_QK_DOT, FROM_ANGLES, TABLE_DTYPE, FAST_TRIG, TOKEN_WEIGHTS, EARLY_MIXING)
        # [tokens, ranks, cols]: the rank sum of dz and the token sums of dPhi / dZeta are axis sums.
        t_tok = span * L + tok
        tok_mask = (tok < L) & (t_tok < S)
        y = tl.reshape(raw_y, (BLOCK_L, BLOCK_R, BLOCK_P))
        if HAS_D and D_AT_GATE:
            d_psi = tl.load(d_ptr + h).to(tl.float32) * load_rows(psi_ptr + h * R * P, rank * P, rank_mask, offs_p,
                                                                  p_mask)
            y += d_psi[None, :, :] * load_rows(v_ptr + hp_seq, t_tok * (H * P), tok_mask, offs_p, p_mask)[:, None, :]
        y_dout = y * load_rows(dout_ptr + hp_seq, t_tok * (H * P), tok_mask, offs_p, p_mask)[:, None, :]
        phi = load_rows(phi_ptr + h * R * P, rank * P, rank_mask, offs_p, p_mask)
        if HAS_Z:
            z = load_rows(z_ptr + hp_seq, t_tok * (H * P), tok_mask, offs_p, p_mask)[:, None, :]
            zeta = load_rows(zeta_ptr + h * R * P, rank * P, rank_mask, offs_p, p_mask)
            gate, dgate = silu_and_grad(z * zeta[None, :, :], FAST_SIGMOID, PRECISE_SIGMOID)
            du_over_phi = y_dout * dgate  # dL/du without its Phi factor
            dphi = tl.sum(gate * y_dout, axis=0)
            dzeta = phi * tl.sum(du_over_phi * z, axis=0)
            dz = tl.sum(du_over_phi * (phi * zeta)[None, :, :], axis=1)
            dz_offs = hp_seq + t_tok[:, None] * (H * P) + offs_p[None, :]
            tl.store(dz_ptr + dz_offs, dz.to(dz_ptr.dtype.element_ty), mask=tok_mask[:, None] & p_mask[None, :])
        else:
            dphi = tl.sum(y_dout, axis=0)
        # Spans past the sequence (the last program's, SPANS_PER_PROGRAM > 1) have no partial row.
        part = ((bh * N_SPANS + span) * R + rank[:, None]) * P + offs_p[None, :]
        part_mask = rank_mask[:, None] & p_mask[None, :] & (span < N_SPANS)
        tl.store(dphi_ptr + part, dphi, mask=part_mask)
        if HAS_Z:
            tl.store(dzeta_ptr + part, dzeta, mask=part_mask)


def chunk_scan_meta(*, chunk_size, R, N, block_p, span_chunks=1):
    """Block sizes of the chunk scan: rows = a span's (token, rank) pairs, every tl.dot dimension >= 16."""
    block_r = next_power_of_2(R)
    return dict(BLOCK_L=max(next_power_of_2(chunk_size * span_chunks), 16 // min(block_r, 16)), BLOCK_R=block_r,
                BLOCK_HALF=max(16, next_power_of_2(N // 2)), BLOCK_P=block_p, SPAN_CHUNKS=span_chunks)


def refuse_miscompiled_tile(meta, *, block_p, N, R, dot_dtype):
    """Raise on the P tiles that Triton 3.6 compiles wrong for the GPU (the interpreter computes them right)."""
    # Seen on the H200 (sanitizer driver case production-split-p32): wrong values at small sizes, an illegal address
    # at full size.
    if meta["BLOCK_HALF"] >= 64 and block_p < 64:
        raise ValueError(f"chunk_scan: a P tile of {block_p} with N/2 = {N // 2} miscompiles on this Triton; "
                         "use block_p >= 64")
    # Seen on the H100 (section 45): 16-bit products, N = 64, R = 4 and a 16-wide tile gave wrong values or an illegal
    # address on some inputs and not on others.
    if meta["BLOCK_HALF"] >= 32 and meta["BLOCK_R"] >= 4 and block_p < 32 and dot_dtype != tl.float32:
        raise ValueError(f"chunk_scan: a P tile of {block_p} with N/2 = {N // 2} and R = {R} miscompiles on this "
                         "Triton; use block_p >= 32")


def chunk_scan(*, q, k, v, cos_angles, sin_angles, q_bias, k_bias, mimo_v, d, da_cs, da_cs_rev, gamma, trap_scale,
               states, qk_dot, chunk_size, block_p, dot_dtype, dot_precision, raw_y=None, raw_y_scale=None,
               dout=None, z=None, mimo_o=None, mimo_z=None, dz=None, num_warps=4, span_chunks=1, seg_entry=None,
               entry_decay=None, chunks_per_segment=1, max_registers=0, spans_per_program=1, d_in_gate=False,
               q_cast_early=False, y_state_early=False, rotation_math_dtype=tl.float32, defer_state_store=False,
               defer_qk_dot=False, angles=None, table_dtype=None, token_weights=False, early_mixing=False):
    """Fill ``raw_y`` and ``qk_dot``, or with ``dout``, apply the gate in place of storing raw_y: fill ``dz``
    and ``qk_dot`` and return the per-span partials of dPhi / dZeta; with ``seg_entry``, finish ``states`` too.

    A program takes ``spans_per_program`` spans, each of ``span_chunks`` chunks read as one chunk of
    span_chunks * C tokens, and one P tile of ``block_p`` columns.  With ``seg_entry`` and ``entry_decay`` (from
    ``segment_entry_states``), ``states`` holds segment-local states on entry (``chunk_local_states``, segments of
    ``chunks_per_segment`` chunks) and the full states on return.  ``max_registers`` caps the
    registers per thread (0: the compiler's choice).  ``d_in_gate`` (with ``dout`` and ``d``) adds the D skip
    in the gate's fp32 math rather than after the products.  ``q_cast_early`` and ``y_state_early`` reorder the
    products for fewer live registers (same arithmetic; see ``ScanConfig``).  ``rotation_math_dtype``: the dtype of
    q's and k's bias add and rotation, tl.float32 or the products' half dtype (``host_utils.rotation_math_dtype``).
    ``defer_state_store`` writes each span's full state (with ``seg_entry``) after q~ @ state instead of right after
    its loads, ``defer_qk_dot`` qk_dot after the products instead of right after the scores
    (``ScanConfig.out_defer_state_store``, ``out_defer_qk_dot``).  ``token_weights`` computes the intra-chunk weights
    once a (row, column token) instead of once a score (``ScanConfig.out_token_weights``); ``early_mixing`` weighs the
    scores before v and Psi are loaded, not after (``ScanConfig.out_early_mixing``).  With ``angles`` (and no
    cos / sin tables) the kernel computes the cos / sin that ``token_tables`` would have stored as ``table_dtype``
    (16-bit) from the angles (``ScanConfig.angles_in_kernels``): the same values, without the tables' write and read.

    Args (contiguous): q, k: [B, S, R, G, N]; v: [B, S, H, P]; cos_angles, sin_angles: [B, S, H, RD]
        fp32, fp16 or bf16, or None with angles: [B, S, H, RD] fp32; q_bias, k_bias: [H, R, N] fp32;
        mimo_v: [H, R, P] fp32; d: [H] fp32 or None;
        da_cs, da_cs_rev, gamma, trap_scale: [B, H, S] fp32 (``token_tables``); states: [B, H, nch, N, P];
        seg_entry: [B, H, n_segments, N, P] fp32 or None; entry_decay: [B, H, nch] fp32 (with seg_entry);
        qk_dot: [B, H, S, R, R];
        raw_y: [B, H, S, R, P] fp32 or fp16 (written: the pre-gate output including the D skip), None with
            ``dout``; fp16 rows are scaled by a power of two per (row, P tile) that puts their largest magnitude
            in [2^14, 2^15), and raw_y_scale: [B, H, S, R, cdiv(P, block_p)] fp32 (with fp16 raw_y only) gets
            the inverse, so that raw_y = fp16 value * raw_y_scale;
        dout, z: [B, S, H, P] (z may be None); mimo_o, mimo_z: [H, R, P] fp32 (mimo_z None without z);
        dz: [B, S, H, P] or None (without z).
    Returns:
        None; with ``dout``: dphi_partial, dzeta_partial: [B, H, n_spans, R, P] fp32 (dzeta_partial None
        without z), to be summed over dim 2 by ``sum_group_partials``.
    """
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    if (seg_entry is None) != (entry_decay is None):
        raise ValueError("chunk_scan: seg_entry and entry_decay go together (segment_entry_states)")
    if (raw_y is None) == (dout is None):
        raise ValueError("chunk_scan: pass raw_y (the scratch to fill) or dout (apply the gate), not both")
    if d_in_gate and dout is None:
        raise ValueError("chunk_scan: d_in_gate applies with dout (the gate in chunk_scan); to leave D out of a "
                         "stored raw_y, pass d=None")
    trig = host_utils.rotation_source("chunk_scan", q, cos_angles, sin_angles, angles, table_dtype)
    scaled = raw_y is not None and host_utils.check_raw_y_scratch("chunk_scan", raw_y, raw_y_scale, block_p)
    meta = chunk_scan_meta(chunk_size=chunk_size, R=R, N=N, block_p=block_p, span_chunks=span_chunks)
    if host_utils.compiled_for_gpu(q):
        refuse_miscompiled_tile(meta, block_p=block_p, N=N, R=R, dot_dtype=dot_dtype)
    nch = cdiv(S, chunk_size)
    n_spans = cdiv(nch, span_chunks)
    grid = (cdiv(P, block_p), cdiv(n_spans, spans_per_program), B * H)
    inputs = (q, k, v, trig["cos_angles"], trig["sin_angles"], q_bias, k_bias, mimo_v, d if d is not None else q_bias,
              da_cs, da_cs_rev, gamma, trap_scale, states, states if seg_entry is None else seg_entry,
              da_cs if entry_decay is None else entry_decay, qk_dot)
    sizes = (S, H, G, H // G, nch, chunks_per_segment, 1 if seg_entry is None else seg_entry.shape[2])
    constants = dict(
        C=chunk_size, R=R, N=N, P=P, RD=trig["RD"], **meta, ADD_ENTRY=seg_entry is not None,
        HAS_D=d is not None, DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision, SPANS_PER_PROGRAM=spans_per_program,
        Q_CAST_EARLY=q_cast_early, Y_STATE_EARLY=y_state_early, ROTATION_DTYPE=rotation_math_dtype,
        PRECISE_EXP=host_utils.precise_exp(dot_dtype, q),
        DEFER_STATE_STORE=defer_state_store, DEFER_QK_DOT=defer_qk_dot,
        **({'TOKEN_WEIGHTS': True} if token_weights else {}),
        **({'EARLY_MIXING': True} if early_mixing else {}),
        **({key: trig[key] for key in ("FROM_ANGLES", "TABLE_DTYPE", "FAST_TRIG")} if trig["FROM_ANGLES"] else {}),
        num_warps=num_warps, num_stages=1, **({'maxnreg': max_registers} if max_registers else {}))
    if raw_y is not None:
        launch(_chunk_scan_kernel, grid, *inputs, raw_y, raw_y_scale if scaled else raw_y, *sizes, **constants,
               SCALED_RAW_Y=scaled)
        return None
    has_z = z is not None
    dphi = torch.empty((B, H, n_spans, R, P), device=q.device, dtype=torch.float32)
    dzeta = torch.empty_like(dphi) if has_z else None
    launch(_chunk_scan_gate_kernel, grid, *inputs, dout, z if has_z else dout, mimo_o, mimo_z if has_z else mimo_o,
           dz if has_z else dout, dphi, dzeta if has_z else dphi, *sizes, n_spans, **constants,
           HAS_Z=has_z, **host_utils.sigmoid_units(q), D_AT_GATE=d_in_gate)
    return dphi, dzeta
