"""Triton helpers shared by every bwd_fwd kernel.

Layout convention of the kernels: a chunk's (token, rank) pairs are the rows
of a tile, ``row = t_local * R + r`` (``BLOCK_ROWS = max(16, next_pow2(C * R))``
for ``tl.dot``); per-rank work runs over tiles whose rows are the chunk's
tokens.  Each row is loaded at its own (token, rank) address, so no register
tile is reshaped.  Rows past ``C * R`` are padding and are masked everywhere.

Sequences that are not a whole number of chunks are padded *virtually*
(SPEC section 4): loads past the valid length ``S`` return zeros for
activations, ``da_cs`` is clamped to its last valid value, and stores past
``S`` are masked.  This is the same arithmetic as padding on the host, without
the copies.
"""

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice


# Under the interpreter a kernel's dependent-launch code path (its work ordered around the wait) runs without the
# wait and trigger instructions, which are inline PTX: the CPU tests check that path's values.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def wait_for_previous_grid(ENABLED: tl.constexpr):
    """With programmatic dependent launch (``launch.dependent_launches``), a kernel may start while the one before
    it in the stream still runs: wait here for that grid's completion and its writes (``griddepcontrol.wait``)
    before any load of them, then let the next kernel's programs be scheduled (``griddepcontrol.launch_dependents``).
    Triggering only after the wait keeps the chain safe: when the next kernel starts, this one's predecessor is done.
    CUDA (sm_90+); a no-op under the interpreter (``INTERPRETED``)."""
    if ENABLED:
        if not INTERPRETED:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def chunk_rows(BLOCK_ROWS: tl.constexpr, C: tl.constexpr, R: tl.constexpr):
    """(t_local, rank, valid) of each row of a chunk tile, row = t_local * R + rank: three [BLOCK_ROWS]."""
    rows = tl.arange(0, BLOCK_ROWS)
    return rows // R, rows % R, rows < C * R


@triton.jit
def rotate_half(x_lo, x_hi, cos, sin):
    """Rotate-half on the paired halves x[n], x[N/2 + n]; cos = 1, sin = 0 where n >= RD."""
    return x_lo * cos - x_hi * sin, x_lo * sin + x_hi * cos


@triton.jit
def trapezoid_weights(dt, trap, dt_next, trap_next):
    """(gamma, trap_scale) of a token from its dt and trap and those of the next token (0 past S - 1).

      gamma      = dt[t] * sigmoid(trap[t])                (weight of token t on itself)
      trap_scale = gamma[t] + dt[t+1] * sigmoid(-trap[t+1]) (weight of token t on later tokens)
    """
    gamma = dt * tl.sigmoid(trap)
    return gamma, gamma + dt_next * tl.sigmoid(-trap_next)


@triton.jit
def load_token_discretization(da_cs_ptr, da_rev_ptr, dt_ptr, trap_ptr, t_abs, S):
    """Per-position discretization terms at absolute positions ``t_abs`` of one (b, h).

    Returns (da_cs, da_cs_rev, gamma, trap_scale), fp32, shaped like ``t_abs`` (``trapezoid_weights``).
    Positions past S behave as padding: dt = 0, da_cs = da_cs[S-1].
    """
    valid = t_abs < S
    next_valid = (t_abs + 1) < S
    da_cs = tl.load(da_cs_ptr + tl.minimum(t_abs, S - 1)).to(tl.float32)
    da_rev = tl.load(da_rev_ptr + t_abs, mask=valid, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + t_abs, mask=valid, other=0.0).to(tl.float32)
    trap = tl.load(trap_ptr + t_abs, mask=valid, other=0.0).to(tl.float32)
    dt_next = tl.load(dt_ptr + t_abs + 1, mask=next_valid, other=0.0).to(tl.float32)
    trap_next = tl.load(trap_ptr + t_abs + 1, mask=next_valid, other=0.0).to(tl.float32)
    gamma, trap_scale = trapezoid_weights(dt, trap, dt_next, trap_next)
    return da_cs, da_rev, gamma, trap_scale


