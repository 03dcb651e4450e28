"""Stages 1 and 2 of the production path: the state recurrence, parallel over segments and tiles.

The recurrence ``state_{c+1} = exp(decay_c) state_c + k~_w^T psiv`` is separable
along N and P, so one program owns one [N/2-tile x 2, P-tile] piece of the state
of one (b, h).  The sequence is cut into ``n_segments`` runs of chunks:

1. ``segment_end_states``: every segment but the last is scanned from a zero
   state; only its end state is written (fp32 scratch, small).
2. ``chunk_states``: every segment starts from the decayed sum of the earlier
   segments' end states and writes the state entering each of its chunks into
   ``states``.

With local states (``chunk_local_states``) one pass replaces the two: every segment is
scanned from a zero state, writing its chunks' segment-local states and its end state;
``state_passing.segment_entry_states`` and the output stage add the earlier segments.

All three run the same kernel (``STORE_STATES``, ``FOLD_EARLIER`` and ``STORE_END`` pick what
it reads and writes).  A chunk costs one load of its k, v and discretization and one
[N/2, rows] x [rows, P] product per half; everything that needs q, dout or z lives in
``chunk_output``.
"""

import torch
import triton
import triton.language as tl

from . import host_utils
from .host_utils import cdiv, next_power_of_2
from .launch import launch
from .triton_utils import (
    add_bias_halves,
    chunk_log_decay_at,
    chunk_rows,
    chunk_run_log_decay,
    exp_fp32,
    load_angle_tiles,
    load_halves,
    load_rows,
    load_token_weights,
    rotate_half,
    span_decay_offsets,
    wait_for_previous_grid,
)


@triton.jit
def _load_step(k_seq, v_seq, cos_seq, sin_seq, da_cs_seq, da_rev_seq, gamma_seq, trap_scale_seq, t_rows, t0,
               row_r, row_mask, offs_half, half_mask, offs_p, p_mask, S, H, G,
               C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr, RD: tl.constexpr,
               SPAN_CHUNKS: tl.constexpr, ONE_PRODUCT: tl.constexpr):
    """Everything one scan step reads from memory, as stored: nothing here waits on the state.

    Returns k^T halves [half, rows] and cos / sin [half, rows] in their stored dtypes, v rows [rows, P tile]
    in its dtype, and per row ``da_rev`` (re-based to the span end where one product covers the span) and
    ``trap_scale`` (fp32), and the span's whole log decay (a scalar; 0 unless ONE_PRODUCT).
    """
    k_lo_t, k_hi_t = load_halves(k_seq, t_rows, row_r, row_mask, R * G * N, G * N, offs_half, half_mask, N,
                                 TRANSPOSED=True)
    cos_t, sin_t = load_angle_tiles(cos_seq, sin_seq, t_rows, row_mask, H * RD, offs_half, RD, TRANSPOSED=True)
    v_rows = tl.load(v_seq + (t_rows * (H * P))[:, None] + offs_p[None, :],
                     mask=row_mask[:, None] & p_mask[None, :], other=0.0)
    _, da_rev, _, trap_scale = load_token_weights(da_cs_seq, da_rev_seq, gamma_seq, trap_scale_seq, t_rows, S)
    span_log_decay = tl.full((), 0.0, tl.float32)
    if ONE_PRODUCT:
        _, later, span_log_decay = span_decay_offsets(da_cs_seq, t_rows, t0, S, C, SPAN_CHUNKS)
        if SPAN_CHUNKS > 1:
            da_rev += later
    return k_lo_t, k_hi_t, cos_t, sin_t, v_rows, da_rev, trap_scale, span_log_decay


