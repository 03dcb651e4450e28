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
def sum_over_ranks(x, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """[BLOCK_T * BLOCK_R, BLOCK_COLS] -> [BLOCK_T, BLOCK_COLS], summing each token's ranks."""
    return tl.sum(tl.reshape(x, (BLOCK_T, BLOCK_R, BLOCK_COLS)), axis=1)


@triton.jit
def sum_over_tokens(x, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """[BLOCK_T * BLOCK_R, BLOCK_COLS] -> [BLOCK_R, BLOCK_COLS], summing each rank over tokens."""
    return tl.sum(tl.reshape(x, (BLOCK_T, BLOCK_R, BLOCK_COLS)), axis=0)


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
def load_chunk_cos_sin(angles_chunk_ptr, t0, S, token_stride, offs_half,
                       BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       C: tl.constexpr, RD: tl.constexpr):
    """cos/sin of one chunk's rotation angles, broadcast to rows: two [BLOCK_ROWS, BLOCK_HALF].

    ``angles_chunk_ptr`` points at angles[b, t0, h, 0]; columns n >= RD get
    angle 0 (cos 1, sin 0), which leaves those dimensions unrotated.  The
    transcendentals run once per token, not once per (token, rank).
    """
    tok = tl.arange(0, BLOCK_T)
    mask = ((tok < C) & (t0 + tok < S))[:, None] & (offs_half < RD)[None, :]
    theta = tl.load(angles_chunk_ptr + tok[:, None] * token_stride + offs_half[None, :], mask=mask, other=0.0)
    theta = theta.to(tl.float32)
    cos = broadcast_tokens_to_rows(tl.cos(theta), BLOCK_T, BLOCK_R, BLOCK_HALF)
    sin = broadcast_tokens_to_rows(tl.sin(theta), BLOCK_T, BLOCK_R, BLOCK_HALF)
    return cos, sin


@triton.jit
def load_rotated_rows(x_chunk_ptr, row_t, row_r, row_mask, token_stride, rank_stride,
                      offs_half, half_mask, bias_lo, bias_hi, cos, sin, HALF: tl.constexpr):
    """Biased, rotated q or k rows of one chunk as halves (x~[:, :N/2], x~[:, N/2:]), fp32.

    ``x_chunk_ptr`` points at x[b, t0, 0, g, 0] of a [B, S, R, G, N] tensor;
    ``row_mask`` already excludes padding rows and positions past S.
    """
    offs = row_t[:, None] * token_stride + row_r[:, None] * rank_stride + offs_half[None, :]
    mask = row_mask[:, None] & half_mask[None, :]
    x_lo = tl.load(x_chunk_ptr + offs, mask=mask, other=0.0).to(tl.float32) + bias_lo
    x_hi = tl.load(x_chunk_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32) + bias_hi
    return rotate_half(x_lo, x_hi, cos, sin)


@triton.jit
def load_rank_rows(param_ptr, row_r, row_rank_mask, offs_cols, col_mask, COLS: tl.constexpr):
    """Rows of a per-head [R, COLS] parameter, indexed by each row's rank: [BLOCK_ROWS, BLOCK_COLS] fp32."""
    mask = row_rank_mask[:, None] & col_mask[None, :]
    return tl.load(param_ptr + row_r[:, None] * COLS + offs_cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_token_rows(x_chunk_ptr, row_t, row_mask, token_stride, offs_cols, col_mask):
    """Rows of a [B, S, H, P] activation, indexed by each row's token: [BLOCK_ROWS, BLOCK_COLS] fp32.

    ``x_chunk_ptr`` points at x[b, t0, h, 0]; ranks of one token read the same
    values (served from L1).
    """
    mask = row_mask[:, None] & col_mask[None, :]
    offs = row_t[:, None] * token_stride + offs_cols[None, :]
    return tl.load(x_chunk_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def state_increment(k_lo, k_hi, k_weight, psiv_dot, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One chunk's state increment, as halves: (k~ * k_weight)^T @ psiv, two [BLOCK_HALF, BLOCK_P] fp32.

    ``k_weight[row] = exp(da_cs_rev[t]) * trap_scale[t]`` decays every token to
    the chunk end; it is zero on padding rows.
    """
    k_lo_w = (k_lo * k_weight[:, None]).to(DOT_DTYPE)
    k_hi_w = (k_hi * k_weight[:, None]).to(DOT_DTYPE)
    inc_lo = tl.dot(tl.trans(k_lo_w), psiv_dot, input_precision=DOT_PRECISION)
    inc_hi = tl.dot(tl.trans(k_hi_w), psiv_dot, input_precision=DOT_PRECISION)
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