@triton.jit
def load_token_weights(da_cs_ptr, da_rev_ptr, gamma_ptr, trap_scale_ptr, t_abs, S):
    """(da_cs, da_cs_rev, gamma, trap_scale) at absolute positions ``t_abs`` of one (b, h), fp32.

    As ``load_token_discretization``, with gamma and trap_scale read from the tables of
    ``token_tables``; positions past S behave as padding (da_cs = da_cs[S-1], the rest 0).
    """
    valid = t_abs < S
    da_cs = tl.load(da_cs_ptr + tl.minimum(t_abs, S - 1))
    da_rev = tl.load(da_rev_ptr + t_abs, mask=valid, other=0.0)
    gamma = tl.load(gamma_ptr + t_abs, mask=valid, other=0.0)
    trap_scale = tl.load(trap_scale_ptr + t_abs, mask=valid, other=0.0)
    return da_cs, da_rev, gamma, trap_scale


@triton.jit
def chunk_log_decay_at(da_cs_seq_ptr, chunk_start, S, C: tl.constexpr):
    """Whole log decay of the chunk starting at ``chunk_start`` (a scalar): ``da_cs`` at its last valid
    position (the cumsum restarts every chunk); 0 for a chunk that starts past S (padding)."""
    chunk_end = tl.minimum(chunk_start + C - 1, S - 1)
    return tl.where(chunk_start < S, tl.load(da_cs_seq_ptr + chunk_end).to(tl.float32), 0.0)


@triton.jit
def span_decay_offsets(da_cs_seq_ptr, t_abs, span_start, S, C: tl.constexpr, SPAN_CHUNKS: tl.constexpr):
    """Re-base the chunk-local cumsum ``da_cs`` to a span of SPAN_CHUNKS consecutive chunks.

    ``da_cs`` restarts at every chunk, so across a span starting at ``span_start`` the log decay
    from the span start to t is ``da_cs[t] + earlier[t]`` and from t to the span end
    ``da_cs_rev[t] + later[t]``, with earlier / later the whole log decays of the span's chunks
    before / after t's chunk.  Returns (earlier, later) shaped like ``t_abs`` and the span's total
    log decay (a scalar).  Chunks that start past S decay nothing (they are padding).
    """
    sub_chunk = (t_abs - span_start) // C
    earlier = tl.zeros(t_abs.shape, dtype=tl.float32)
    later = tl.zeros(t_abs.shape, dtype=tl.float32)
    total = 0.0
    for i in tl.static_range(SPAN_CHUNKS):
        chunk_log_decay = chunk_log_decay_at(da_cs_seq_ptr, span_start + i * C, S, C)
        earlier += tl.where(sub_chunk > i, chunk_log_decay, 0.0)
        later += tl.where(sub_chunk < i, chunk_log_decay, 0.0)
        total += chunk_log_decay
    return earlier, later, total


@triton.jit
def chunk_run_log_decay(da_cs_seq_ptr, first_chunk, n_chunks, S, C: tl.constexpr, BLOCK_CHUNKS: tl.constexpr):
    """Log decay across ``n_chunks`` (<= BLOCK_CHUNKS) whole chunks from ``first_chunk`` on: a scalar.

    A chunk's log decay is ``da_cs`` at its last valid position (the cumsum restarts every chunk).
    The run must lie inside the sequence: a chunk past S would repeat the last chunk's decay.
    """
    idx = tl.arange(0, BLOCK_CHUNKS)
    chunk_ends = tl.minimum((first_chunk + idx) * C + C - 1, S - 1)
    return tl.sum(tl.load(da_cs_seq_ptr + chunk_ends, mask=idx < n_chunks, other=0.0), axis=0)


@triton.jit
def exp_fp32(x, PRECISE: tl.constexpr = False):
    """exp(x) of fp32 x.  ``tl.exp`` lowers to ex2.approx after an fp32 multiply by log2(e): a relative error of
    ~|x| 2^-24 from the product's rounding plus the unit's 2^-22, where libdevice's expf stays within 2 ulp.
    PRECISE (CUDA only: the interpreter has no libdevice) takes libdevice's; ``host_utils.precise_exp`` says when
    (fp32 products, off by default: no accuracy margin moved on the GPU; docs/optimization.md sections 34, 36)."""
    if PRECISE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def intra_chunk_weights(row_t, col_t, row_mask, col_mask, da_row, da_col, gamma_row, ts_col,
                        PRECISE_EXP: tl.constexpr = False):
    """Causal weights of the folded chunk score matrix [rows, cols].

    Earlier tokens s < t weigh trap_scale[s] * exp(da_cs[t] - da_cs[s]) (the
    segment sum, derived from da_cs), the same token weighs gamma[t], later
    tokens nothing.  Padding rows and columns get 0, and the exponent is only
    evaluated between valid positions of one chunk, so strong decay cannot
    overflow into inf * 0.
    """
    both_valid = row_mask[:, None] & col_mask[None, :]
    earlier = (row_t[:, None] > col_t[None, :]) & both_valid
    same = (row_t[:, None] == col_t[None, :]) & both_valid
    decay = exp_fp32(tl.where(earlier, da_row[:, None] - da_col[None, :], 0.0), PRECISE_EXP)
    return tl.where(earlier, decay * ts_col[None, :], tl.where(same, gamma_row[:, None], 0.0))