@triton.jit
def _state_scan_kernel(
    k_ptr, v_ptr, cos_ptr, sin_ptr, k_bias_ptr, psi_ptr,
    da_cs_ptr, da_rev_ptr, gamma_ptr, trap_scale_ptr,
    seg_state_ptr, states_ptr,
    S, H, G, HEADS_PER_GROUP, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
    C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr, RD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_SEG_CHUNKS: tl.constexpr,
    SPAN_CHUNKS: tl.constexpr, STORE_STATES: tl.constexpr, FOLD_EARLIER: tl.constexpr, STORE_END: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr, SKIP_UNROTATED: tl.constexpr,
    ROTATION_DTYPE: tl.constexpr, PRECISE_EXP: tl.constexpr = False,
    GDC: tl.constexpr = False,
):
    wait_for_previous_grid(GDC)
    HALF: tl.constexpr = N // 2
    # A step takes a span of SPAN_CHUNKS chunks (L tokens); CHUNKS_PER_SEG is a multiple of SPAN_CHUNKS.
    L: tl.constexpr = C * SPAN_CHUNKS
    P_TILES: tl.constexpr = (P + BLOCK_P - 1) // BLOCK_P
    pid_n = tl.program_id(0) // P_TILES
    pid_p = tl.program_id(0) % P_TILES
    seg = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    g = h // HEADS_PER_GROUP

    # Rows are the span's (token, rank) pairs, row = t_local * R + r.
    row_t, row_r, row_valid = chunk_rows(BLOCK_ROWS, L, R)
    offs_half = pid_n * BLOCK_HALF + tl.arange(0, BLOCK_HALF)
    half_mask = offs_half < HALF
    # Columns n >= RD of each half have cos 1 and sin 0: a tile wholly past RD (the upper N/2 tiles where
    # BLOCK_HALF <= RD) has nothing to rotate, and its programs branch around the rotation math.
    tile_rotated = pid_n * BLOCK_HALF < RD
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = offs_p < P

    disc_base = bh * S
    da_cs_seq = da_cs_ptr + disc_base
    k_seq = k_ptr + b * S * R * G * N + g * N
    v_seq = v_ptr + (b * S * H + h) * P
    angle_base = (b * S * H + h) * RD
    psi_rows = load_rows(psi_ptr + h * R * P, row_r * P, row_valid, offs_p, p_mask)

    tile_offs = offs_half[:, None] * P + offs_p[None, :]
    tile_mask = half_mask[:, None] & p_mask[None, :]
    state_lo = tl.zeros((BLOCK_HALF, BLOCK_P), dtype=tl.float32)
    state_hi = tl.zeros((BLOCK_HALF, BLOCK_P), dtype=tl.float32)
    if FOLD_EARLIER:
        # Fold the earlier segments: s <- exp(segment log decay) s + end state of that segment.
        for i in range(0, seg):
            seg_decay = exp_fp32(chunk_run_log_decay(da_cs_seq, i * CHUNKS_PER_SEG, CHUNKS_PER_SEG, S, C,
                                                     BLOCK_SEG_CHUNKS), PRECISE_EXP)
            end_state = seg_state_ptr + (bh * N_SEGMENTS + i) * N * P
            state_lo = state_lo * seg_decay + tl.load(end_state + tile_offs, mask=tile_mask, other=0.0)
            state_hi = state_hi * seg_decay + tl.load(end_state + HALF * P + tile_offs, mask=tile_mask, other=0.0)

    states_seq = states_ptr + bh * NCH * N * P
    k_bias_head = k_bias_ptr + h * R * N
    # Without STORE_STATES only a segment's end state is wanted: one product per half covers a span.  With it
    # every chunk's entering state is stored: one product per chunk of the span, its rows selected from the
    # span's tiles (the loads of all the span's chunks are in flight together).
    ONE_PRODUCT: tl.constexpr = SPAN_CHUNKS == 1 or not STORE_STATES
    n_steps = CHUNKS_PER_SEG // SPAN_CHUNKS
    cos_seq = cos_ptr + angle_base
    sin_seq = sin_ptr + angle_base
    da_rev_seq = da_rev_ptr + disc_base
    gamma_seq = gamma_ptr + disc_base
    trap_scale_seq = trap_scale_ptr + disc_base
    if PREFETCH:
        # Step i + 1's loads are issued before step i's products, so their latency hides under them.
        t_next = seg * CHUNKS_PER_SEG * C + row_t
        (next_k_lo, next_k_hi, next_cos, next_sin, next_v, next_da_rev, next_trap_scale,
         next_span_log_decay) = _load_step(
            k_seq, v_seq, cos_seq, sin_seq, da_cs_seq, da_rev_seq, gamma_seq, trap_scale_seq, t_next,
            seg * CHUNKS_PER_SEG * C, row_r, row_valid & (t_next < S), offs_half, half_mask, offs_p, p_mask,
            S, H, G, C, R, N, P, RD, SPAN_CHUNKS, ONE_PRODUCT)
    for i in range(0, n_steps):
        c = seg * CHUNKS_PER_SEG + i * SPAN_CHUNKS  # first chunk of the span
        t0 = c * C
        t_rows = t0 + row_t
        row_mask = row_valid & (t_rows < S)  # false for every row of a span past S
        if STORE_STATES:
            chunk_mask = tile_mask & (c < NCH)
            tl.store(states_seq + c * N * P + tile_offs, state_lo.to(states_ptr.dtype.element_ty), mask=chunk_mask)
            tl.store(states_seq + c * N * P + HALF * P + tile_offs, state_hi.to(states_ptr.dtype.element_ty),
                     mask=chunk_mask)
        if PREFETCH:
            k_lo_t, k_hi_t, cos_t, sin_t, v_rows = next_k_lo, next_k_hi, next_cos, next_sin, next_v
            da_rev, trap_scale, span_log_decay = next_da_rev, next_trap_scale, next_span_log_decay
            t_next = t_rows + L
            (next_k_lo, next_k_hi, next_cos, next_sin, next_v, next_da_rev, next_trap_scale,
             next_span_log_decay) = _load_step(
                k_seq, v_seq, cos_seq, sin_seq, da_cs_seq, da_rev_seq, gamma_seq, trap_scale_seq, t_next, t0 + L,
                row_r, row_valid & (t_next < S) & (i + 1 < n_steps), offs_half, half_mask, offs_p, p_mask,
                S, H, G, C, R, N, P, RD, SPAN_CHUNKS, ONE_PRODUCT)
        else:
            k_lo_t, k_hi_t, cos_t, sin_t, v_rows, da_rev, trap_scale, span_log_decay = _load_step(
                k_seq, v_seq, cos_seq, sin_seq, da_cs_seq, da_rev_seq, gamma_seq, trap_scale_seq, t_rows, t0,
                row_r, row_mask, offs_half, half_mask, offs_p, p_mask, S, H, G, C, R, N, P, RD, SPAN_CHUNKS,
                ONE_PRODUCT)

        # k~^T straight from memory: [N/2 tile, rows] per half, the A operand of the update product.  The bias add
        # and the rotation are most of the step's instructions: in a half ROTATION_DTYPE they pack two a register.
        k_lo_t, k_hi_t = add_bias_halves(k_lo_t, k_hi_t, k_bias_head, row_r, row_mask, offs_half, half_mask, N,
                                         TRANSPOSED=True, MATH_DTYPE=ROTATION_DTYPE)
        if SKIP_UNROTATED:
            if tile_rotated:
                k_lo_t, k_hi_t = rotate_half(k_lo_t, k_hi_t, cos_t.to(ROTATION_DTYPE), sin_t.to(ROTATION_DTYPE))
        else:
            k_lo_t, k_hi_t = rotate_half(k_lo_t, k_hi_t, cos_t.to(ROTATION_DTYPE), sin_t.to(ROTATION_DTYPE))
        k_lo_t = k_lo_t.to(DOT_DTYPE)
        k_hi_t = k_hi_t.to(DOT_DTYPE)
        # exp(da_cs_rev) decays each token to its chunk's end (with one product over a span: to the span end);
        # it weighs psiv rows, not k~.
        k_weight = tl.where(row_mask, exp_fp32(da_rev, PRECISE_EXP) * trap_scale, 0.0)
        psiv_w = v_rows.to(tl.float32) * psi_rows * k_weight[:, None]
        if not ONE_PRODUCT:
            # Chunk j's product takes its rows only, each decayed to chunk j's end.
            for j in tl.static_range(SPAN_CHUNKS):
                chunk_decay = exp_fp32(chunk_log_decay_at(da_cs_seq, t0 + j * C, S, C), PRECISE_EXP)
                psiv_j = tl.where((row_t // C == j)[:, None], psiv_w, 0.0).to(DOT_DTYPE)
                state_lo = state_lo * chunk_decay + tl.dot(k_lo_t, psiv_j, input_precision=DOT_PRECISION)
                state_hi = state_hi * chunk_decay + tl.dot(k_hi_t, psiv_j, input_precision=DOT_PRECISION)
                if j + 1 < SPAN_CHUNKS:
                    next_offs = (c + j + 1) * N * P + tile_offs
                    next_mask = tile_mask & (c + j + 1 < NCH)
                    tl.store(states_seq + next_offs, state_lo.to(states_ptr.dtype.element_ty), mask=next_mask)
                    tl.store(states_seq + next_offs + HALF * P, state_hi.to(states_ptr.dtype.element_ty),
                             mask=next_mask)
        else:
            psiv_w = psiv_w.to(DOT_DTYPE)
            span_decay = exp_fp32(span_log_decay, PRECISE_EXP)
            state_lo = state_lo * span_decay + tl.dot(k_lo_t, psiv_w, input_precision=DOT_PRECISION)
            state_hi = state_hi * span_decay + tl.dot(k_hi_t, psiv_w, input_precision=DOT_PRECISION)

    if STORE_END:
        # The last segment's end state is never read.
        end_state = seg_state_ptr + (bh * N_SEGMENTS + seg) * N * P
        end_mask = tile_mask & (seg < N_SEGMENTS - 1)
        tl.store(end_state + tile_offs, state_lo, mask=end_mask)
        tl.store(end_state + HALF * P + tile_offs, state_hi, mask=end_mask)


def scan_meta(*, chunk_size, R, N, block_half, block_p, span_chunks=1):
    """Block sizes of the state scan: rows = (token, rank) pairs of a span of chunks, >= 16 for tl.dot."""
    return dict(BLOCK_ROWS=max(16, next_power_of_2(chunk_size * span_chunks * R)),
                BLOCK_HALF=max(16, min(block_half, next_power_of_2(N // 2))), BLOCK_P=block_p,
                SPAN_CHUNKS=span_chunks)


def _launch(*, k, v, cos_angles, sin_angles, k_bias, mimo_v, da_cs, da_cs_rev, gamma, trap_scale, seg_state, states,
            chunk_size, n_segments, chunks_per_segment, block_half, block_p, dot_dtype, dot_precision,
            num_warps, store_states, fold_earlier, store_end, segments_launched, span_chunks=1, max_registers=0,
            prefetch=False, skip_unrotated=False, rotation_math_dtype=tl.float32):
    B, S, R, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    if chunks_per_segment % span_chunks:
        raise ValueError(f"chunks_per_segment={chunks_per_segment} is not a multiple of span_chunks={span_chunks}")
    meta = scan_meta(chunk_size=chunk_size, R=R, N=N, block_half=block_half, block_p=block_p,
                     span_chunks=span_chunks)
    tiles = cdiv(N // 2, meta["BLOCK_HALF"]) * cdiv(P, block_p)
    launch(_state_scan_kernel, (tiles, segments_launched, B * H),
        k, v, cos_angles, sin_angles, k_bias, mimo_v, da_cs, da_cs_rev, gamma, trap_scale, seg_state, states,
        S, H, G, H // G, cdiv(S, chunk_size), chunks_per_segment, n_segments,
        C=chunk_size, R=R, N=N, P=P, RD=cos_angles.shape[3], **meta,
        BLOCK_SEG_CHUNKS=next_power_of_2(chunks_per_segment),
        STORE_STATES=store_states, FOLD_EARLIER=fold_earlier, STORE_END=store_end,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision, PREFETCH=prefetch, SKIP_UNROTATED=skip_unrotated,
        ROTATION_DTYPE=rotation_math_dtype, PRECISE_EXP=host_utils.precise_exp(dot_dtype, k),
        num_warps=num_warps, num_stages=1,
        **({'maxnreg': max_registers} if max_registers else {}),
    )


def _segment_scratch(scan_args, n_segments):
    B, _, _, _, N = scan_args["k"].shape
    H, P = scan_args["v"].shape[2:]
    return torch.empty((B, H, n_segments, N, P), device=scan_args["k"].device, dtype=torch.float32)


def segment_end_states(*, n_segments, span_chunks=1, **scan_args):
    """End state of every segment but the last, each scanned from a zero state, span_chunks chunks a step.

    Args (contiguous; see ``mamba3_mimo.api`` for validation), passed on to the kernel launch:
        k: [B, S, R, G, N]; v: [B, S, H, P]; cos_angles, sin_angles: [B, S, H, RD] fp32, fp16 or bf16;
        k_bias: [H, R, N] fp32; mimo_v: [H, R, P] fp32; da_cs, da_cs_rev, gamma, trap_scale: [B, H, S]
        fp32 (``token_tables``); chunk_size, n_segments, chunks_per_segment, block_half, block_p,
        dot_dtype, dot_precision, num_warps, max_registers (a register cap per thread, 0: the compiler's
        choice), prefetch (issue each step's loads one step ahead), skip_unrotated (programs whose N/2 tile lies
        past the rotary dims branch around the rotation), rotation_math_dtype (the dtype of k's bias add and
        rotation: tl.float32, or the products' half dtype, ``host_utils.rotation_math_dtype``); chunks_per_segment
        must be a multiple of span_chunks.
    Returns:
        seg_state: [B, H, n_segments, N, P] fp32 (entry ``n_segments - 1`` is never written), or
        None with a single segment (nothing to fold).
    """
    if n_segments == 1:
        return None
    seg_state = _segment_scratch(scan_args, n_segments)
    _launch(**scan_args, n_segments=n_segments, seg_state=seg_state, states=seg_state, store_states=False,
            fold_earlier=False, store_end=True, segments_launched=n_segments - 1, span_chunks=span_chunks)
    return seg_state


def chunk_states(*, seg_state, states, n_segments, span_chunks=1, **scan_args):
    """Write the state entering every chunk into ``states`` [B, H, nch, N, P] (any float dtype).

    ``seg_state`` is the output of ``segment_end_states`` with the same segmentation (None with
    one segment); the other arguments are those of ``segment_end_states``.  A step loads
    ``span_chunks`` chunks and stores the state entering each of them.
    """
    # With one segment the fold never runs; any fp32 tensor stands in (same kernel specialization).
    _launch(**scan_args, n_segments=n_segments, seg_state=scan_args["gamma"] if seg_state is None else seg_state,
            states=states, store_states=True, fold_earlier=True, store_end=False, segments_launched=n_segments,
            span_chunks=span_chunks)


def chunk_local_states(*, states, n_segments, span_chunks=1, **scan_args):
    """One pass: every segment from a zero state, writing its chunks' local states and its end state.

    ``states`` [B, H, nch, N, P] receives, for each chunk, the state entering it counted from the
    start of its segment only; the state of the earlier segments is added by the output stage
    (``segment_entry_states`` gives it).  Arguments as for ``chunk_states``.
    Returns:
        seg_state: [B, H, n_segments, N, P] fp32 holding each segment's end state (the last entry
        is never written).
    """
    seg_state = _segment_scratch(scan_args, n_segments)
    _launch(**scan_args, n_segments=n_segments, seg_state=seg_state, states=states, store_states=True,
            fold_earlier=False, store_end=True, segments_launched=n_segments, span_chunks=span_chunks)
    return seg_state
