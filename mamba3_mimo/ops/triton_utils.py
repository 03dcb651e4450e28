"""Triton helpers shared by every bwd_fwd kernel.

Layout convention of the kernels: one chunk's (token, rank) pairs are flattened
into rows, ``row = t_local * BLOCK_R + r`` with ``BLOCK_R = next_pow2(R)``, so a
chunk tile has ``BLOCK_ROWS = BLOCK_T * BLOCK_R`` rows and can be reshaped to
``[BLOCK_T, BLOCK_R, ...]`` to reduce over ranks or over tokens.  Rows with
``t_local >= C`` or ``r >= R`` are padding and are masked everywhere.

Sequences that are not a whole number of chunks are padded *virtually*
(SPEC section 4): loads past the valid length ``S`` return zeros for
activations, ``da_cs`` is clamped to its last valid value, and stores past
``S`` are masked.  This is the same arithmetic as padding on the host, without
the copies.
"""

import triton
import triton.language as tl


@triton.jit
def chunk_rows(BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, C: tl.constexpr, R: tl.constexpr):
    """Row indices of a chunk tile: (t_local, r, valid), each [BLOCK_T * BLOCK_R]."""
    rows = tl.arange(0, BLOCK_T * BLOCK_R)
    row_t = rows // BLOCK_R
    row_r = rows % BLOCK_R
    return row_t, row_r, (row_t < C) & (row_r < R)


@triton.jit
def rotate_half(x_lo, x_hi, cos, sin):
    """Rotate-half on the paired halves x[n], x[N/2 + n]; cos = 1, sin = 0 where n >= RD."""
    return x_lo * cos - x_hi * sin, x_lo * sin + x_hi * cos