@triton.jit
def fast_sigmoid(u):
    """sigmoid(u) = 1 / (1 + 2^(-u log2 e)) on the GPU's approximate units, flushing denormals.

    ``tl.sigmoid`` compiles to ex2 and a full-range division, each wrapped in range fix-ups: about
    12 instructions against 4 here.  ex2.approx.ftz and rcp.approx.ftz are within 2 ulp of fp32 over
    the range that matters; at u < -126 / log2 e the result flushes to 0, where sigmoid is below 1e-38.
    Inline PTX: CUDA only, the Triton interpreter cannot run it (callers choose ``tl.sigmoid`` there).
    """
    exp_neg = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [u * -1.4426950408889634],
                                        dtype=tl.float32, is_pure=True, pack=1)
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + exp_neg],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def fast_cos_sin(theta):
    """(cos(theta), sin(theta)) of fp32 angles: a three-part reduction by 2 pi, then the approximate units.

    libdevice's cos and sin take ~40 instructions each plus a slow-path branch (Payne-Hanek, local memory);
    this is ~8 for both.  The reduction (2 pi = 6.28125 + 1.9353e-3 + 1.0253e-11, the first part exact
    in products with |k| < 2^16) is within ~2e-7 of theta mod 2 pi for |theta| < 4e5; cos.approx and
    sin.approx are within 2^-20.9 absolute on [-pi, pi]: below a 16-bit table's rounding, not fp32's (token_tables
    takes it for 16-bit tables only).  Inline PTX: CUDA only (the interpreter takes ``tl.cos`` / ``tl.sin``).
    """
    k = tl.floor(theta * 0.15915494309189535 + 0.5)
    reduced = theta - k * 6.28125
    reduced = tl.fma(k, -0.0019353071693331003, reduced)
    reduced = tl.fma(k, -1.0253131677018246e-11, reduced)
    cos = tl.inline_asm_elementwise("cos.approx.ftz.f32 $0, $1;", "=r,r", [reduced], dtype=tl.float32,
                                    is_pure=True, pack=1)
    sin = tl.inline_asm_elementwise("sin.approx.ftz.f32 $0, $1;", "=r,r", [reduced], dtype=tl.float32,
                                    is_pure=True, pack=1)
    return cos, sin


@triton.jit
def table_cos_sin(theta, TABLE_DTYPE: tl.constexpr, FAST_TRIG: tl.constexpr):
    """(cos(theta), sin(theta)) of fp32 angles rounded to TABLE_DTYPE, the values ``token_tables`` stores in its cos /
    sin tables: a kernel that takes the angles instead of the tables computes them with this and reads the same
    numbers (FAST_TRIG: ``fast_cos_sin``, the GPU's choice for 16-bit tables; else ``tl.cos`` / ``tl.sin``)."""
    if FAST_TRIG:
        cos, sin = fast_cos_sin(theta)
    else:
        cos, sin = tl.cos(theta), tl.sin(theta)
    return cos.to(TABLE_DTYPE), sin.to(TABLE_DTYPE)


@triton.jit
def fp16_row_scaled(x):
    """x [rows, cols] fp32 times a power of two per row that puts the row's largest magnitude in [2^14, 2^15).

    In fp16 the scaled row keeps 11 significant bits for every element down to 2^-28 of its largest (the
    normal range) and cannot overflow; the powers of two are exact both ways.  Rows whose largest magnitude is
    below 2^-100 (all zeros) take the scale of 2^-100.  Returns (scaled x, the [rows] factor that undoes it).
    """
    # The biased exponent of each row's largest magnitude, as the bits of 2^floor(log2(max)).
    exp_bits = tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) & 0x7F800000
    exp_bits = tl.maximum(exp_bits, 27 << 23)
    scale = ((254 << 23) - exp_bits + (14 << 23)).to(tl.float32, bitcast=True)  # 2^(14 - e), no int32 overflow
    unscale = (exp_bits - (14 << 23)).to(tl.float32, bitcast=True)  # 2^(e - 14)
    return x * scale[:, None], unscale


@triton.jit
def precise_sigmoid(u):
    """sigmoid(u) = 1 / (1 + exp(-u)) with libdevice's expf and an IEEE division: within a few fp32 ulp at any u.
    CUDA only (the interpreter has no libdevice).  exp(-u) overflows to inf below u = -88, where 1 / inf = 0."""
    return tl.math.div_rn(1.0, 1.0 + libdevice.exp(-u))


@triton.jit
def silu_and_grad(u, FAST_SIGMOID: tl.constexpr = False, PRECISE_SIGMOID: tl.constexpr = False):
    """(silu(u), silu'(u)) with silu'(u) = sigmoid(u) * (1 + u * (1 - sigmoid(u))).

    ``host_utils.sigmoid_units`` sets the flags (CUDA only, both): FAST_SIGMOID takes ``fast_sigmoid`` (16-bit
    activations), PRECISE_SIGMOID ``precise_sigmoid`` (fp32 activations: the approximate units' relative error,
    ~|u| 2^-23, is above fp32's rounding; docs/optimization.md sections 35-36); neither takes
    ``tl.sigmoid`` (the interpreter; stage0).  Flags, not one string constexpr: Triton 3.6 cannot take a str as a
    jit helper's default.
    """
    if FAST_SIGMOID:
        sig = fast_sigmoid(u)
    elif PRECISE_SIGMOID:
        sig = precise_sigmoid(u)
    else:
        sig = tl.sigmoid(u)
    return u * sig, sig * (1.0 + u * (1.0 - sig))


@triton.jit
def _row_col(row_vals, col_vals, TRANSPOSED: tl.constexpr):
    """Broadcast per-row and per-column vectors to a [rows, cols] tile, or [cols, rows] if TRANSPOSED."""
    if TRANSPOSED:
        return row_vals[None, :], col_vals[:, None]
    else:
        return row_vals[:, None], col_vals[None, :]


@triton.jit
def load_angle_tiles(cos_seq_ptr, sin_seq_ptr, t_pos, row_mask, angle_stride, offs_half, RD: tl.constexpr,
                     TRANSPOSED: tl.constexpr = False):
    """cos and sin of the rotation angles as [rows, half] tiles (row i is token ``t_pos[i]``).

    ``cos_seq_ptr`` / ``sin_seq_ptr`` point at cos(angles)[b, 0, h, 0] / sin(angles)[b, 0, h, 0]
    (fp32, fp16 or bf16, precomputed: libdevice cos/sin per row doubled the registers of the kernels), returned
    in the tables' dtype.  Columns n >= RD and masked rows get cos 1, sin 0 (no rotation).  [half, rows]
    with TRANSPOSED.
    """
    row_angle, col = _row_col(t_pos * angle_stride, offs_half, TRANSPOSED)
    row_ok, col_rotated = _row_col(row_mask, offs_half < RD, TRANSPOSED)
    rotated = row_ok & col_rotated
    cos = tl.load(cos_seq_ptr + row_angle + col, mask=rotated, other=1.0)
    sin = tl.load(sin_seq_ptr + row_angle + col, mask=rotated, other=0.0)
    return cos, sin