@triton.jit
def broadcast_tokens_to_rows(x, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """[BLOCK_T, BLOCK_COLS] per-token tile -> [BLOCK_T * BLOCK_R, BLOCK_COLS] per-row tile."""
    x3 = tl.broadcast_to(x[:, None, :], (BLOCK_T, BLOCK_R, BLOCK_COLS))
    return tl.reshape(x3, (BLOCK_T * BLOCK_R, BLOCK_COLS))


@triton.jit
def sum_over_ranks(x, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, SUM_T: tl.constexpr,
                   SUM_PRECISION: tl.constexpr):
    """[BLOCK_T * BLOCK_R, cols] -> [SUM_T, cols], summing each token's ranks; rows >= BLOCK_T are 0.

    A product with a 0/1 selection matrix rather than a 3-d reshape and sum:
    the reshape-sum of [64, 32] tiles was the construct common to the two
    kernels that faulted on the H200 (N128_P32_R4_C16).  SUM_PRECISION is
    tf32x3 (~2^-21, fp32 accuracy) for fp32 inputs and tf32 (~2^-11, fewer
    registers) for half inputs; SUM_T = max(16, BLOCK_T) because tl.dot needs M >= 16.
    """
    rows = tl.arange(0, BLOCK_T * BLOCK_R)
    tokens = tl.arange(0, SUM_T)
    select = tl.where((rows // BLOCK_R)[None, :] == tokens[:, None], 1.0, 0.0)
    return tl.dot(select, x, input_precision=SUM_PRECISION)


@triton.jit
def sum_over_tokens(x, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, SUM_R: tl.constexpr,
                    SUM_PRECISION: tl.constexpr):
    """[BLOCK_T * BLOCK_R, cols] -> [SUM_R, cols], summing each rank over tokens; rows >= BLOCK_R are 0.

    Same selection product as ``sum_over_ranks``; SUM_R = max(16, BLOCK_R).
    """
    rows = tl.arange(0, BLOCK_T * BLOCK_R)
    ranks = tl.arange(0, SUM_R)
    select = tl.where((rows % BLOCK_R)[None, :] == ranks[:, None], 1.0, 0.0)
    return tl.dot(select, x, input_precision=SUM_PRECISION)


@triton.jit
def load_token_discretization(da_cs_ptr, da_rev_ptr, dt_ptr, trap_ptr, t_abs, S):
    """Per-position discretization terms at absolute positions ``t_abs`` of one (b, h).

    Returns (da_cs, da_cs_rev, gamma, trap_scale), fp32, shaped like ``t_abs``:
      gamma      = dt[t] * sigmoid(trap[t])                (weight of token t on itself)
      trap_scale = gamma[t] + dt[t+1] * sigmoid(-trap[t+1]) (weight of token t on later tokens)
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
    gamma = dt * tl.sigmoid(trap)
    trap_scale = gamma + dt_next * tl.sigmoid(-trap_next)
    return da_cs, da_rev, gamma, trap_scale


@triton.jit
def intra_chunk_weights(row_t, col_t, row_mask, col_mask, da_row, da_col, gamma_row, ts_col):
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
    decay = tl.exp(tl.where(earlier, da_row[:, None] - da_col[None, :], 0.0))
    return tl.where(earlier, decay * ts_col[None, :], tl.where(same, gamma_row[:, None], 0.0))


@triton.jit
def silu_and_grad(u):
    """(silu(u), silu'(u)) with silu'(u) = sigmoid(u) * (1 + u * (1 - sigmoid(u)))."""
    sig = tl.sigmoid(u)
    return u * sig, sig * (1.0 + u * (1.0 - sig))


@triton.jit
def load_chunk_cos_sin(angles_seq_ptr, t0, S, token_stride, offs_half,
                       BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       C: tl.constexpr, RD: tl.constexpr):
    """cos/sin of one chunk's rotation angles, broadcast to rows: two [BLOCK_ROWS, BLOCK_HALF].

    ``angles_seq_ptr`` points at angles[b, 0, h, 0]; columns n >= RD get
    angle 0 (cos 1, sin 0), which leaves those dimensions unrotated.  The
    transcendentals run once per token, not once per (token, rank).
    """
    tok = tl.arange(0, BLOCK_T)
    mask = ((tok < C) & (t0 + tok < S))[:, None] & (offs_half < RD)[None, :]
    theta = tl.load(angles_seq_ptr + (t0 + tok)[:, None] * token_stride + offs_half[None, :], mask=mask, other=0.0)
    theta = theta.to(tl.float32)
    cos = broadcast_tokens_to_rows(tl.cos(theta), BLOCK_T, BLOCK_R, BLOCK_HALF)
    sin = broadcast_tokens_to_rows(tl.sin(theta), BLOCK_T, BLOCK_R, BLOCK_HALF)
    return cos, sin


@triton.jit
def broadcast_ranks_to_rows(x, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """[BLOCK_R, BLOCK_COLS] per-rank tile -> [BLOCK_T * BLOCK_R, BLOCK_COLS] per-row tile."""
    x3 = tl.broadcast_to(x[None, :, :], (BLOCK_T, BLOCK_R, BLOCK_COLS))
    return tl.reshape(x3, (BLOCK_T * BLOCK_R, BLOCK_COLS))


@triton.jit
def load_rank_tile(param_head_ptr, offs_cols, col_mask, R: tl.constexpr, COLS: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """A per-head [R, COLS] parameter (bias, Psi, Phi, Zeta) laid out per row: [BLOCK_ROWS, BLOCK_COLS] fp32.

    It is read as a small [BLOCK_R, BLOCK_COLS] tile and broadcast over tokens,
    so no [BLOCK_ROWS, BLOCK_COLS] address tile is kept alive across the scan.
    """
    ranks = tl.arange(0, BLOCK_R)
    mask = (ranks < R)[:, None] & col_mask[None, :]
    tile = tl.load(param_head_ptr + ranks[:, None] * COLS + offs_cols[None, :], mask=mask, other=0.0)
    return broadcast_ranks_to_rows(tile.to(tl.float32), BLOCK_T, BLOCK_R, BLOCK_COLS)


@triton.jit
def load_token_tile(x_seq_ptr, t0, S, tok, token_stride, offs_cols, col_mask, C: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """One chunk of a [B, S, H, P] activation laid out per row: [BLOCK_ROWS, BLOCK_COLS] fp32.

    ``x_seq_ptr`` points at x[b, 0, h, 0]; the chunk is read once per token and
    broadcast over ranks.  Positions past S read as zeros (virtual padding).
    """
    mask = ((tok < C) & (t0 + tok < S))[:, None] & col_mask[None, :]
    offs = (t0 + tok)[:, None] * token_stride + offs_cols[None, :]
    tile = tl.load(x_seq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return broadcast_tokens_to_rows(tile, BLOCK_T, BLOCK_R, BLOCK_COLS)


@triton.jit
def load_rotated_rows(x_seq_ptr, bias_head_ptr, t_abs, row_r, row_mask, token_stride, rank_stride,
                      offs_half, half_mask, cos, sin, N: tl.constexpr, R: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                      DOT_DTYPE: tl.constexpr):
    """Biased, rotated q or k rows of one chunk as halves (x~[:, :N/2], x~[:, N/2:]) in DOT_DTYPE.

    ``x_seq_ptr`` points at x[b, 0, 0, g, 0] of a [B, S, R, G, N] tensor and
    ``bias_head_ptr`` at bias[h, 0, 0] of [H, R, N]; ``row_mask`` already
    excludes padding rows and positions past S.  Offsets are built from the
    absolute positions ``t_abs`` inside the chunk loop, so the compiler does not
    hoist [BLOCK_ROWS, BLOCK_HALF] address tiles out of it (they would live in
    registers for the whole scan).
    """
    HALF: tl.constexpr = N // 2
    offs = t_abs[:, None] * token_stride + row_r[:, None] * rank_stride + offs_half[None, :]
    mask = row_mask[:, None] & half_mask[None, :]
    x_lo = tl.load(x_seq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(x_seq_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    x_lo += load_rank_tile(bias_head_ptr, offs_half, half_mask, R, N, BLOCK_T, BLOCK_R, BLOCK_HALF)
    x_hi += load_rank_tile(bias_head_ptr + HALF, offs_half, half_mask, R, N, BLOCK_T, BLOCK_R, BLOCK_HALF)
    x_lo, x_hi = rotate_half(x_lo, x_hi, cos, sin)
    return x_lo.to(DOT_DTYPE), x_hi.to(DOT_DTYPE)


@triton.jit
def state_increment(k_lo, k_hi, psiv, k_weight, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One chunk's state increment, as halves: k~^T @ (k_weight * psiv), two [BLOCK_HALF, BLOCK_P] fp32.

    ``k_weight[row] = exp(da_cs_rev[t]) * trap_scale[t]`` decays every token to
    the chunk end; it is zero on padding rows.  It scales the psiv rows rather
    than k~, so k~ is needed in one form only.
    """
    psiv_w = (psiv * k_weight[:, None]).to(DOT_DTYPE)
    inc_lo = tl.dot(tl.trans(k_lo), psiv_w, input_precision=DOT_PRECISION)
    inc_hi = tl.dot(tl.trans(k_hi), psiv_w, input_precision=DOT_PRECISION)
    return inc_lo, inc_hi


@triton.jit
def gate_grads(raw_y, dout_rows, phi, z_rows, zeta):
    """Per-row gradient pieces of out = sum_r Phi * silu(z * Zeta) * raw_y.

    Returns (dPhi term, dZeta term, dz term before the rank sum), each [BLOCK_ROWS, BLOCK_P].
    """
    gate, dgate = silu_and_grad(z_rows * zeta)
    du = dout_rows * phi * raw_y * dgate
    return gate * raw_y * dout_rows, du * z_rows, du * zeta


@triton.jit
def store_token_tile(ptr, tile, t0, S, tok, token_stride, offs_cols, col_mask, C: tl.constexpr):
    """Store a [BLOCK_T, BLOCK_COLS] per-token tile at ptr + (t0 + tok) * token_stride + col."""
    mask = ((tok < C) & (t0 + tok < S))[:, None] & col_mask[None, :]
    offs = (t0 + tok).to(tl.int64)[:, None] * token_stride + offs_cols[None, :]
    tl.store(ptr + offs, tile.to(ptr.dtype.element_ty), mask=mask)


# --- gathered row tiles (production kernels) ---------------------------------------------------
# The production kernels address each row of a tile by its own (token, rank) pair and load it
# straight from memory, so they never reshape or broadcast register tiles between layouts.


@triton.jit
def _row_col(row_vals, col_vals, TRANSPOSED: tl.constexpr):
    """Broadcast per-row and per-column vectors to a [rows, cols] tile, or [cols, rows] if TRANSPOSED."""
    if TRANSPOSED:
        return row_vals[None, :], col_vals[:, None]
    else:
        return row_vals[:, None], col_vals[None, :]


@triton.jit
def load_rotated_gather(x_seq_ptr, bias_head_ptr, cos_seq_ptr, sin_seq_ptr, t_pos, ranks, row_mask,
                        token_stride, rank_stride, angle_stride, offs_half, half_mask,
                        N: tl.constexpr, RD: tl.constexpr, DOT_DTYPE: tl.constexpr,
                        TRANSPOSED: tl.constexpr = False):
    """Biased, rotated q or k rows as halves (x~[:, n], x~[:, N/2 + n]) for n in ``offs_half``.

    Row i is token ``t_pos[i]``, rank ``ranks[i]`` (both [rows] int tensors).  ``x_seq_ptr`` points
    at x[b, 0, 0, g, 0] of [B, S, R, G, N], ``bias_head_ptr`` at bias[h, 0, 0] of [H, R, N],
    ``cos_seq_ptr`` / ``sin_seq_ptr`` at cos(angles)[b, 0, h, 0] / sin(angles)[b, 0, h, 0] (fp32,
    precomputed: libdevice cos/sin per row doubled the registers of the kernels).  Masked rows
    come out exactly zero.  With TRANSPOSED the tiles are [half, rows], loaded that way from
    memory (the operand layout of k~^T products, with no register transpose).
    """
    HALF: tl.constexpr = N // 2
    row_ok, col_ok = _row_col(row_mask, half_mask, TRANSPOSED)
    mask = row_ok & col_ok
    row_addr, col = _row_col(t_pos * token_stride + ranks * rank_stride, offs_half, TRANSPOSED)
    offs = row_addr + col
    row_bias, _ = _row_col(ranks * N, offs_half, TRANSPOSED)
    bias_offs = row_bias + col
    x_lo = tl.load(x_seq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(x_seq_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    x_lo = tl.where(mask, x_lo + tl.load(bias_head_ptr + bias_offs, mask=mask, other=0.0), 0.0)
    x_hi = tl.where(mask, x_hi + tl.load(bias_head_ptr + bias_offs + HALF, mask=mask, other=0.0), 0.0)
    row_angle, _ = _row_col(t_pos * angle_stride, offs_half, TRANSPOSED)
    _, col_rotated = _row_col(row_mask, offs_half < RD, TRANSPOSED)
    rotated = mask & col_rotated
    cos = tl.load(cos_seq_ptr + row_angle + col, mask=rotated, other=1.0)
    sin = tl.load(sin_seq_ptr + row_angle + col, mask=rotated, other=0.0)
    x_lo, x_hi = rotate_half(x_lo, x_hi, cos, sin)
    return x_lo.to(DOT_DTYPE), x_hi.to(DOT_DTYPE)


@triton.jit
def load_rows(ptr, row_offs, row_mask, offs_cols, col_mask):
    """[rows, cols] fp32 tile, row i read at ``ptr + row_offs[i] + col``; masked elements are 0."""
    mask = row_mask[:, None] & col_mask[None, :]
    return tl.load(ptr + row_offs[:, None] + offs_cols[None, :], mask=mask, other=0.0).to(tl.float32)