@triton.jit
def load_halves(x_seq_ptr, t_pos, ranks, row_mask, token_stride, rank_stride, offs_half, half_mask,
                N: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """q or k rows as they are stored, halves (x[:, n], x[:, N/2 + n]) for n in ``offs_half``; masked: 0.

    Row i is token ``t_pos[i]``, rank ``ranks[i]`` (both [rows] int tensors).  ``x_seq_ptr`` points
    at x[b, 0, 0, g, 0] of [B, S, R, G, N].  [half, rows] with TRANSPOSED.
    """
    HALF: tl.constexpr = N // 2
    row_ok, col_ok = _row_col(row_mask, half_mask, TRANSPOSED)
    mask = row_ok & col_ok
    row_addr, col = _row_col(t_pos * token_stride + ranks * rank_stride, offs_half, TRANSPOSED)
    offs = row_addr + col
    return tl.load(x_seq_ptr + offs, mask=mask, other=0.0), tl.load(x_seq_ptr + offs + HALF, mask=mask, other=0.0)


@triton.jit
def add_bias_halves(x_lo, x_hi, bias_head_ptr, ranks, row_mask, offs_half, half_mask, N: tl.constexpr,
                    TRANSPOSED: tl.constexpr = False, MATH_DTYPE: tl.constexpr = tl.float32):
    """The halves of ``load_halves`` in MATH_DTYPE with the per-rank bias added; masked elements exactly zero.

    ``bias_head_ptr`` points at bias[h, 0, 0] of [H, R, N].  MATH_DTYPE fp32, or the products' half dtype
    (``rotation_math_dtype``: two elements a register through the rotation).
    """
    HALF: tl.constexpr = N // 2
    row_ok, col_ok = _row_col(row_mask, half_mask, TRANSPOSED)
    mask = row_ok & col_ok
    row_bias, col = _row_col(ranks * N, offs_half, TRANSPOSED)
    bias_offs = row_bias + col
    if MATH_DTYPE == tl.float32:
        x_lo = tl.where(mask, x_lo.to(tl.float32) + tl.load(bias_head_ptr + bias_offs, mask=mask, other=0.0), 0.0)
        x_hi = tl.where(mask, x_hi.to(tl.float32) + tl.load(bias_head_ptr + bias_offs + HALF, mask=mask, other=0.0),
                        0.0)
    else:
        x_lo, x_hi = bias_add_in_half(x_lo, x_hi, tl.load(bias_head_ptr + bias_offs, mask=mask, other=0.0),
                                     tl.load(bias_head_ptr + bias_offs + HALF, mask=mask, other=0.0), mask,
                                     MATH_DTYPE)
    return x_lo, x_hi


@triton.jit
def bias_add_in_half(x_lo, x_hi, bias_lo, bias_hi, mask, MATH_DTYPE: tl.constexpr):
    """(x + bias) per half in a half MATH_DTYPE, times the mask as 0 / 1: masked elements exactly zero.

    Where x and the bias were loaded under the same mask the factor changes no value, and where the bias was not
    (chunk_scan's [ranks, half] bias over padding tokens) it zeroes those rows.  It stands where the fp32 form has
    a select, which on 16-bit elements goes one element at a time, and without either the compiler moved the tiles
    through shared memory (state scan N128_P64_R4_C16: 64 selects and 80 byte permutes against 32 packed multiplies).
    """
    keep = mask.to(MATH_DTYPE)
    x_lo = (x_lo.to(MATH_DTYPE) + bias_lo.to(MATH_DTYPE)) * keep
    x_hi = (x_hi.to(MATH_DTYPE) + bias_hi.to(MATH_DTYPE)) * keep
    return x_lo, x_hi


@triton.jit
def load_biased_halves(x_seq_ptr, bias_head_ptr, t_pos, ranks, row_mask, token_stride, rank_stride, offs_half,
                       half_mask, N: tl.constexpr, TRANSPOSED: tl.constexpr = False,
                       MATH_DTYPE: tl.constexpr = tl.float32):
    """Biased q or k rows, not rotated, as MATH_DTYPE halves (``load_halves`` then ``add_bias_halves``)."""
    x_lo, x_hi = load_halves(x_seq_ptr, t_pos, ranks, row_mask, token_stride, rank_stride, offs_half, half_mask,
                             N, TRANSPOSED)
    return add_bias_halves(x_lo, x_hi, bias_head_ptr, ranks, row_mask, offs_half, half_mask, N, TRANSPOSED,
                           MATH_DTYPE)


@triton.jit
def load_rotated_gather(x_seq_ptr, bias_head_ptr, cos_seq_ptr, sin_seq_ptr, t_pos, ranks, row_mask,
                        token_stride, rank_stride, angle_stride, offs_half, half_mask,
                        N: tl.constexpr, RD: tl.constexpr, DOT_DTYPE: tl.constexpr,
                        TRANSPOSED: tl.constexpr = False, MATH_DTYPE: tl.constexpr = tl.float32):
    """Biased, rotated q or k rows as halves (x~[:, n], x~[:, N/2 + n]) in DOT_DTYPE.

    Arguments as for ``load_biased_halves`` and ``load_angle_tiles``.  Masked rows come out
    exactly zero.  With TRANSPOSED the tiles are [half, rows], loaded that way from memory (the
    operand layout of k~^T products, with no register transpose).  The bias add and the rotation run in
    MATH_DTYPE (``add_bias_halves``).
    """
    x_lo, x_hi = load_biased_halves(x_seq_ptr, bias_head_ptr, t_pos, ranks, row_mask, token_stride, rank_stride,
                                    offs_half, half_mask, N, TRANSPOSED, MATH_DTYPE)
    cos, sin = load_angle_tiles(cos_seq_ptr, sin_seq_ptr, t_pos, row_mask, angle_stride, offs_half, RD,
                                TRANSPOSED)
    x_lo, x_hi = rotate_half(x_lo, x_hi, cos.to(MATH_DTYPE), sin.to(MATH_DTYPE))
    return x_lo.to(DOT_DTYPE), x_hi.to(DOT_DTYPE)


@triton.jit
def load_entering_state(states_ptr, seg_entry_ptr, entry_decay_ptr, bh, first_chunk, NCH, CHUNKS_PER_SEG,
                        N_SEGMENTS, offs_half, half_mask, offs_p, p_mask, N: tl.constexpr, P: tl.constexpr,
                        SPAN_CHUNKS: tl.constexpr, ADD_ENTRY: tl.constexpr, DEFER_FIRST_STORE: tl.constexpr = False):
    """The state entering chunk ``first_chunk`` of one (b, h), as fp32 halves [half, cols] (rows n, N/2 + n).

    ``states_ptr`` points at states [B, H, nch, N, P].  With ADD_ENTRY it holds segment-local
    states (``chunk_local_states``): each of the SPAN_CHUNKS chunks from ``first_chunk`` on gets
    its segment's entry state (``seg_entry_ptr``, [B, H, n_segments, N, P] fp32) times its decay from the
    segment start (``entry_decay_ptr``, [B, H, nch] fp32, from ``segment_entry_states``) added, and is
    written back whole; the first one is returned.  A chunk past NCH reads zeros and writes nothing.
    DEFER_FIRST_STORE leaves the first chunk's write to the caller (``store_entering_state``): a store here sits
    between these loads and the caller's next ones, which the compiler does not move above it (they might alias).
    """
    HALF: tl.constexpr = N // 2
    state_offs = offs_half[:, None] * P + offs_p[None, :]
    state_tile = states_ptr + bh * NCH * N * P + first_chunk * N * P + state_offs
    tile_mask = half_mask[:, None] & p_mask[None, :]
    state_lo = tl.load(state_tile, mask=tile_mask & (first_chunk < NCH), other=0.0).to(tl.float32)
    state_hi = tl.load(state_tile + HALF * P, mask=tile_mask & (first_chunk < NCH), other=0.0).to(tl.float32)
    if ADD_ENTRY:
        for i in tl.static_range(SPAN_CHUNKS):
            chunk = first_chunk + i
            seg = chunk // CHUNKS_PER_SEG
            # One scalar load: the decay was a sum over the segment's earlier chunks, a block reduction
            # (shared memory and a barrier) on every program's path to its states.
            entry_scale = tl.load(entry_decay_ptr + bh * NCH + chunk, mask=chunk < NCH, other=0.0)
            entry_tile = seg_entry_ptr + (bh * N_SEGMENTS + seg) * N * P + state_offs
            fix_mask = tile_mask & (chunk < NCH) & (seg > 0)  # segment 0 enters from zero
            if i == 0:
                local_lo, local_hi = state_lo, state_hi
            else:
                local_lo = tl.load(state_tile + i * N * P, mask=fix_mask, other=0.0).to(tl.float32)
                local_hi = tl.load(state_tile + i * N * P + HALF * P, mask=fix_mask, other=0.0).to(tl.float32)
            full_lo = local_lo + entry_scale * tl.load(entry_tile, mask=fix_mask, other=0.0)
            full_hi = local_hi + entry_scale * tl.load(entry_tile + HALF * P, mask=fix_mask, other=0.0)
            if i > 0 or not DEFER_FIRST_STORE:
                tl.store(state_tile + i * N * P, full_lo.to(states_ptr.dtype.element_ty), mask=fix_mask)
                tl.store(state_tile + i * N * P + HALF * P, full_hi.to(states_ptr.dtype.element_ty), mask=fix_mask)
            if i == 0:
                state_lo, state_hi = full_lo, full_hi
    return state_lo, state_hi


@triton.jit
def store_entering_state(states_ptr, state_lo, state_hi, bh, first_chunk, NCH, CHUNKS_PER_SEG, offs_half, half_mask,
                         offs_p, p_mask, N: tl.constexpr, P: tl.constexpr):
    """Write the full state entering ``first_chunk`` (fp32 halves from ``load_entering_state`` with ADD_ENTRY and
    DEFER_FIRST_STORE) over its segment-local one: where that one took the entry (not in segment 0, not past NCH)."""
    HALF: tl.constexpr = N // 2
    state_tile = states_ptr + bh * NCH * N * P + first_chunk * N * P + offs_half[:, None] * P + offs_p[None, :]
    fix_mask = half_mask[:, None] & p_mask[None, :] & (first_chunk < NCH) & (first_chunk // CHUNKS_PER_SEG > 0)
    tl.store(state_tile, state_lo.to(states_ptr.dtype.element_ty), mask=fix_mask)
    tl.store(state_tile + HALF * P, state_hi.to(states_ptr.dtype.element_ty), mask=fix_mask)


@triton.jit
def load_rows(ptr, row_offs, row_mask, offs_cols, col_mask, VOLATILE: tl.constexpr = False):
    """[rows, cols] fp32 tile, row i read at ``ptr + row_offs[i] + col``; masked elements are 0.

    VOLATILE keeps the load from being merged with an identical earlier one (whose tile would then stay live).
    """
    mask = row_mask[:, None] & col_mask[None, :]
    return tl.load(ptr + row_offs[:, None] + offs_cols[None, :], mask=mask, other=0.0,
                   volatile=VOLATILE).to(tl.float32)


@triton.jit
def accumulate_rank_grads(raw_y, r, dphi_acc, dzeta_acc, dz_acc, dout_tok, z_tok, v_tok, d_skip,
                          psi_head_ptr, phi_head_ptr, zeta_head_ptr, ranks, offs_p, p_mask,
                          P: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
                          FAST_SIGMOID: tl.constexpr = False, PRECISE_SIGMOID: tl.constexpr = False):
    """Finish query rank r of a chunk: add the D skip to raw_y, fold its gradients into the accumulators.

    raw_y: [tokens, cols] without the skip; dphi_acc, dzeta_acc: [BLOCK_R, cols] per-rank token
    sums; dz_acc: [tokens, cols] rank sum; ``*_head_ptr`` point at the [R, P] parameters of the head.
    """
    if HAS_D:
        psi_r = tl.load(psi_head_ptr + r * P + offs_p, mask=p_mask, other=0.0)
        raw_y += (d_skip * v_tok) * psi_r[None, :]
    phi_r = tl.load(phi_head_ptr + r * P + offs_p, mask=p_mask, other=0.0)
    zeta_r = tl.load(zeta_head_ptr + r * P + offs_p, mask=p_mask & HAS_Z, other=0.0)
    dphi_r, dzeta_r, dz_r = rank_gate_grads(raw_y, dout_tok, z_tok, phi_r, zeta_r, HAS_Z, FAST_SIGMOID,
                                            PRECISE_SIGMOID)
    dphi_acc += tl.where(ranks[:, None] == r, dphi_r[None, :], 0.0)
    if HAS_Z:
        dzeta_acc += tl.where(ranks[:, None] == r, dzeta_r[None, :], 0.0)
        dz_acc += dz_r
    return dphi_acc, dzeta_acc, dz_acc


@triton.jit
def gate_grad_terms(raw_y, dout, z, phi, zeta, HAS_Z: tl.constexpr, FAST_SIGMOID: tl.constexpr = False,
                    PRECISE_SIGMOID: tl.constexpr = False):
    """Per-element gradient terms of out = Phi * silu(z * Zeta) * raw_y (one query rank per element).

    raw_y, dout, z: [rows, cols] fp32 (z unused without Z); phi, zeta: broadcastable to them.
    Returns (dPhi term, dZeta term, dz term), each [rows, cols]; without Z the gate is 1 and the
    last two are zeros.  FAST_SIGMOID, PRECISE_SIGMOID: see ``silu_and_grad``.
    """
    # This order of the products is the one the fp32 dual benchmark was validated with (the MERE of
    # dmimo_o sits near its bound on some inputs: test_gpu_pairwise, B1-S64-H4-fp32-Z-noD, stage0).
    if HAS_Z:
        gate, dgate = silu_and_grad(z * zeta, FAST_SIGMOID, PRECISE_SIGMOID)
        du = dout * phi * raw_y * dgate
        return gate * raw_y * dout, du * z, du * zeta
    else:
        zero = tl.zeros_like(raw_y)
        return raw_y * dout, zero, zero


@triton.jit
def rank_gate_grads(raw_y, dout_tok, z_tok, phi_r, zeta_r, HAS_Z: tl.constexpr, FAST_SIGMOID: tl.constexpr = False,
                    PRECISE_SIGMOID: tl.constexpr = False):
    """Gradient pieces of one query rank r of out = sum_r Phi * silu(z * Zeta) * raw_y.

    raw_y, dout_tok, z_tok: [tokens, cols] fp32 (z_tok unused without Z); phi_r, zeta_r: [cols].
    Returns (dPhi[r] token sum [cols], dZeta[r] token sum [cols], dz term of r [tokens, cols]);
    without Z the gate is 1 and the last two are zeros.
    """
    dphi, dzeta, dz = gate_grad_terms(raw_y, dout_tok, z_tok, phi_r[None, :], zeta_r[None, :], HAS_Z,
                                     FAST_SIGMOID, PRECISE_SIGMOID)
    return tl.sum(dphi, axis=0), tl.sum(dzeta, axis=0), dz


@triton.jit
def accumulate_rank_group_grads(raw_y, q_rank, q_local, rank_group, q_mask, dphi_acc, dzeta_acc, dz_rows,
                                dout_q, z_q, v_q, d_skip, psi_head_ptr, phi_head_ptr, zeta_head_ptr, ranks,
                                offs_p, p_mask, F: tl.constexpr, P: tl.constexpr, HAS_Z: tl.constexpr,
                                HAS_D: tl.constexpr, FAST_SIGMOID: tl.constexpr = False,
                                PRECISE_SIGMOID: tl.constexpr = False):
    """``accumulate_rank_grads`` for a query tile of F ranks: row i is token q_t[i], rank q_rank[i].

    q_local = q_rank - rank_group * F (0..F-1); dz_rows: [rows, cols] running sum over rank groups,
    still per (token, local rank) row: the caller sums its F rows per token once per chunk.
    """
    param_offs = q_rank * P
    if HAS_D:
        raw_y += (d_skip * v_q) * load_rows(psi_head_ptr, param_offs, q_mask, offs_p, p_mask)
    phi_q = load_rows(phi_head_ptr, param_offs, q_mask, offs_p, p_mask)
    zeta_q = load_rows(zeta_head_ptr, param_offs, q_mask & HAS_Z, offs_p, p_mask)
    dphi_q, dzeta_q, dz_q = gate_grad_terms(raw_y, dout_q, z_q, phi_q, zeta_q, HAS_Z, FAST_SIGMOID, PRECISE_SIGMOID)
    for j in tl.static_range(F):
        in_rank = (q_local == j)[:, None]
        is_acc_row = ranks[:, None] == rank_group * F + j
        dphi_acc += tl.where(is_acc_row, tl.sum(tl.where(in_rank, dphi_q, 0.0), axis=0)[None, :], 0.0)
        if HAS_Z:
            dzeta_acc += tl.where(is_acc_row, tl.sum(tl.where(in_rank, dzeta_q, 0.0), axis=0)[None, :], 0.0)
    if HAS_Z:
        dz_rows += dz_q
    return dphi_acc, dzeta_acc, dz_rows


@triton.jit
def select_rows_sum(selection, x, SUM_DTYPE: tl.constexpr):
    """Sums of chosen rows: ``selection`` [M, rows] of 0/1 (bool) times ``x`` [rows, cols] fp32.

    With SUM_DTYPE fp32 an exact ieee product.  With a half SUM_DTYPE the tensor cores take x
    split in two, hi = x rounded and lo = the rest, so the sum keeps about twice that dtype's
    mantissa (2^-16 relative in bf16): far inside the half-precision contract.
    """
    if SUM_DTYPE == tl.float32:
        return tl.dot(selection.to(tl.float32), x, input_precision="ieee")
    else:
        sel = selection.to(SUM_DTYPE)
        hi = x.to(SUM_DTYPE)
        lo = (x - hi.to(tl.float32)).to(SUM_DTYPE)
        return tl.dot(sel, lo, tl.dot(sel, hi))
